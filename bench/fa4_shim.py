"""conftest.py for running flash_attn.cute's own tests on flash-cute (copied next to them by
`bench/fa4_tests.sh`): the public functions of `flash_attn.cute.interface` become
flash-cute's before the test module imports them, so the tests call flash-cute exactly as
they call FA4; FA4's helpers (`flash_attn.cute.testing`: its reference, padding masks and
fake-tensor mode) stay FA4's."""

import flash_attn.cute.interface as fa4

import flash_cute

for _name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_combine"):
    setattr(fa4, _name, getattr(flash_cute, _name))
