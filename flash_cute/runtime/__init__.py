"""The runtime (torch): validation into a problem record, dispatch to a pipeline, planning,
launch, the JIT and its disk cache. Kernels are named, never imported (`KernelRef`); the DSL is
imported lazily, through `jit`, only to compile."""
