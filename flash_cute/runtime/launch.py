"""Host-side launch plumbing shared by every pipeline's `planner.py`: a problem's kernel
switches (`variant_of`), support checks, the cases that need no kernel, `packed_heads`,
restriding, the captured tensors of mods (`CapturedTensors`) and block masks' tiles
(`SparseTiles`), the dropout seed's argument, and `KernelRef` (kept here for the planners).
The launches of a call configuration, worked out once and kept by the plan caches
(`flash_cute.runtime.plans`), are `launch_fwd.ForwardLaunch` (one kernel) and
`launch_bwd.BackwardLaunch` (preprocess, main kernel, dQ), each building its kernel's argument
record (`flash_cute.contract.kernel_args`) once and then passing the fields straight to
TVM-FFI."""


import torch

# Every launch calls a TVM-FFI function: importing it here, not at the first call, keeps its
# tens of milliseconds out of that call (a kernel loaded from the disk cache then starts in a
# few; docs/decisions.md, D-IMPORT).
import tvm_ffi  # noqa: F401

from flash_cute.contract.variant import Variant
from flash_cute.runtime.kernel_ref import KernelRef  # noqa: F401  (planners name kernels by it)


def variant_of(problem, pack_gqa: int = 1, split_kv: bool = False,
                 page_size: int = 0, append: bool = False,
                 ex2_per16: int = 0) -> Variant:
    """From a validated `flash_cute.runtime.problem.AttentionProblem` (and the pipeline's
    decisions on packing its heads and splitting its keys)."""
    mods = None
    if getattr(problem, "mods", None) is not None:
        from flash_cute.variants.kernel_view import kernel_mods

        mods = kernel_mods(problem.mods, getattr(problem, "mod_grads", False))[0]
    return Variant(causal=problem.causal, window_left=problem.window_left is not None,
                   window_right=problem.window_right is not None and not problem.causal,
                   softcap=problem.softcap > 0, varlen=problem.varlen,
                   seqused_q=problem.has_seqused_q, seqused_k=problem.has_seqused_k,
                   pack_gqa=pack_gqa, dropout=problem.dropout_p > 0,
                   dropout_frame=problem.dropout_frame if problem.dropout_p > 0 else "",
                   split_kv=split_kv,
                   page_size=page_size, append=append, ex2_per16=ex2_per16, mods=mods)


def check_head_dims(pipeline: str, problem, supported) -> None:
    if (problem.hdim, problem.hdim_v) not in supported:
        pairs = ", ".join(f"{a}/{b}" for a, b in sorted(supported))
        raise NotImplementedError(
            f"the {pipeline} pipeline has no kernel for hdim/hdim_v {problem.hdim}/"
            f"{problem.hdim_v}; supported: {pairs}")


def check_shared_memory(pipeline: str, needed: int, device) -> None:
    """Refuse before launch when a kernel's tiles exceed what the GPU gives one CTA."""
    available = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    if needed > available:
        raise NotImplementedError(
            f"the {pipeline} kernel needs {needed} bytes of shared memory per CTA; "
            f"{torch.cuda.get_device_name(device)} allows {available}")


def has_no_work(q, k, problem) -> bool:
    """No query row or no key at all: the outputs are O = 0, LSE = -inf, gradients 0, and a
    kernel grid (or a TMA descriptor) would have an empty extent."""
    return (q.numel() == 0 or k.numel() == 0 or problem.batch == 0
            or problem.max_seqlen_q == 0 or problem.max_seqlen_k == 0)


def device_sms(device) -> int:
    """SMs of a CUDA device (for `flash_cute.runtime.splits`); planning with no GPU (`cache warm`)
    assumes an H100/H200's."""
    from flash_cute.contract.tile_order import DEFAULT_NUM_SMS

    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def packed_heads(problem, tile_m: int, fill_rows=None) -> int:
    """How many query heads a forward tile of `tile_m` rows packs (packed GQA; 1: none).

    The heads of a group can share a tile only when their count divides `tile_m` (a tile
    then holds whole queries). ``pack_gqa=True`` requires that (a block mask with a mask per
    head runs unpacked whatever it says, as FA4's do; one shared by the heads packs:
    D-PACK-BLOCKS); None packs where packing
    fills tiles of `fill_rows` rows (default `tile_m`) clearly better: rows used / rows
    computed below 0.9x what packing gets, with max_seqlen_q queries (FlashAttention-3's rule
    without its varlen exception: it picks packing for decode and short prompts and leaves
    long sequences, varlen or not, alone).
    """
    group = problem.qheads_per_kvhead
    if problem.pack_gqa is False or group == 1:
        return 1
    if problem.dropout_p > 0:
        # Dropout draws by (head, query): a packed tile's rows interleave heads.
        if problem.pack_gqa:
            raise NotImplementedError("pack_gqa=True with dropout_p > 0: pass pack_gqa=None")
        return 1
    states = None if problem.mods is None else problem.mods.block_states
    if states is not None and states.shape[1] > 1:
        # A mask per query head: a packed tile's rows would need several heads' tiles, so
        # such calls run unpacked even with pack_gqa=True, as FA4's do (D-PACK-BLOCKS).
        return 1
    if tile_m % group:
        if problem.pack_gqa:
            raise NotImplementedError(
                f"pack_gqa=True: {group} query heads per K/V head do not divide the tile's "
                f"{tile_m} rows; pass pack_gqa=None or False")
        return 1
    if problem.pack_gqa:
        return group
    if problem.max_seqlen_q == 0:   # no query rows (an empty varlen batch): nothing to fill
        return 1
    fill_rows = fill_rows or tile_m

    def filled(rows):
        return rows / (-(-rows // fill_rows) * fill_rows)

    return group if filled(problem.max_seqlen_q) < 0.9 * filled(problem.max_seqlen_q * group) else 1


def restride(t: torch.Tensor, prepare):
    """What a launch does to `t` each call, decided once from a first call's tensor: None
    (pass it as is), "detach" (it requires grad: DLPack refuses it) or the strides `prepare`
    gives it (e.g. `tma_ready`'s); a launch runs with grad disabled, so a view then needs no
    detach."""
    if prepare is not None:
        stride = prepare(t).stride()
        if stride != t.stride():
            return stride
    return "detach" if t.requires_grad else None


def apply(t, how):
    if how is None or t is None:
        return t
    return t.detach() if how == "detach" else t.as_strided(t.shape, how)


class CapturedTensors:
    """The tensors a call's traced mods capture (`problem.mods`), as the records' aux fields:
    the same tensor objects every call (a learnable bias updated in place is read as it is
    then), made kernel-ready (`kernel_view.aux_for_kernel`) at each call."""

    def __init__(self, problem, device):
        from flash_cute.contract.kernel_args import AUX_FIELDS, SCALAR_FIELDS

        self.tensors, self.scalars, self.learned = (), (), ()
        if problem.mods is not None:
            from flash_cute.variants.derivative import learnable
            from flash_cute.variants.kernel_view import kernel_mods

            self.tensors = kernel_mods(problem.mods)[1]
            # FA4's aux_scalars: kernel parameters, after every other field (`SCALAR_FIELDS`).
            self.scalars = tuple(problem.mods.aux_scalars)
            if getattr(problem, "mod_grads", False):
                # A backward's fp32 gradients of the learnable tensors: aux fields after them.
                self.learned = learnable(problem.mods)
        for t in self.tensors:
            if t.device != device:
                raise ValueError(f"a mod captures a tensor (or a block mask) on '{t.device}'; "
                                 f"the kernels read it on the inputs' device '{device}': "
                                 "build it there (.to(q.device))")
        self.empty = (None,) * (len(AUX_FIELDS) - len(self.tensors) - len(self.learned))
        self.scalar_values = self.scalars + (None,) * (len(SCALAR_FIELDS) - len(self.scalars))

    def values(self, grads: tuple = ()) -> tuple:
        """The aux fields of one launch; `grads`: its zeroed gradient buffers
        (`new_gradients`)."""
        if not self.tensors:
            return self.empty
        from flash_cute.variants.kernel_view import aux_for_kernel

        return tuple(aux_for_kernel(t) for t in self.tensors) + tuple(grads) + self.empty

    def new_gradients(self) -> tuple:
        """Zeroed fp32 gradient buffers of the learnable tensors, one launch's."""
        return tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                     for t in self.learned)

    def fields(self) -> dict:
        from flash_cute.contract.kernel_args import SCALAR_FIELDS, aux_fields
        from flash_cute.runtime.jit import TensorArg

        values = self.values(self.new_gradients())
        return {**aux_fields([TensorArg(t, t.element_size()) for t in values
                              if t is not None]),
                **dict(zip(SCALAR_FIELDS, self.scalars))}

    def gradients(self, grads: tuple) -> list:
        """A launch's gradients of the learnable tensors (`new_gradients`), in their dtypes."""
        return [g.to(t.dtype) for g, t in zip(grads, self.learned)]


class SparseTiles:
    """A call's block mask as its kernel's tiles see them (`block_mask.kernel_tiles`), worked
    out once per launch: the tile states and the ranges of non-empty tiles, per query tile
    for a forward, per key tile for a `backward` (None, None without a block mask). A forward
    whose CTA walks `q_tiles_per_cta` query tiles at once gets the query tiles padded to a
    multiple of it, a backward whose cluster walks `key_tiles_per_cta` key tiles the key
    tiles, empty (the padding tiles' rows are past every sequence)."""

    def __init__(self, problem, tile, backward: bool, q_tiles_per_cta: int = 1,
                 key_tiles_per_cta: int = 1):
        self.tensors = (None, None)
        mods = problem.mods
        if mods is None or mods.block_states is None:
            return
        from flash_cute.variants.block_mask import EMPTY, kernel_tiles

        states, fwd, bwd = kernel_tiles(mods.block_states, mods.block_size, tuple(tile),
                                        problem.batch, problem.nheads, problem.max_seqlen_q,
                                        problem.max_seqlen_k)
        pad = -states.shape[2] % q_tiles_per_cta
        if pad and not backward:
            states = torch.nn.functional.pad(states, (0, 0, 0, pad), value=EMPTY)
            fwd = torch.nn.functional.pad(fwd, (0, 0, 0, pad)).contiguous()
        pad = -states.shape[3] % key_tiles_per_cta
        if pad and backward:
            states = torch.nn.functional.pad(states, (0, pad), value=EMPTY)
            bwd = torch.nn.functional.pad(bwd, (0, 0, 0, pad)).contiguous()
        self.tensors = (states.contiguous(), bwd if backward else fwd)

    def fields(self) -> dict:
        from flash_cute.runtime.jit import tensor_arg

        return {"block_states": tensor_arg(self.tensors[0], 4),
                "block_ranges": tensor_arg(self.tensors[1], 4)}


def seed_words(rng_seed, dropout: bool):
    """The kernels' view of a dropout seed (int64 [1], `rng.draw_seed`, or [6] or [7] with a
    frame, `rng.framed_seed`): int32 [2], [12] or [14], each 64-bit value's low word first."""
    if not dropout:
        return None
    if rng_seed is None:
        raise ValueError("dropout_p > 0 needs the call's rng_seed (rng.draw_seed)")
    return rng_seed.view(torch.int32)


def seed_spec(device, dropout: bool):
    """What a kernel is compiled against for the seed (its dtype and rank; the call's own
    seed is passed at each launch)."""
    from flash_cute.runtime.jit import tensor_arg

    return tensor_arg(torch.empty(2, dtype=torch.int32, device=device) if dropout else None, 4)


def check_seqused(problem, seqused_q, seqused_k) -> None:
    given = (seqused_q is not None, seqused_k is not None)
    if given != (problem.has_seqused_q, problem.has_seqused_k):
        raise ValueError(f"seqused_q/seqused_k given: {given}, but the problem was validated "
                         f"with {(problem.has_seqused_q, problem.has_seqused_k)}")
