"""The registry behind the operators' `variant` key: a call's mods (`CallMods`: traced graphs,
a block mask's states, or FA4-form mods with their aux tensors) under an int key, the same
functions (and block mask, captured tensors) getting the same key; an entry goes when what
owns it is collected (`holders`), and FA4-form entries of aux scalar values go least recently
registered first beyond `SCALAR_ENTRIES`. The registry's state (`_REGISTRY`, `_KEYS`,
`_OWNERS`, ...) lives here only.
"""

import collections
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from flash_cute.variants.kernel_view import AUX_DTYPES, MAX_AUX
from flash_cute.variants.tracer import ModGraph, UnsupportedMod, alibi_graph, trace


class CallMods(NamedTuple):
    """A call's modifications: the traced graphs (None where absent) and a block mask's
    per-block states (`flash_cute.variants.block_mask.block_states`) with its block size; or
    FA4-form mods (`fa4`: a `contract.mods.Fa4Spec`) with weak references to the call's aux
    tensors."""
    score_mod: Optional[ModGraph]
    mask_mod: Optional[ModGraph]
    block_states: Optional[torch.Tensor] = None
    block_size: Optional[tuple] = None
    fa4: Optional[object] = None
    aux_tensors: tuple = ()
    aux_scalars: tuple = ()


_REGISTRY = {}
_KEYS = {}
# FA4-form entries apart: `registered` (traced by torch.compile, which reads the dict it
# looks in) then sees the FlexAttention-form ones only, however many scalar values FA4-form
# calls register.
_FA4_KEYS = {}
_NEXT = [1]


def register_alibi(slopes: torch.Tensor, mask_mod: Optional[Callable] = None,
                   block_mask=None) -> int:
    """The registry key of ALiBi with these slopes, with an optional mask mod or block mask
    (kept while the tensor and the block mask live)."""
    ident = ("alibi", id(slopes), mask_mod, None if block_mask is None else id(block_mask))
    return _store(ident, lambda: alibi_graph(slopes), mask_mod, block_mask, (slopes,))


def register(score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
             block_mask=None) -> int:
    """The registry key of a call's mods (0 for none), the operators' `variant` argument:
    the same functions (and block mask object) get the same key, traced once. A block mask's
    mask mod stands in for a missing `mask_mod`; its entry goes when the block mask does.
    Call it before `torch.compile` traces a call with these mods (a trace cannot run the
    tracer), or make one eager call.

    Args:
        score_mod: FlexAttention's `score_mod(score, b, h, q_idx, kv_idx)`, or None.
        mask_mod: FlexAttention's `mask_mod(b, h, q_idx, kv_idx)`, or None.
        block_mask: a FlexAttention `BlockMask` (`flash_cute.create_block_mask`), or None.

    Returns:
        The key (an int; 0 when all three are None).

    Raises:
        UnsupportedMod: a mod uses an operation outside the tracer's subset, naming it."""
    if score_mod is None and mask_mod is None and block_mask is None:
        return 0
    ident = (score_mod, mask_mod, None if block_mask is None else id(block_mask))
    return _store(ident, lambda: None if score_mod is None else trace(score_mod, "score"),
                  mask_mod, block_mask, ())


def _store(ident, score_graph: Callable, mask_mod, block_mask, owners: tuple) -> int:
    """The key of `ident`, building its `CallMods` the first time; the entry is forgotten when
    any of `owners` (and the block mask) is collected."""
    key = _KEYS.get(ident)
    if key is not None:
        return key
    if mask_mod is None and block_mask is not None:
        mask_mod = block_mask.mask_mod
    states = size = None
    if block_mask is not None:
        from flash_cute.variants.block_mask import block_states

        # int32: the kernels read the states as a captured tensor (`kernel_view.kernel_mods`).
        states, size = block_states(block_mask).to(torch.int32), tuple(block_mask.BLOCK_SIZE)
        owners += (block_mask,)
    variant = CallMods(score_graph(), None if mask_mod is None else trace(mask_mod, "mask"),
                      states, size)
    key, _NEXT[0] = _NEXT[0], _NEXT[0] + 1
    _REGISTRY[key] = variant
    _KEYS[ident] = key
    _own(ident, key, owners)
    return key


def _own(ident, key: int, owners: tuple) -> None:
    """The entry goes when any of `owners` is collected; `holders` gives them back while it
    lives."""
    _OWNERS[key] = tuple(weakref.ref(o) for o in owners)
    for owner in owners:
        weakref.finalize(owner, _forget, ident, key)


def holders(key: int) -> tuple:
    """The objects whose collection ends registry entry `key` (its captured tensors, block
    mask, FA4 aux tensors): an autograd context keeps them, so that a backward finds the
    forward's entry even when the caller dropped them (a block mask built inline in the
    call)."""
    return tuple(ref() for ref in _OWNERS.get(key, ()))


_OWNERS = {}


def register_fa4(score_mod: Optional[Callable], mask_mod: Optional[Callable],
                 score_mod_bwd: Optional[Callable], aux_tensors, aux_scalars=None,
                 block_mask=None) -> int:
    """The registry key of FA4-form mods (`flash_cute.blocks.fa4_mods`) with this call's aux tensors
    (kept while they live: FA4 passes them per call, so each list gets its entry and none
    recompiles, the compile key holding their dtypes and ranks only) and aux scalars (their
    values go to the kernels as parameters, the compile key holds their types; the
    `SCALAR_ENTRIES` value sets registered last keep entries); with a block mask (a
    FlexAttention BlockMask, or FA4's tensors as `block_mask.Fa4Blocks`), kept while it lives,
    its block states joining the aux tensors last."""
    from flash_cute.variants.fa4_spec import fa4_spec, scalar_signature

    aux = tuple(aux_tensors or ())
    if len(aux) > MAX_AUX:
        raise UnsupportedMod(f"{len(aux)} aux_tensors; the kernels take at most {MAX_AUX}")
    sig = []
    for t in aux:
        if not isinstance(t, torch.Tensor) or t.dtype not in AUX_DTYPES:
            raise UnsupportedMod(f"aux_tensors hold {getattr(t, 'dtype', type(t).__name__)}; "
                                 f"the kernels read "
                                 f"{', '.join(sorted(str(d) for d in AUX_DTYPES))}")
        sig.append((AUX_DTYPES[t.dtype], t.dim()))
    kinds, values = scalar_signature(aux_scalars)
    ident = ("fa4", score_mod, mask_mod, score_mod_bwd, tuple(id(t) for t in aux), kinds,
             values, None if block_mask is None else id(block_mask))
    key = _FA4_KEYS.get(ident)
    if key is not None:
        if ident in _SCALAR_KEYS:
            _SCALAR_KEYS.move_to_end(ident)
        return key
    states = size = None
    owners = tuple(aux)
    if block_mask is not None:
        from flash_cute.variants.block_mask import block_states

        if len(aux) >= MAX_AUX:
            raise UnsupportedMod(f"{len(aux)} aux_tensors and a block mask, whose states take "
                                 f"a slot too; the kernels take at most {MAX_AUX}")
        states, size = block_states(block_mask).to(torch.int32), tuple(block_mask.BLOCK_SIZE)
        sig.append(("i32", 4))
        owners += (block_mask,)
    # Weak references: the entry goes when a tensor does (`_forget`), not kept alive by it.
    variant = CallMods(None, None, states, size,
                      fa4=fa4_spec(score_mod, mask_mod, score_mod_bwd, tuple(sig), kinds,
                                   size or ()),
                      aux_tensors=tuple(weakref.ref(t) for t in aux), aux_scalars=values)
    key, _NEXT[0] = _NEXT[0], _NEXT[0] + 1
    _REGISTRY[key] = variant
    _FA4_KEYS[ident] = key
    _own(ident, key, owners)
    if kinds:
        # A scalar that changes every call (a schedule, a temperature) would grow the
        # registry: entries of scalar values go least recently registered first, beyond
        # far more than a forward pass keeps for its backward.
        _SCALAR_KEYS[ident] = key
        while len(_SCALAR_KEYS) > SCALAR_ENTRIES:
            _forget(*_SCALAR_KEYS.popitem(last=False))
    return key


SCALAR_ENTRIES = 4096
_SCALAR_KEYS = collections.OrderedDict()


def _forget(ident, key) -> None:
    _KEYS.pop(ident, None)
    _FA4_KEYS.pop(ident, None)
    _REGISTRY.pop(key, None)
    _OWNERS.pop(key, None)
    _SCALAR_KEYS.pop(ident, None)


def registered(score_mod: Optional[Callable], mask_mod: Optional[Callable],
               block_mask=None) -> Optional[int]:
    """The key `register` gave these, or None (a plain dict lookup: traceable)."""
    return _KEYS.get((score_mod, mask_mod, None if block_mask is None else id(block_mask)))


def lookup(key: int) -> CallMods:
    variant = _REGISTRY.get(key)
    if variant is None:
        raise KeyError(f"variant {key} is not registered (keys come from mod_graph.register)")
    return variant
