"""FA4-form mods (`flash_cute.blocks.fa4_mods`) on the CPU: the dual numbers that differentiate a
score mod, against torch.autograd for every operation they carry (run on torch tensors
through the same code, `derivative(namespace=)`), and the compile key of a mod."""

import types

import pytest
import torch

from flash_cute.blocks import fa4_mods
from flash_cute.blocks.fa4_mods import UnsupportedFa4Mod, derivative
from flash_cute.variants import fa4_spec

NS = types.SimpleNamespace(where=torch.where, full_like=torch.full_like)
MATH = types.SimpleNamespace(exp=torch.exp, exp2=torch.exp2, log=torch.log, log2=torch.log2,
                             tanh=torch.tanh, sqrt=torch.sqrt, rsqrt=torch.rsqrt,
                             maximum=torch.maximum, minimum=torch.minimum)
C = torch.tensor([0.7, -1.3, 2.1, 0.4], dtype=torch.float64)

CASES = {
    "add": lambda s: s + C, "radd": lambda s: C + s, "sub": lambda s: s - C,
    "rsub": lambda s: C - s, "mul": lambda s: s * C, "rmul": lambda s: C * s,
    "square": lambda s: s * s, "div": lambda s: s / C, "rdiv": lambda s: C / s,
    "neg": lambda s: -s, "to": lambda s: s.to(torch.float64) * 3,
    "exp": lambda s: MATH.exp(s), "exp2": lambda s: MATH.exp2(s),
    "log": lambda s: MATH.log(s * s + 1), "log2": lambda s: MATH.log2(s * s + 1),
    "tanh": lambda s: MATH.tanh(s), "sqrt": lambda s: MATH.sqrt(s * s + 1),
    "rsqrt": lambda s: MATH.rsqrt(s * s + 1),
    "where": lambda s: NS.where(C > 0, s, NS.full_like(s, float("-inf"))),
    "where_both": lambda s: NS.where(C > 0, s * 2, s * s),
    "maximum": lambda s: MATH.maximum(s, C), "minimum": lambda s: MATH.minimum(C, s),
    "softcap": lambda s: 30.0 * MATH.tanh(s / 30.0),
    "alibi": lambda s: s - 0.25 * torch.tensor([3.0, 1.0, 0.0, 2.0], dtype=torch.float64),
    "constant": lambda s: NS.full_like(s, 2.0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dual_numbers_match_autograd(name):
    f = CASES[name]
    s = torch.tensor([0.3, -0.8, 1.7, -2.2], dtype=torch.float64, requires_grad=True)
    want_value = f(s)
    want = (torch.autograd.grad(want_value.sum(), s, allow_unused=True)[0]
            if want_value.requires_grad else None)
    want = torch.zeros_like(s) if want is None else want
    value, grad = derivative(lambda x, *rest: f(x), s.detach(), namespace=(NS, MATH))
    finite = torch.isfinite(want_value)
    torch.testing.assert_close(value[finite], want_value.detach()[finite])
    torch.testing.assert_close(grad[finite], want[finite])


def test_patched_functions_come_back_and_plain_values_pass_through():
    saved = (NS.where, MATH.exp)
    with fa4_mods.dual_numbers((NS, MATH)):
        assert torch.equal(MATH.exp(torch.zeros(2)), torch.ones(2))
    assert (NS.where, MATH.exp) == saved


def test_a_mod_the_dual_numbers_cannot_carry_is_refused_naming_the_way_out():
    with pytest.raises(UnsupportedFa4Mod, match="score_mod_bwd"):
        derivative(lambda s, *rest: s.abs(), torch.ones(3, dtype=torch.float64),
                   namespace=(NS, MATH))


def test_the_compile_key_follows_code_and_closure_not_the_object():
    def make(scale):
        def mod(s, b, h, q, kv, seqlen_info, aux):
            return s * scale
        return mod

    assert fa4_spec.identity(make(2.0)) == fa4_spec.identity(make(2.0))
    assert fa4_spec.identity(make(2.0)) != fa4_spec.identity(make(3.0))

    def other(s, b, h, q, kv, seqlen_info, aux):
        return s + 1

    spec = fa4_spec.fa4_spec(make(2.0), None, None, (("fp32", 1),))
    assert spec.key() == fa4_spec.fa4_spec(make(2.0), None, None, (("fp32", 1),)).key()
    assert spec.key() != fa4_spec.fa4_spec(other, None, None, (("fp32", 1),)).key()
    assert spec.key() != fa4_spec.fa4_spec(make(2.0), None, None, (("bf16", 1),)).key()
    assert spec.score is not None and spec.score_grad is not None and spec.mask is None


_COMPILE_A_MOD = """
import cutlass.cute as cute
from cutlass import Float32, Int32
from flash_cute.blocks import fa4_mods
from flash_cute.variants import fa4_spec

@cute.jit
def mod(score, b, h, q, kv, seqlen_info, aux):
    return score * cute.full_like(score, 2.0)

@cute.jit
def host(x: Float32):
    s = cute.make_rmem_tensor(1, Float32)
    s[0] = x
    i = cute.make_rmem_tensor(1, Int32)
    i[0] = Int32(0)
    mod(s.load(), i.load(), i.load(), i.load(), i.load(), None, None)

before, code = fa4_spec.identity(mod), mod.__wrapped__.__code__
cute.compile(host, Float32(1.0))
assert mod.__wrapped__.__code__ is not code, "the DSL no longer rewrites the code"
assert fa4_spec.identity(mod) == before, "a compile changed the mod's compile key"
print("stable")
"""


def test_the_compile_key_of_a_mod_survives_its_first_compile(tmp_path):
    """Compiling a `@cute.jit` mod replaces its code (``__wrapped__.__code__``) with the DSL's
    rewritten one: the key stays the one of the first call, else every FA4-form mod compiled twice
    (its first launch under one key, every later one under another)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "compile_a_mod.py"   # the DSL reads a jit function's source file
    script.write_text(_COMPILE_A_MOD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"}, timeout=120)
    assert proc.returncode == 0 and "stable" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_aux_scalars_keep_their_types_and_values_and_refuse_others():
    """FA4's aux_scalars: Python and cutlass Int32 / Float32, their types in the compile key
    (`Fa4Spec.scalars`), their values run-time; other types, or too many, are refused."""
    import cutlass

    kinds, values = fa4_spec.scalar_signature([2, 0.5, cutlass.Int32(7), cutlass.Float32(1.5)])
    assert kinds == ("Int32", "Float32", "Int32", "Float32")
    assert values == (2, 0.5, 7, 1.5)
    assert fa4_spec.scalar_signature(None) == ((), ())
    with pytest.raises(TypeError, match="aux_scalars\\[0\\]"):
        fa4_spec.scalar_signature([True])
    with pytest.raises(TypeError, match="aux_scalars\\[1\\]"):
        fa4_spec.scalar_signature([1, "x"])
    with pytest.raises(ValueError, match="at most"):
        fa4_spec.scalar_signature([1] * 5)
    f = lambda s, b, h, q, k, info, aux, scalars: s  # noqa: E731
    a = fa4_spec.fa4_spec(f, None, None, (), ("Int32",))
    b = fa4_spec.fa4_spec(f, None, None, (), ("Float32",))
    assert a.key() != b.key() and a.key() == fa4_spec.fa4_spec(f, None, None, (), ("Int32",)).key()


def test_aux_scalar_values_get_registry_entries_that_stay_bounded():
    """Each value set is its own registry entry (its plan passes the values); the least
    recently registered go past `SCALAR_ENTRIES`, so a scalar that changes every call does not
    grow the registry, while one registered again (every call re-registers) stays."""
    from flash_cute.variants import registry

    f = lambda s, b, h, q, k, info, aux, scalars: s  # noqa: E731
    kept = registry.register_fa4(f, None, None, None, [-1, 0.5])
    keys = []
    for i in range(registry.SCALAR_ENTRIES + 10):
        keys.append(registry.register_fa4(f, None, None, None, [i, 0.5]))
        assert registry.register_fa4(f, None, None, None, [-1, 0.5]) == kept
    assert len(set(keys)) == len(keys)
    assert registry.lookup(kept).aux_scalars == (-1, 0.5)
    assert registry.lookup(keys[-1]).aux_scalars == (registry.SCALAR_ENTRIES + 9, 0.5)
    with pytest.raises(KeyError):
        registry.lookup(keys[0])
    assert len(registry._SCALAR_KEYS) == registry.SCALAR_ENTRIES
    for ident, key in list(registry._SCALAR_KEYS.items()):
        registry._forget(ident, key)
    assert not registry._SCALAR_KEYS
