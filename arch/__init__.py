"""Per-architecture kernels, installed as flash_cute.arch."""
