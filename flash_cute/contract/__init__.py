"""Contracts: the records and descriptors the layers agree on (the pipeline descriptor,
the kernel switches and argument records, block-range and tile-order integer math, constants
shared by host and device). Plain Python: no torch, no CuTe DSL, nothing else of ours."""
