"""A forward call's launch, worked out once per call configuration and kept by the plan
cache (`ForwardLaunch`): output shapes and fills, no-work cases, the argument record, the
kernels' `KernelCall`s; with what a decode forward adds: split scratch (`SplitScratch`), paged
K/V gathered first (`GatheredPages`) and the append written first (`AppendFirst`)."""

import dataclasses
import math

import torch

from flash_cute.contract.kernel_args import FwdArgs, dropout_scalars, score_scalars
from flash_cute.contract.variant import dtype_name, ex2_emulation_per16
from flash_cute.runtime import status
from flash_cute.runtime.launch import (
    CapturedTensors,
    SparseTiles,
    apply,
    check_seqused,
    has_no_work,
    restride,
    seed_spec,
    seed_words,
    variant_of,
)
from flash_cute.runtime.splits import launch_tiles


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
    kernel class that appends, and that adds the rows it drops to `status.counter`.
    `ex2_per16`: the pipeline's software-exp2 share (None: the
    FLASH_CUTE_EX2_EMULATION switch, off when unset). `out_dtype`: O's dtype where it is not
    q's (the FP8 forward); `descales`: the rank of the float32 q/k/v scales the kernel takes
    and each call passes (2: FA3's descales [batch, heads_kv]; 3: block scales [batch,
    blocks, heads]; 0: none)."""

    def __init__(self, name: str, make_kernel, q, k, v, problem, cu_seqlens_q, cu_seqlens_k,
                 seqused_q, seqused_k, schedule: tuple, options: str, target: str,
                 prepare=None, pack_gqa: int = 1, splits=None, page_table=None, append=None,
                 ex2_per16=None, tile=None, q_tiles_per_cta: int = 1,
                 merge_in_kernel: bool = False, timeline=None, out_dtype=None,
                 descales: int = 0):
        from flash_cute.runtime.jit import DTYPES, CompileKey, KernelCall, TensorArg, tensor_arg

        check_seqused(problem, seqused_q, seqused_k)
        self.out_shape = (*q.shape[:-1], problem.hdim_v)
        self.lse_shape = ((problem.nheads, q.shape[0]) if problem.varlen
                          else (problem.batch, problem.nheads, q.shape[1]))
        self.dtype, self.device = out_dtype or q.dtype, q.device
        # Varlen O is zeroed: rows after the last sequence belong to none and are never
        # written. Rows past seqused_q[b] are not written either: O = 0, LSE = -inf there,
        # what a row that sees no key gets.
        self.zero_out = problem.varlen or problem.has_seqused_q
        # Varlen: also the rows of a sequence past max_seqlen_q, which no tile covers.
        self.lse_neg_inf = problem.varlen or problem.has_seqused_q
        self.no_work = has_no_work(q, k, problem)
        self.call = self.merge = self.scratch = None
        self.splits = splits
        # partial_out: the one split's float32 O and LSE are the result (`splits.plan_splits`).
        self.partial = getattr(problem, "partial_out", False)
        if self.partial and (splits is None or splits.count != 1):
            raise NotImplementedError(f"{name}: partial_out (float32 O) needs the forward's "
                                      f"split-KV launch, which this pipeline does not make")
        # The appending kernel counts the rows it drops into the device's counter itself:
        # no torch operation per call (`flash_cute.runtime.status`).
        self.dropped = None if append is None else status.counter(q.device)
        # The measured timeline's record buffer (`contract.timeline`; `python -m flash_cute
        # profile`): a kernel compiled with `Variant.timeline` writes into it.
        self.timeline = timeline
        if self.no_work and append is not None:
            raise ValueError("an append needs a launch that runs (a query row and a key)")
        if self.no_work:
            return
        self.restride = tuple(restride(t, prepare) for t in (q, k, v))
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
        if timeline is not None:
            variant = dataclasses.replace(variant, timeline=True)
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
                       rng_seed=seed_spec(q.device, self.dropout), **drop,
                       num_splits=self.split_scalars[0],
                       blocks_per_split=self.split_scalars[1],
                       page_table=tensor_arg(page_table, 4),
                       k_new=None if append is None else TensorArg(append[0]),
                       v_new=None if append is None else TensorArg(append[1]),
                       append_dropped=None if self.dropped is None else
                       TensorArg(self.dropped, 8),
                       **self.aux.fields(), **self.sparse.fields(), **merged,
                       timeline=None if timeline is None else TensorArg(timeline, 8),
                       **({f"{x}_descale": TensorArg(torch.empty((1,) * descales,
                                                                 device=q.device), 4)
                           for x in "qkv"} if descales else {}))
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
                 seqused_k=None, rng_seed=None, page_table=None, append=(None, None),
                 descales=()):
        out, lse = self._alloc()
        if self.no_work:
            lse.fill_(-math.inf)
            return (out.float() if self.partial else out).zero_(), lse
        if self.restride is not None:
            rq, rk, rv = self.restride
            q, k, v = apply(q, rq), apply(k, rk), apply(v, rv)
        o_parts, lse_parts, merged = out, lse, (None, None, None)
        if self.splits is not None:
            o_parts, lse_parts, counts = self._alloc_parts()
            if self.partial:
                # Handed to the caller: fresh, and defined on rows no tile writes.
                o_parts, lse_parts = self._partial_parts()
            if counts is not None:
                merged = (out, lse, counts)
        self.call(q, k, v, o_parts, lse_parts, *self.scalars, cu_seqlens_q, cu_seqlens_k,
                  seqused_q, seqused_k, seed_words(rng_seed, self.dropout),
                  *self.dropout_scalars, *self.split_scalars, page_table, *append,
                  self.dropped if append[0] is not None else None,
                  *self.aux.values(), *self.sparse.tensors, *self.aux.scalar_values, *merged,
                  self.timeline, *(descales or (None, None, None)))
        if self.partial:
            return o_parts[0], lse_parts[0]
        if self.merge is not None:
            self.merge(o_parts, lse_parts, out, lse)
        return out, lse

    def _partial_parts(self):
        """partial_out's buffers: O zeroed and LSE -inf where no tile writes (varlen rows
        past every sequence, rows past seqused_q)."""
        if not self.zero_out:
            return self._new_parts()
        return (torch.zeros((1, *self.out_shape), dtype=torch.float32, device=self.device),
                torch.full((1, *self.lse_shape), -math.inf, dtype=torch.float32,
                           device=self.device))


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
    """A paged call for a kernel that reads no pages (`flash_cute.runtime.paging`): each call
    gathers the pages into dense K/V (packed, with a uniform cu_seqlens_k, when q is) and runs the
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
    sequence (`paging.write_rows`: rows outside the cache are dropped), then the launch runs."""

    def __init__(self, launch):
        self.launch = launch

    def __call__(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                 seqused_k=None, rng_seed=None, page_table=None, append=(None, None)):
        from flash_cute.runtime import paging

        k_new, v_new = append
        rows = paging.cache_rows(k, page_table, k_new.shape[0])
        start = seqused_k.long() - k_new.shape[1]
        capacity = rows.shape[1]
        fits = paging.append_fits(start, k_new.shape[1], capacity, page_table, *k.shape[:2])
        status.count_dropped(fits)
        paging.write_rows(k, v, k_new, v_new, rows, start, fits)
        paged = {} if page_table is None else {"page_table": page_table}
        return self.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                           rng_seed=rng_seed, **paged)
