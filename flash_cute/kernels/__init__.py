"""The arch-neutral kernels (CuTe DSL), one class per kernel: the backward's pre- and
postprocess. The per-arch kernels live in `flash_cute.arch.<name>`. Imported only to
compile: the runtime names them (`KernelRef`)."""
