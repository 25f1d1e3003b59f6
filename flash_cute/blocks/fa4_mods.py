"""Block: FA4-form score and mask mods, `@cute.jit` functions on TensorSSA vectors, run inside
the kernels' score seam, with their derivative for the backward.

The form is flash_attn.cute's (FlashAttention-4's): ``score_mod(score, b_idx, h_idx, q_idx,
kv_idx, seqlen_info, aux_tensors) -> score``, ``mask_mod(b_idx, h_idx, q_idx, kv_idx,
seqlen_info, aux_tensors) -> Boolean`` and ``score_mod_bwd(grad, score, b_idx, h_idx, q_idx,
kv_idx, seqlen_info, aux_tensors) -> grad``. Scores arrive scaled by the softmax scale, indices
as Int32 vectors (positions inside the sequence; ``seqlen_info.offset_q`` / ``offset_k`` give
the packed tensor's rows), ``aux_tensors`` as the call's tensors; with ``aux_scalars`` (FA4's
run-time scalar captures, Int32 or Float32: `scalar_signature`) each mod takes them as one more
argument, as in FA4, kernel parameters read at each call. Each element is one call on
vectors of one value, so the mods' "vectorized" forms, which assume consecutive key indices
along a vector, hold too.

The backward needs d(score_mod)/d(score). Given ``score_mod_bwd`` it is that function with an
incoming gradient of 1; without one it comes from the same ``score_mod`` run on dual numbers
(`Dual`: a value and its derivative, carried through +, −, ×, ÷, negation, conversion, and,
inside `dual_numbers`, through ``cute.where``, ``cute.full_like`` and ``cute.math``'s exp,
exp2, log, log2, tanh, sqrt, rsqrt and the elementwise min / max). A mod that does anything
else to the score (stores it into a register tensor, calls the MLIR dialects on it) raises
`UnsupportedFa4Mod` while the kernel is traced: pass its ``score_mod_bwd``.
"""

import contextlib
from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from flash_cute.blocks.dsl_state import DslState
from flash_cute.contract.block_range import tiles_nest
from flash_cute.contract.mods import Fa4Spec


class UnsupportedFa4Mod(TypeError):
    """An FA4-form mod whose derivative the dual numbers cannot carry."""


# ---------------------------------------------------------------- dual numbers


class Dual:
    """value + eps · tangent, eps² = 0, over TensorSSA (or any values with + and *)."""

    def __init__(self, value, tangent):
        self.value, self.tangent = value, tangent

    @staticmethod
    def lift(x):
        return x if isinstance(x, Dual) else Dual(x, _zero_like(x))

    def __add__(self, o):
        o = Dual.lift(o)
        return Dual(self.value + o.value, self.tangent + o.tangent)

    __radd__ = __add__

    def __sub__(self, o):
        o = Dual.lift(o)
        return Dual(self.value - o.value, self.tangent - o.tangent)

    def __rsub__(self, o):
        return Dual.lift(o) - self

    def __mul__(self, o):
        o = Dual.lift(o)
        return Dual(self.value * o.value, self.tangent * o.value + self.value * o.tangent)

    __rmul__ = __mul__

    def __truediv__(self, o):
        o = Dual.lift(o)
        q = self.value / o.value
        return Dual(q, (self.tangent - q * o.tangent) / o.value)

    def __rtruediv__(self, o):
        return Dual.lift(o) / self

    def __neg__(self):
        return Dual(-self.value, -self.tangent)

    def to(self, dtype):
        return Dual(self.value.to(dtype), self.tangent.to(dtype))

    @property
    def shape(self):
        return self.value.shape

    @property
    def dtype(self):
        return self.value.dtype

    def __getattr__(self, name):
        raise UnsupportedFa4Mod(
            f"a score_mod used .{name} on the score, which dual numbers do not carry: pass "
            "its score_mod_bwd")


def _zero_like(x):
    if hasattr(x, "dtype") and hasattr(x, "shape") and not isinstance(x, (int, float)):
        return cute.full_like(x, 0) if _is_ssa(x) else x * 0
    return 0.0


def _is_ssa(x) -> bool:
    return isinstance(x, cute.TensorSSA)


# Derivatives of the unary functions, as functions of (x, f(x)).
_LN2 = 0.6931471805599453
_DERIVATIVES = {
    "exp": lambda x, y: y,
    "exp2": lambda x, y: y * _LN2,
    "log": lambda x, y: 1.0 / x,
    "log2": lambda x, y: 1.0 / (x * _LN2),
    "tanh": lambda x, y: 1.0 - y * y,
    "sqrt": lambda x, y: 0.5 / y,
    "rsqrt": lambda x, y: -0.5 * y * y * y,
}


@contextlib.contextmanager
def dual_numbers(namespace=None):
    """While tracing a score mod on `Dual` scores: ``cute.where``, ``cute.full_like`` and the
    unary ``cute.math`` functions in `_DERIVATIVES` (and ``cute.math`` min / max) carry
    derivatives. `namespace`: (cute-like module, math-like module), for tests on the CPU."""
    mod, math = namespace or (cute, cute.math)
    saved = {name: getattr(math, name) for name in list(_DERIVATIVES) + ["maximum", "minimum"]
             if hasattr(math, name)}
    saved_where, saved_full = mod.where, mod.full_like

    def unary(name, f):
        def wrapped(x, *args, **kw):
            if not isinstance(x, Dual):
                return f(x, *args, **kw)
            y = f(x.value, *args, **kw)
            return Dual(y, x.tangent * _DERIVATIVES[name](x.value, y))
        return wrapped

    def where(cond, a, b):
        if not isinstance(a, Dual) and not isinstance(b, Dual):
            return saved_where(cond, a, b)
        a, b = Dual.lift(a), Dual.lift(b)
        return Dual(saved_where(cond, a.value, b.value), saved_where(cond, a.tangent, b.tangent))

    def full_like(x, fill, *args, **kw):
        return saved_full(x.value if isinstance(x, Dual) else x, fill, *args, **kw)

    def extremum(f, pick_first):
        def wrapped(a, b, *args, **kw):
            if not isinstance(a, Dual) and not isinstance(b, Dual):
                return f(a, b, *args, **kw)
            a, b = Dual.lift(a), Dual.lift(b)
            first = pick_first(a.value, b.value)
            return Dual(f(a.value, b.value, *args, **kw),
                        saved_where(first, a.tangent, b.tangent))
        return wrapped

    try:
        for name, f in saved.items():
            if name in _DERIVATIVES:
                setattr(math, name, unary(name, f))
        if "maximum" in saved:
            math.maximum = extremum(saved["maximum"], lambda a, b: a >= b)
        if "minimum" in saved:
            math.minimum = extremum(saved["minimum"], lambda a, b: a <= b)
        mod.where, mod.full_like = where, full_like
        yield
    finally:
        for name, f in saved.items():
            setattr(math, name, f)
        mod.where, mod.full_like = saved_where, saved_full


def derivative(score_mod: Callable, score, *rest, namespace=None):
    """(score_mod(score, *rest), its derivative in score) by dual numbers."""
    with dual_numbers(namespace):
        out = score_mod(Dual(score, _one_like(score)), *rest)
    if not isinstance(out, Dual):
        return out, _zero_like(out)
    return out.value, out.tangent


def _one_like(x):
    return cute.full_like(x, 1.0) if _is_ssa(x) else x * 0 + 1


# ---------------------------------------------------------------- the block


class Fa4SeqInfo(DslState):
    """The ``seqlen_info`` an FA4-form mod reads: offsets and lengths of the tile's sequence."""

    def __init__(self, offset_q, offset_k, seqlen_q, seqlen_k):
        self.offset_q, self.offset_k = offset_q, offset_k
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k


class Fa4Mods(DslState):
    """A kernel's FA4-form mods at one tile (the score seam's counterpart of
    `graph_mods.GraphMods`): `apply` runs them element by element on a fragment."""

    def __init__(self, spec: Fa4Spec, aux, batch: Int32, head: Int32, seq: Fa4SeqInfo,
                 tile_m: int, tile_n: int, pack: int = 1):
        """`aux`: the captured tensors (a block mask's states last), then the aux scalars
        (`score.aux_tensors`)."""
        aux = tuple(aux or ())
        user = len(spec.aux) - int(spec.sparse)
        self.spec = spec
        self.states = aux[user] if spec.sparse else None
        # The mods' trailing arguments, aux_tensors then (FA4 passes them only when the call
        # has them) aux_scalars.
        self.extra = (aux[:user],) + ((aux[len(spec.aux):],) if spec.scalars else ())
        self.batch, self.head, self.seq = batch, head, seq
        self.tile_m, self.tile_n, self.pack = tile_m, tile_n, pack

    def nested(self) -> bool:
        """Whether each of the kernel's tiles lies within one of the block mask's blocks
        (`block_range.tiles_nest`)."""
        return tiles_nest(self.spec.block_size, self.tile_m, self.tile_n, self.pack)

    def apply(self, acc_mn: cute.Tensor, coord_mn: cute.Tensor, m_block: Int32, n_block: Int32,
              mod_scale: Float32, grad_mn=None, mask="mod", visible=None):
        """In place: the score mod's output (of the raw score times `mod_scale`), -inf where
        the mask mod says False (`mask` None: none; "rule": FlexAttention's rule with the
        block mask's state of each element, `Scores.sparse_mods`); `visible` (uniform over
        the tile) ands into it; with `grad_mn`, the derivative there."""
        spec = self.spec
        for r in range(cute.size(acc_mn, mode=[0])):
            q, h = self._row(coord_mn, r, m_block)
            for c in range(cute.size(acc_mn, mode=[1])):
                kv = _vector(Int32(n_block * self.tile_n + coord_mn[r, c][1]), Int32)
                s = acc_mn[r, c]
                if cutlass.const_expr(spec.score_mod is not None):
                    score = _vector(s * mod_scale, Float32)
                    args = (self._b(), h, q, kv, self.seq, *self.extra)
                    if cutlass.const_expr(grad_mn is not None):
                        value, grad = self._with_derivative(score, args)
                        grad_mn[r, c] = grad[0]
                    else:
                        value = spec.score_mod(score, *args)
                    s = value.to(Float32)[0]
                keep = visible
                if cutlass.const_expr(mask == "rule"):
                    keep = self._rule(q, h, kv)
                    if cutlass.const_expr(visible is not None):
                        keep = keep & visible
                elif cutlass.const_expr(spec.mask_mod is not None and mask is not None):
                    keep = spec.mask_mod(self._b(), h, q, kv, self.seq, *self.extra)[0]
                    if cutlass.const_expr(visible is not None):
                        keep = keep & visible
                if cutlass.const_expr(keep is not None):
                    s = Float32(cutlass.select_(keep, Float32(s), -Float32.inf))
                acc_mn[r, c] = s

    def _rule(self, q, h, kv):
        """FlexAttention's rule at one element: its block full, or partial and the mask mod
        (if any) keeps it. The block indices are clamped into the states tensor."""
        states = self.states
        rows, cols = self.spec.block_size
        b = cutlass.min(Int32(self.batch), states.shape[0] - 1)
        head = cutlass.min(h[0], states.shape[1] - 1)
        q_block = cutlass.min(q[0] // rows, states.shape[2] - 1)
        kv_block = cutlass.min(kv[0] // cols, states.shape[3] - 1)
        state = states[b, head, q_block, kv_block]
        keep = state == Int32(2)
        partial = state == Int32(1)
        if cutlass.const_expr(self.spec.mask_mod is not None):
            partial = partial & self.spec.mask_mod(self._b(), h, q, kv, self.seq, *self.extra)[0]
        return keep | partial

    def _with_derivative(self, score, args):
        spec = self.spec
        if cutlass.const_expr(spec.score_mod_bwd is not None):
            value = spec.score_mod(score, *args)
            ones = cute.full_like(score, 1.0)
            return value, spec.score_mod_bwd(ones, score, *args).to(Float32)
        value, grad = derivative(spec.score_mod, score, *args)
        return value, grad.to(Float32)

    def _row(self, coord_mn, r: int, m_block: Int32):
        """(q_idx, h_idx) vectors of fragment row r (packed GQA: the row's query and head)."""
        row = Int32(m_block * self.tile_m + coord_mn[r, 0][0])
        if cutlass.const_expr(self.pack > 1):
            return (_vector(row // self.pack, Int32),
                    _vector(self.head * self.pack + row % self.pack, Int32))
        return _vector(row, Int32), _vector(Int32(self.head), Int32)

    def _b(self):
        return _vector(Int32(self.batch), Int32)


def _vector(value, dtype):
    """A one-element TensorSSA of `value`."""
    t = cute.make_rmem_tensor(1, dtype)
    t[0] = dtype(value)
    return t.load()
