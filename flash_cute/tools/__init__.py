"""Tooling above the library: the CLI's commands (inspect, bench, check, cache), the kernel
registry, the cross-compiler and the SASS reader. Nothing below imports it."""
