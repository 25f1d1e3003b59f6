"""FA4-form mods on the host: the functions' identity hash (their compile-key part), the
`Fa4Spec` a call's mods compile as, and the aux scalars' signature. No CuTe DSL: a cutlass
scalar is told by its type's name."""

import hashlib
import inspect
import weakref
from typing import Callable

from flash_cute.contract.mods import Fa4Spec


def identity(fn: Callable) -> str:
    """A hash of a function's code, source and closure constants (its compile-key part): the
    same function body with the same captured values compiles once. Kept per function object
    from its first call: compiling a `@cute.jit` function replaces its code with the DSL's
    rewritten one."""
    try:
        return _IDENTITIES[fn]
    except (KeyError, TypeError):
        pass
    ident = _identity(fn)
    try:
        _IDENTITIES[fn] = ident
    except TypeError:
        pass
    return ident


_IDENTITIES = weakref.WeakKeyDictionary()


def _identity(fn: Callable) -> str:
    raw = fn
    while getattr(raw, "__wrapped__", None) is not None:
        raw = raw.__wrapped__
    code = getattr(raw, "__code__", None)
    parts = [getattr(raw, "__module__", "") or "", getattr(raw, "__qualname__", repr(raw))]
    if code is not None:
        # The code as well as the source: two lambdas on one line share their source.
        parts += [code.co_code.hex(), repr(code.co_consts), repr(code.co_names)]
        try:
            parts.append(inspect.getsource(raw))
        except (OSError, TypeError):
            pass
        for cell in getattr(raw, "__closure__", None) or ():
            try:
                parts.append(repr(cell.cell_contents))
            except ValueError:
                parts.append("<empty>")
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


def fa4_spec(score_mod, mask_mod, score_mod_bwd, aux_sig: tuple, scalar_sig: tuple = (),
             block_size: tuple = ()) -> Fa4Spec:
    """`block_size`: a block mask's, whose states `aux_sig` then ends with."""
    ident = "|".join(identity(f) if f is not None else "-"
                     for f in (score_mod, mask_mod, score_mod_bwd))
    return Fa4Spec(score_mod, mask_mod, score_mod_bwd, tuple(aux_sig), ident, tuple(scalar_sig),
                   tuple(int(x) for x in block_size))


MAX_SCALARS = 4


def scalar_signature(aux_scalars) -> tuple:
    """((DSL type name, ...), (Python value, ...)) of FA4's aux_scalars: Python ints and
    cutlass.Int32 as Int32, Python floats and cutlass.Float32 as Float32 (FA4 keys its compile
    cache on their types too); anything else raises TypeError."""
    kinds, values = [], []
    for i, x in enumerate(aux_scalars or ()):
        kind = _scalar_kind(x)
        if kind is None:
            raise TypeError(f"aux_scalars[{i}] is a {type(x).__name__}; the kernels take "
                            "int / cutlass.Int32 or float / cutlass.Float32")
        raw = getattr(x, "value", x)
        kinds.append(kind)
        values.append(int(raw) if kind == "Int32" else float(raw))
    if len(kinds) > MAX_SCALARS:
        raise ValueError(f"{len(kinds)} aux_scalars; the kernels take at most {MAX_SCALARS}")
    return tuple(kinds), tuple(values)


# Python scalars by type; cutlass's Int32 / Float32 by their class name (no DSL import here).
_SCALAR_KINDS = {int: "Int32", float: "Float32"}
_DSL_SCALARS = ("Int32", "Float32")


def _scalar_kind(x):
    kind = _SCALAR_KINDS.get(type(x))
    if kind is None and type(x).__module__.split(".")[0] == "cutlass" \
            and type(x).__name__ in _DSL_SCALARS:
        kind = type(x).__name__
    return kind
