"""Host-side launch plumbing shared by every pipeline's `api.py`: support checks, the cases
that need no kernel, and the launches of a call configuration, worked out once and kept by
the plan cache (`flash_cute.api.interface`): `ForwardLaunch` (one kernel) and `BackwardLaunch`
(preprocess, main kernel, dQ), each building its kernel's argument record
(`flash_cute.contract.kernel_args`) once and then passing the fields straight to TVM-FFI."""

import functools
import math
from typing import Callable, NamedTuple, Optional

import torch
# Every launch calls a TVM-FFI function: importing it here, not at the first call, keeps its
# tens of milliseconds out of that call (a kernel loaded from the disk cache then starts in a
# few; docs/decisions.md, D-IMPORT).
import tvm_ffi  # noqa: F401

from flash_cute.runtime.kernel_ref import KernelRef  # noqa: F401  (planners name kernels by it)
from flash_cute.contract.kernel_args import BwdArgs, FwdArgs, dropout_scalars, score_scalars
from flash_cute.runtime.splits import launch_tiles
from flash_cute.contract.variant import Variant, dtype_name, ex2_emulation_per16


def variant_of(problem, pack_gqa: int = 1, split_kv: bool = False,
                 page_size: int = 0, append: bool = False,
                 ex2_per16: int = 0) -> Variant:
    """From a validated `flash_cute.runtime.validation.AttentionProblem` (and the pipeline's
    decisions on packing its heads and splitting its keys)."""
    mods = None
    if getattr(problem, "mods", None) is not None:
        from flash_cute.variants.mod_graph import kernel_mods

        mods = kernel_mods(problem.mods, getattr(problem, "mod_grads", False))[0]
    return Variant(causal=problem.causal, window_left=problem.window_left is not None,
                   window_right=problem.window_right is not None and not problem.causal,
                   softcap=problem.softcap > 0, varlen=problem.varlen,
                   seqused_q=problem.has_seqused_q, seqused_k=problem.has_seqused_k,
                   pack_gqa=pack_gqa, dropout=problem.dropout_p > 0, split_kv=split_kv,
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


def _restride(t: torch.Tensor, prepare):
    """What a launch does to `t` each call, decided once from a first call's tensor: None
    (pass it as is), "detach" (it requires grad: DLPack refuses it) or the strides `prepare`
    gives it (e.g. `tma_ready`'s); a launch runs with grad disabled, so a view then needs no
    detach."""
    if prepare is not None:
        stride = prepare(t).stride()
        if stride != t.stride():
            return stride
    return "detach" if t.requires_grad else None


def _apply(t, how):
    if how is None or t is None:
        return t
    return t.detach() if how == "detach" else t.as_strided(t.shape, how)


class CapturedTensors:
    """The tensors a call's traced mods capture (`problem.mods`), as the records' aux fields:
    the same tensor objects every call (a learnable bias updated in place is read as it is
    then), made kernel-ready (`mod_graph.aux_for_kernel`) at each call."""

    def __init__(self, problem, device):
        from flash_cute.contract.kernel_args import AUX_FIELDS, SCALAR_FIELDS

        self.tensors, self.scalars, self.learned = (), (), ()
        if problem.mods is not None:
            from flash_cute.variants.mod_graph import kernel_mods, learnable

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
        from flash_cute.variants.mod_graph import aux_for_kernel

        return tuple(aux_for_kernel(t) for t in self.tensors) + tuple(grads) + self.empty

    def new_gradients(self) -> tuple:
        """Zeroed fp32 gradient buffers of the learnable tensors, one launch's."""
        return tuple(torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                     for t in self.learned)

    def fields(self) -> dict:
        from flash_cute.runtime.jit import TensorArg
        from flash_cute.contract.kernel_args import SCALAR_FIELDS, aux_fields

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
    multiple of it, empty (the padding tiles' rows are past every sequence)."""

    def __init__(self, problem, tile, backward: bool, q_tiles_per_cta: int = 1):
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
        self.tensors = (states.contiguous(), bwd if backward else fwd)

    def fields(self) -> dict:
        from flash_cute.runtime.jit import tensor_arg

        return {"block_states": tensor_arg(self.tensors[0], 4),
                "block_ranges": tensor_arg(self.tensors[1], 4)}


class ForwardLaunch:
    """One attention forward's launch for a call configuration (dtypes, shapes, strides,
    alignment, options), worked out once: the outputs' shapes and fill, the no-work case,
    each input's restriding (`prepare`, e.g. TMA-ready strides), the kernel's scalars and its
    `KernelCall`. Called with tensors of that configuration, it allocates and launches.

    `make_kernel(dtype, hdim, hdim_v, variant, schedule=...)` builds the arch's kernel (a
    class, or a `KernelRef`), whose `__call__` takes a `kernel_args.FwdArgs`. `seqused_q` /
    `seqused_k`: int32 [batch] or None, as `problem` was validated. `pack_gqa`: query heads
    per tile (`packed_heads`), for a kernel class that packs them. `splits`: a
    `flash_cute.runtime.splits.Splits` (split-KV: the kernel writes fp32 partials per split, which
    `lse_merge`'s kernel then merges into O and LSE, or with `merge_in_kernel` the kernel
    itself, with the per-stream `SplitScratch`) or None. `page_table`: k / v are paged caches
    read through it (an int32 [batch, max_pages] tensor of a first call; each call passes its
    own), for a kernel class that pages. `append`: (k_new, v_new) of a first call, contiguous
    [batch, s_new, heads_kv, d]: the kernel writes them into k / v first (`kv_append`), for a
    kernel class that appends. `ex2_per16`: the pipeline's software-exp2 share (None: the
    FLASH_CUTE_EX2_EMULATION switch, off when unset)."""

    def __init__(self, name: str, make_kernel, q, k, v, problem, cu_seqlens_q, cu_seqlens_k,
                 seqused_q, seqused_k, schedule: tuple, options: str, target: str,
                 prepare=None, pack_gqa: int = 1, splits=None, page_table=None, append=None,
                 ex2_per16=None, tile=None, q_tiles_per_cta: int = 1,
                 merge_in_kernel: bool = False):
        from flash_cute.runtime.jit import DTYPES, CompileKey, KernelCall, TensorArg, tensor_arg

        _check_seqused(problem, seqused_q, seqused_k)
        self.out_shape = (*q.shape[:-1], problem.hdim_v)
        self.lse_shape = ((problem.nheads, q.shape[0]) if problem.varlen
                          else (problem.batch, problem.nheads, q.shape[1]))
        self.dtype, self.device = q.dtype, q.device
        # Varlen O is zeroed: rows after the last sequence belong to none and are never
        # written. Rows past seqused_q[b] are not written either: O = 0, LSE = -inf there,
        # what a row that sees no key gets.
        self.zero_out = problem.varlen or problem.has_seqused_q
        # Varlen: also the rows of a sequence past max_seqlen_q, which no tile covers.
        self.lse_neg_inf = problem.varlen or problem.has_seqused_q
        self.no_work = has_no_work(q, k, problem)
        self.call = self.merge = self.scratch = None
        self.splits = splits
        if self.no_work and append is not None:
            raise ValueError("an append needs a launch that runs (a query row and a key)")
        if self.no_work:
            return
        self.restride = tuple(_restride(t, prepare) for t in (q, k, v))
        if self.restride == (None, None, None):
            self.restride = None
        scalars = {**score_scalars(problem), "max_seqlen_q": int(problem.max_seqlen_q)}
        self.scalars = tuple(scalars.values())
        drop = dropout_scalars(problem)
        self.dropout = problem.dropout_p > 0
        self.dropout_scalars = tuple(drop.values())
        self.aux = CapturedTensors(problem, q.device)
        # A block mask's tiles: the kernel's (tile_m, tile_n), the schedule's first two
        # fields unless `tile` says otherwise, in queries (a packed tile's rows hold
        # pack_gqa heads of tile_m / pack_gqa queries, a mask the heads share).
        tile_m, tile_n = tile or schedule[:2]
        self.sparse = SparseTiles(problem, (tile_m // pack_gqa, tile_n), backward=False,
                                  q_tiles_per_cta=q_tiles_per_cta)
        variant = variant_of(problem, pack_gqa, split_kv=splits is not None,
                                       page_size=0 if page_table is None else k.shape[1],
                                       append=append is not None,
                                       ex2_per16=ex2_emulation_per16() if ex2_per16 is None
                                       else ex2_per16)
        dtype = dtype_name(q.dtype)
        key = CompileKey(name, target, dtype, problem.hdim, problem.hdim_v, tuple(schedule),
                         variant.flags())
        out, lse = self._alloc()
        varlen = problem.varlen
        self.split_scalars = (1, 0) if splits is None else tuple(splits)
        kernel_out, kernel_lse = (out, lse) if splits is None else self._new_parts()
        merged = {}
        if splits is not None and merge_in_kernel:
            # One count per tile (`HopperFwd`'s `merge_slot`).
            self.scratch = SplitScratch(launch_tiles(problem, tile_m, pack_gqa),
                                        self._new_parts, q.device)
            merged = dict(merged_out=TensorArg(out), merged_lse=TensorArg(lse, 4),
                          split_counts=TensorArg(torch.empty(1, dtype=torch.int32,
                                                             device=q.device), 4))
        elif splits is not None:
            from flash_cute.runtime.lse_merge import merge_call

            self.merge = merge_call(q.dtype, problem.hdim_v, "varlen" if varlen else "padded",
                                    (TensorArg(kernel_out), TensorArg(kernel_lse, 4),
                                     TensorArg(out), TensorArg(lse, 4)))
        args = FwdArgs(q=TensorArg(q), k=TensorArg(k), v=TensorArg(v),
                       out=TensorArg(kernel_out), lse=TensorArg(kernel_lse, 4), **scalars,
                       cu_seqlens_q=tensor_arg(cu_seqlens_q, 4) if varlen else None,
                       cu_seqlens_k=tensor_arg(cu_seqlens_k, 4) if varlen else None,
                       seqused_q=tensor_arg(seqused_q, 4), seqused_k=tensor_arg(seqused_k, 4),
                       rng_seed=_seed_spec(q.device, self.dropout), **drop,
                       num_splits=self.split_scalars[0],
                       blocks_per_split=self.split_scalars[1],
                       page_table=tensor_arg(page_table, 4),
                       k_new=None if append is None else TensorArg(append[0]),
                       v_new=None if append is None else TensorArg(append[1]),
                       **self.aux.fields(), **self.sparse.fields(), **merged)
        self.call = KernelCall(key, lambda: make_kernel(DTYPES[dtype], problem.hdim,
                                                        problem.hdim_v, variant,
                                                        schedule=tuple(schedule)),
                               args, options)

    def _alloc(self):
        if self.merge is not None:
            # The merge writes every row of both.
            return (torch.empty(self.out_shape, dtype=self.dtype, device=self.device),
                    torch.empty(self.lse_shape, dtype=torch.float32, device=self.device))
        if self.zero_out:
            out = torch.zeros(self.out_shape, dtype=self.dtype, device=self.device)
        else:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if self.lse_neg_inf:
            lse = torch.full(self.lse_shape, -math.inf, dtype=torch.float32, device=self.device)
        else:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        return out, lse

    def _alloc_parts(self):
        """A call's split-KV buffers: (O's partials, LSE's, the kernel's split counts or None
        for the merge kernel), the stream's scratch where the kernel merges."""
        if self.scratch is not None:
            return self.scratch.get()
        return (*self._new_parts(), None)

    def _new_parts(self):
        """Split-KV partials: O fp32 [splits, *O], LSE [splits, *LSE]. For the merge kernel,
        rows no tile writes (varlen, seqused_q) keep LSE -inf, so it never reads their O; the
        kernel that merges itself reads only rows that every split wrote."""
        count = self.splits.count
        o_parts = torch.empty((count, *self.out_shape), dtype=torch.float32, device=self.device)
        neg_inf = self.lse_neg_inf and self.scratch is None
        fill = torch.full if neg_inf else torch.empty
        args = (-math.inf,) if neg_inf else ()
        return o_parts, fill((count, *self.lse_shape), *args, dtype=torch.float32,
                             device=self.device)

    def __call__(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, rng_seed=None, page_table=None, append=(None, None)):
        out, lse = self._alloc()
        if self.no_work:
            lse.fill_(-math.inf)
            return out.zero_(), lse
        if self.restride is not None:
            rq, rk, rv = self.restride
            q, k, v = _apply(q, rq), _apply(k, rk), _apply(v, rv)
        o_parts, lse_parts, merged = out, lse, (None, None, None)
        if self.splits is not None:
            o_parts, lse_parts, counts = self._alloc_parts()
            if counts is not None:
                merged = (out, lse, counts)
        self.call(q, k, v, o_parts, lse_parts, *self.scalars, cu_seqlens_q, cu_seqlens_k,
                  seqused_q, seqused_k, _seed_words(rng_seed, self.dropout),
                  *self.dropout_scalars, *self.split_scalars, page_table, *append,
                  *self.aux.values(), *self.sparse.tensors, *self.aux.scalar_values, *merged)
        if self.merge is not None:
            self.merge(o_parts, lse_parts, out, lse)
        return out, lse


# Split partials up to this size are kept by their plan, per stream (a decode step's are at
# most about 1 MB: 16 splits x 4 query tokens x 32 heads x d 128 in fp32), instead of
# allocated at each call; larger ones (an explicit num_splits on a long prompt) are allocated
# per call, so that no plan cache entry holds a large buffer. A plan keeps the scratch of its
# last `KEEP_STREAMS` streams.
KEEP_PARTIALS_BYTES = 4 << 20
KEEP_STREAMS = 4


class SplitScratch:
    """What a forward that merges its own splits needs besides its outputs, kept per CUDA
    stream (launches of one plan on two streams at once must not share it): the int32 count
    of each tile's finished splits (`lse_merge.SplitArrivals`; zeroed once, and every launch
    leaves them at zero) and, up to `KEEP_PARTIALS_BYTES`, the fp32 partials (written and read
    within one launch, so the launches of one stream can share them). `new_parts()` makes the
    partials. A launch that faults leaves its counts as they were, but a CUDA fault ends the
    process's use of the device anyway."""

    def __init__(self, tiles: int, new_parts, device):
        self.tiles, self.new_parts, self.device = tiles, new_parts, device
        self.by_stream = {}

    def get(self) -> tuple:
        """(O's partials, LSE's, the counts) for the current stream. A CUDA graph being
        captured gets its own (their zeroing captured too), so that its replays, on whatever
        stream, share nothing with eager calls."""
        if torch.cuda.is_current_stream_capturing():
            return (*self.new_parts(), self._new_counts())
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)
        kept = self.by_stream.get(stream)
        if kept is None:
            o_parts, lse_parts = self.new_parts()
            counts = self._new_counts()
            if len(self.by_stream) >= KEEP_STREAMS:
                # The oldest stream's scratch goes back to torch's allocator, which reuses
                # it for that stream's allocations only: stream order keeps queued work safe.
                del self.by_stream[next(iter(self.by_stream))]
            small = (o_parts.numel() + lse_parts.numel()) * 4 <= KEEP_PARTIALS_BYTES
            self.by_stream[stream] = (o_parts, lse_parts, counts) if small \
                else (None, None, counts)
            return o_parts, lse_parts, counts
        if kept[0] is None:
            return (*self.new_parts(), kept[2])
        return kept

    def _new_counts(self) -> torch.Tensor:
        return torch.zeros(max(self.tiles, 1), dtype=torch.int32, device=self.device)


class GatheredPages:
    """A paged call for a kernel that reads no pages (`flash_cute.runtime.paging`): each call gathers
    the pages into dense K/V (packed, with a uniform cu_seqlens_k, when q is) and runs the
    dense launch."""

    def __init__(self, plan_forward, q, k, v, problem, lengths, page_table):
        cu_q, _, used_q, used_k = lengths
        self.packed = cu_q is not None
        self.cu_k = None
        if self.packed:
            rows = page_table.shape[1] * k.shape[1]
            batch = page_table.shape[0]
            self.cu_k = torch.arange(0, (batch + 1) * rows, rows, dtype=torch.int32,
                                     device=q.device)
        kg, vg = self._gather(k, v, page_table)
        self.launch = plan_forward(q, kg, vg, problem, cu_q, self.cu_k, used_q, used_k)

    def _gather(self, k, v, page_table):
        from flash_cute.runtime.paging import gather

        kg, vg = gather(k, v, page_table)
        return (kg.flatten(0, 1), vg.flatten(0, 1)) if self.packed else (kg, vg)

    def __call__(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, rng_seed=None, page_table=None):
        kg, vg = self._gather(k, v, page_table)
        return self.launch(q, kg, vg, cu_seqlens_q, self.cu_k, seqused_q, seqused_k,
                           rng_seed=rng_seed)


class AppendFirst:
    """An append (`ForwardLaunch`'s `append`) for a launch whose kernel writes none: torch
    operations write k_new / v_new into the cache at rows seqused_k[b] - s_new .. of each
    sequence (`paging.write_rows`, indices clamped into the cache), then the launch runs."""

    def __init__(self, launch):
        self.launch = launch

    def __call__(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, rng_seed=None, page_table=None, append=(None, None)):
        from flash_cute.runtime import paging

        k_new, v_new = append
        rows = paging.cache_rows(k, page_table, k_new.shape[0])
        positions = (seqused_k[:, None].long() - k_new.shape[1]
                     + torch.arange(k_new.shape[1], device=k.device))
        paging.write_rows(k, v, k_new, v_new, rows, positions)
        paged = {} if page_table is None else {"page_table": page_table}
        return self.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                           rng_seed=rng_seed, **paged)


# `ForwardLaunch.__call__` passes the record's fields in this order.
assert FwdArgs._fields == ("q", "k", "v", "out", "lse", "softmax_scale", "softcap",
                           "window_left", "window_right", "max_seqlen_q", "cu_seqlens_q",
                           "cu_seqlens_k", "seqused_q", "seqused_k", "rng_seed",
                           "keep_threshold", "dropout_scale", "num_splits", "blocks_per_split",
                           "page_table", "k_new", "v_new", "aux0", "aux1", "aux2", "aux3",
                           "block_states", "block_ranges", "scalar0", "scalar1", "scalar2",
                           "scalar3", "merged_out", "merged_lse", "split_counts")


def _seed_words(rng_seed, dropout: bool):
    """The kernels' view of a dropout seed (int64 [1], `rng.draw_seed`): int32 [2]."""
    if not dropout:
        return None
    if rng_seed is None:
        raise ValueError("dropout_p > 0 needs the call's rng_seed (rng.draw_seed)")
    return rng_seed.view(torch.int32)


def _seed_spec(device, dropout: bool):
    """What a kernel is compiled against for the seed (its dtype and rank; the call's own
    seed is passed at each launch)."""
    from flash_cute.runtime.jit import tensor_arg

    return tensor_arg(torch.empty(2, dtype=torch.int32, device=device) if dropout else None, 4)


class RowDqAccum(NamedTuple):
    """dQaccum laid out like q (fp32), added to by the main kernel (atomics) and turned into
    dQ by `bwd_prep.Postprocess`; the default `BackwardPlan.dq_accum`. `align`: what the
    kernel may assume of its address (a fresh allocation is 256-byte aligned; 4 promises only
    fp32)."""

    align: int = 4

    @staticmethod
    def shape(q, problem) -> tuple:
        return tuple(q.shape)

    @staticmethod
    def finisher(dq_accum, q, problem, cu_seqlens_q, target: str):
        """`finish(dq_accum, cu_seqlens_q) -> dq` for this configuration."""
        from flash_cute.runtime.bwd_prep import Postprocess

        post = Postprocess(dq_accum, q.dtype, target)
        scale = float(problem.softmax_scale)
        return lambda acc, cu: post(acc, scale)


class BackwardPlan(NamedTuple):
    """What an arch's backward main kernel needs of `BackwardLaunch`: its compile-key name,
    kernel (`kernel_cls(dtype, hdim, hdim_v, variant, schedule=..., deterministic=...)`, a
    class or `KernelRef`, whose `__call__` takes a `kernel_args.BwdArgs`), schedule, compile
    options and target; `prepare` adapts q/k/v/dout first (e.g. TMA-ready strides);
    `dq_accum`: how dQaccum is laid out (`shape(q, problem)`, fp32, uninitialized: the
    preprocess zeroes it) and turned into dQ (`finisher(dq_accum, q, problem, cu_seqlens_q,
    target)`, a `finish(dq_accum, cu_seqlens_q) -> dq`), with the byte alignment the kernel may
    assume of it (`align`); `row_stats_align`: the same for Δ and LSE·log2 e, whose rows (one
    per head) are then padded so every row starts that aligned (a TMA needs 16-byte
    strides)."""
    name: str
    kernel_cls: object
    schedule: tuple
    options: str
    target: str
    prepare: Optional[Callable] = None
    dq_accum: object = RowDqAccum()
    row_stats_align: int = 4


class BackwardLaunch:
    """One attention backward's launches for a call configuration, worked out once (as
    `ForwardLaunch`): preprocess (Δ, LSE·log2 e; it also zeroes the uninitialized dQaccum),
    the main kernel of `plan`, then dQ from dQaccum (`plan.dq_accum`). Called with tensors of
    that configuration, it returns (dq, dk, dv).

    With GQA the kernel writes fp32 dK/dV per query head and the group is summed here, in a
    fixed order. Varlen dK/dV start at zero: rows after the last sequence get no gradient; so
    do they with seqused_k (keys past seqused_k[b]). dQ rows past seqused_q[b] get nothing
    added and stay 0 from dQaccum's zeros. `deterministic`: the kernel adds dQ in a fixed
    order, through zeroed per-query-tile semaphores (`dq_semaphores`).
    """

    def __init__(self, plan: BackwardPlan, dout, dlse, q, k, v, out, lse, problem,
                 cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None,
                 deterministic: bool = False):
        from flash_cute.runtime.bwd_prep import Preprocess
        from flash_cute.runtime.jit import KernelCall, TensorArg, tensor_arg

        _check_seqused(problem, seqused_q, seqused_k)
        self.no_work = has_no_work(q, k, problem)
        self.aux = CapturedTensors(problem, q.device)
        if self.no_work:
            return
        deterministic = bool(deterministic)
        setup = _backward_setup(plan, problem, q.dtype, deterministic)
        self.device, self.setup = q.device, setup
        self.scratch = _Scratch(plan.dq_accum.shape(q, problem), lse, plan.row_stats_align)
        dq_accum, delta, lse_log2 = self.scratch.alloc()
        self.max_seqlen_q = int(problem.max_seqlen_q)
        self.pre = Preprocess(out, dout, lse, dlse, cu_seqlens_q, seqused_q, dq_accum,
                              plan.target)
        self.restride = tuple(_restride(t, plan.prepare) for t in (q, k, v, dout))
        kv_lead = tuple(k.shape[:-2])
        self.dk_shape = (*kv_lead, problem.nheads, problem.hdim)
        self.dv_shape = (*kv_lead, problem.nheads, problem.hdim_v)
        group = problem.qheads_per_kvhead
        self.group_shapes = None if group == 1 else (
            (*kv_lead, problem.nheads_kv, group, problem.hdim),
            (*kv_lead, problem.nheads_kv, group, problem.hdim_v))
        self.sem_shape = (problem.batch, problem.nheads,
                          -(-problem.max_seqlen_q // plan.schedule[0])) if deterministic else None
        dk, dv = self._alloc_dkv()
        sem = self._alloc_sem()
        varlen, align = problem.varlen, plan.row_stats_align
        drop = dropout_scalars(problem)
        self.dropout, self.dropout_scalars = problem.dropout_p > 0, tuple(drop.values())
        self.sparse = SparseTiles(problem, plan.schedule[:2], backward=True)
        args = BwdArgs(q=TensorArg(q), k=TensorArg(k), v=TensorArg(v), dout=TensorArg(dout),
                       lse_log2=TensorArg(lse_log2, align), delta=TensorArg(delta, align),
                       dq_accum=TensorArg(dq_accum, plan.dq_accum.align),
                       dk=TensorArg(dk, setup.dkv_align), dv=TensorArg(dv, setup.dkv_align),
                       **setup.scalars,
                       cu_seqlens_q=tensor_arg(cu_seqlens_q, 4) if varlen else None,
                       cu_seqlens_k=tensor_arg(cu_seqlens_k, 4) if varlen else None,
                       seqused_q=tensor_arg(seqused_q, 4), seqused_k=tensor_arg(seqused_k, 4),
                       dq_semaphores=tensor_arg(sem, 4),
                       rng_seed=_seed_spec(q.device, self.dropout), **drop,
                       **self.aux.fields(), **self.sparse.fields())
        self.scalars = tuple(setup.scalars.values())
        self.main = KernelCall(setup.key, setup.make_kernel, args, plan.options)
        self.finish = plan.dq_accum.finisher(dq_accum, q, problem, cu_seqlens_q, plan.target)

    def _alloc_dkv(self):
        s = self.setup
        return (s.alloc(self.dk_shape, dtype=s.dkv_dtype, device=self.device),
                s.alloc(self.dv_shape, dtype=s.dkv_dtype, device=self.device))

    def _alloc_sem(self):
        if self.sem_shape is None:
            return None
        return torch.zeros(self.sem_shape, dtype=torch.int32, device=self.device)

    def __call__(self, dout, dlse, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_q=None, seqused_k=None, rng_seed=None, mod_grads=None):
        """(dq, dk, dv); `mod_grads`, a list, receives the learnable captured tensors'
        gradients (`CapturedTensors.learned`)."""
        grads = self.aux.new_gradients()
        if self.no_work:
            if mod_grads is not None:
                mod_grads += self.aux.gradients(grads)
            # Contiguous, as the kernels' gradients are (the fake implementation says so).
            return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
        dq_accum, delta, lse_log2 = self.scratch.alloc()
        self.pre(out, dout, lse, dlse, delta, lse_log2, cu_seqlens_q, seqused_q,
                 self.max_seqlen_q, dq_accum)
        rq, rk, rv, rdo = self.restride
        dk, dv = self._alloc_dkv()
        self.main(_apply(q, rq), _apply(k, rk), _apply(v, rv), _apply(dout, rdo), lse_log2, delta,
                  dq_accum, dk, dv, *self.scalars, cu_seqlens_q, cu_seqlens_k, seqused_q,
                  seqused_k, self._alloc_sem(), _seed_words(rng_seed, self.dropout),
                  *self.dropout_scalars, *self.aux.values(grads), *self.sparse.tensors,
                  *self.aux.scalar_values)
        if mod_grads is not None:
            mod_grads += self.aux.gradients(grads)
        dq = self.finish(dq_accum, cu_seqlens_q)
        if self.group_shapes is not None:
            dk = dk.view(self.group_shapes[0]).sum(-2).to(q.dtype)
            dv = dv.view(self.group_shapes[1]).sum(-2).to(q.dtype)
        return dq, dk, dv


# `BackwardLaunch.__call__` passes the record's fields in this order.
assert BwdArgs._fields == ("q", "k", "v", "dout", "lse_log2", "delta", "dq_accum", "dk", "dv",
                           "softmax_scale", "softcap", "window_left", "window_right",
                           "max_seqlen_k", "max_seqlen_q", "cu_seqlens_q", "cu_seqlens_k",
                           "seqused_q", "seqused_k", "dq_semaphores", "rng_seed",
                           "keep_threshold", "dropout_scale", "aux0", "aux1", "aux2", "aux3",
                           "block_states", "block_ranges", "scalar0", "scalar1", "scalar2",
                           "scalar3")


def _contiguous_strides(shape) -> tuple:
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return tuple(strides)


class _Scratch:
    """The backward's fp32 scratch from one allocation (each is a few microseconds of host
    time): dQaccum (`accum_shape`, contiguous, first: 256-byte aligned), then Δ and
    LSE·log2 e, shaped like the LSE ([b, h, sq] or [h, total_q]), whose rows start
    `align`-byte aligned (the last dim is padded in memory, not in shape)."""

    def __init__(self, accum_shape: tuple, lse: torch.Tensor, align: int):
        n = lse.shape[-1]
        padded = -(-max(n, 1) // (align // 4)) * (align // 4)
        self.accum_shape = tuple(accum_shape)
        self.accum_strides = _contiguous_strides(self.accum_shape)
        accum = -(-math.prod(self.accum_shape) // 64) * 64
        stats_shape = (*lse.shape[:-1], padded)
        self.stats_shape = tuple(lse.shape)
        self.stats_strides = _contiguous_strides(stats_shape)
        stats = -(-math.prod(stats_shape) // 64) * 64
        self.offsets = (accum, accum + stats)
        self.numel = accum + 2 * stats
        self.device = lse.device

    def alloc(self) -> tuple:
        """(dq_accum, delta, lse_log2), uninitialized."""
        buf = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return (buf.as_strided(self.accum_shape, self.accum_strides, 0),
                buf.as_strided(self.stats_shape, self.stats_strides, self.offsets[0]),
                buf.as_strided(self.stats_shape, self.stats_strides, self.offsets[1]))


class _BackwardSetup(NamedTuple):
    key: object
    make_kernel: Callable
    scalars: dict
    dkv_dtype: torch.dtype
    dkv_align: int
    alloc: Callable


@functools.lru_cache(maxsize=256)
def _backward_setup(plan: BackwardPlan, problem, dtype, deterministic: bool):
    """What `BackwardLaunch` works out from its configuration alone: the main kernel's compile
    key and factory, its scalar fields (softmax scale, softcap, window, max_seqlen_k), and
    dK/dV's dtype (fp32 per query head for GQA, summed afterwards), alignment and
    allocation (zeroed where rows may get no gradient: varlen, seqused_k)."""
    from flash_cute.runtime.jit import DTYPES

    group = problem.qheads_per_kvhead
    variant = variant_of(problem)
    dname = dtype_name(dtype)

    def make_kernel():
        return plan.kernel_cls(DTYPES[dname], problem.hdim, problem.hdim_v, variant,
                               schedule=plan.schedule, deterministic=deterministic)

    return _BackwardSetup(
        backward_compile_key(plan.name, plan.target, dname, problem, plan.schedule, deterministic),
        make_kernel, {**score_scalars(problem), "max_seqlen_k": int(problem.max_seqlen_k),
                      "max_seqlen_q": int(problem.max_seqlen_q)},
        torch.float32 if group > 1 else dtype, 16 if group == 1 else 4,
        torch.zeros if problem.varlen or problem.has_seqused_k else torch.empty)


def _check_seqused(problem, seqused_q, seqused_k) -> None:
    given = (seqused_q is not None, seqused_k is not None)
    if given != (problem.has_seqused_q, problem.has_seqused_k):
        raise ValueError(f"seqused_q/seqused_k given: {given}, but the problem was validated "
                         f"with {(problem.has_seqused_q, problem.has_seqused_k)}")


def backward_compile_key(name: str, target: str, dtype: str, problem, schedule: tuple,
                         deterministic: bool = False):
    """A backward main kernel's CompileKey: the variant, fp32 dK/dV for GQA, deterministic dQ."""
    from flash_cute.runtime.jit import CompileKey

    flags = variant_of(problem).flags() + (
        ("dkv_fp32", problem.qheads_per_kvhead > 1), ("deterministic", bool(deterministic)))
    return CompileKey(name, target, dtype, problem.hdim, problem.hdim_v, tuple(schedule), flags)


def dq_semaphores(problem, tile_m: int, device) -> torch.Tensor:
    """Zeroed int32 [batch, nheads, ceil(max_seqlen_q / tile_m)]: per (query tile, head,
    batch), how many K/V tiles have added their dQ partial (deterministic backward)."""
    return torch.zeros(problem.batch, problem.nheads, -(-problem.max_seqlen_q // tile_m),
                       dtype=torch.int32, device=device)
