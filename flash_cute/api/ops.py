"""The attention operators, registered with torch.library: ``torch.ops.flash_cute.fwd`` and
``torch.ops.flash_cute.bwd``.

They are what `flash_attn_func` and `flash_attn_varlen_func` call, so torch.compile, fake
tensors, `torch.library.opcheck` and CUDA graphs see one operator per pass:

* CUDA: the kernels, through the plan caches (`flash_cute.runtime.plans`).
* CPU: the float32 reference (`flash_cute.reference.attention`), slow but correct, so CPU users and
  CPU tests run the operators.
* Meta / fake tensors: shapes and dtypes only, after the same validation (no data pointer of
  a fake tensor is read), so tracing refuses what a launch would.
* Autograd: ``fwd``'s derivative is ``bwd`` (recomputation from the LSE).

One schema serves the padded and the packed (varlen) layouts: the packed one passes
cu_seqlens. ``bwd`` with ``mod_grads`` also returns the gradients of the score mod's
learnable captured tensors (`derivative.learnable`: a learnable bias, ALiBi slopes), in that
order (``dmods``; empty without). ``variant`` is the key of the call's score/mask modifications in a
registry (0: none), since Python objects cannot be schema arguments. ``dropout_p`` > 0 drops
attention weights with the keep decisions `flash_cute.reference.rng` derives from ``rng_seed``
(int64 [1], drawn by the caller: the operators are functions of their inputs, and the backward
redraws the forward's decisions from the same seed).
"""

import torch

from flash_cute.reference.attention import attention_ref, attention_ref_backward
from flash_cute.runtime import call, paging, plans
from flash_cute.variants import derivative, registry

# Options after the tensors, in the order both schemas take them.
_OPTIONS = ("SymInt? max_seqlen_q, SymInt? max_seqlen_k, float? softmax_scale, bool causal, "
            "int? window_left, int? window_right, float softcap, bool? pack_gqa, "
            "bool deterministic, str? arch")
_LENGTHS = "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k"

_LIB = torch.library.Library("flash_cute", "DEF")
_LIB.define(f"fwd(Tensor q, Tensor k, Tensor v, {_LENGTHS}, {_OPTIONS}, bool needs_grad, "
            f"int variant, float dropout_p=0.0, Tensor? rng_seed=None, int num_splits=1, "
            f"int? seqlen_k_per_split=None, Tensor? page_table=None, "
            f"bool partial_out=False) -> (Tensor out, Tensor lse)")
_LIB.define(f"bwd(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, "
            f"Tensor lse, {_LENGTHS}, {_OPTIONS}, int variant, float dropout_p=0.0, "
            f"Tensor? rng_seed=None, bool mod_grads=False, bool grads_fp32=False) -> "
            f"(Tensor dq, Tensor dk, Tensor dv, Tensor[] dmods)")

# Positions in the options after the tensors: (the 10 _OPTIONS, [needs_grad,] variant,
# dropout_p, rng_seed).
_FWD_VARIANT, _BWD_VARIANT = 11, 10


def _dropout_of(options: tuple, variant_index: int) -> tuple:
    """(dropout_p, rng_seed) of a call (`plans.split_seed`: trailing defaults may be left
    out)."""
    options, seed = plans.split_seed(options, variant_index + 2)
    return options[variant_index + 1], seed

_LIB.impl("fwd", plans.forward, "CUDA")
_LIB.impl("bwd", plans.backward, "CUDA")


def _variant(key: int):
    """The `registry.CallMods` of a registry key (None for 0)."""
    return registry.lookup(key) if key else None


def _page_table(options: tuple):
    """A forward call's page table (after seqlen_k_per_split), or None."""
    return options[16] if len(options) > 16 else None


def _partial_out(options: tuple) -> bool:
    """Whether a forward call asks for O in float32 (a partial, to be merged by its LSE)."""
    return len(options) > 17 and bool(options[17])


def _grads_fp32(options: tuple) -> bool:
    """Whether a backward call asks for float32 dQ, dK, dV (accumulators of a ring)."""
    return len(options) > 14 and bool(options[14])


def _reference_problem(q, k, v, lengths, options, dropout=(0.0, None), splits=(1, None),
                       page_table=None):
    """Validation of a CPU or fake call (contents of CPU index tensors included)."""
    if q.device.type == "cpu" and options[9] is not None:
        raise ValueError(f"arch={options[9]!r} picks a GPU pipeline, but the inputs are on "
                         "the CPU (which runs the reference); pass arch=None or CUDA tensors")
    return call.validate_call(q, k, v, lengths, options, require_cuda=False, dropout=dropout,
                              splits=splits, page_table=page_table)


def _reference_kwargs(problem, lengths, key: int, rng_seed) -> dict:
    cu_q, cu_k, used_q, used_k = lengths
    dropout = (problem.dropout_p, rng_seed) if problem.dropout_p > 0 else None
    return dict(softmax_scale=problem.softmax_scale, causal=problem.causal,
                window_size=(problem.window_left, problem.window_right),
                softcap=problem.softcap, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                seqused_q=used_q, seqused_k=used_k, variant=_variant(key), dropout=dropout)


def _fwd_cpu(q, k, v, cu_q, cu_k, used_q, used_k, *options):
    lengths = (cu_q, cu_k, used_q, used_k)
    dropout = _dropout_of(options, _FWD_VARIANT)
    # Splits change how the GPU kernels reduce, not the result: validated, then unused.
    page_table = _page_table(options)
    problem = _reference_problem(q, k, v, lengths, options, dropout, plans.fwd_splits(options),
                                 page_table)
    if page_table is not None:
        cu_k = paging.logical(k, v, page_table, cu_q is not None)[2]
        k, v = paging.gather(k, v, page_table)
        if cu_q is not None:
            k, v = k.flatten(0, 1), v.flatten(0, 1)
        lengths = (cu_q, cu_k, used_q, used_k)
    out, lse = attention_ref(q, k, v, mode="float32",
                             **_reference_kwargs(problem, lengths, options[_FWD_VARIANT],
                                                 dropout[1]))
    out = out.float() if _partial_out(options) else out.to(q.dtype)
    return out.contiguous(), lse.float().contiguous()


def _bwd_cpu(dout, dlse, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, *options):
    lengths = (cu_q, cu_k, used_q, used_k)
    dropout = _dropout_of(options, _BWD_VARIANT)
    problem = _reference_problem(q, k, v, lengths, options, dropout)
    kwargs = _reference_kwargs(problem, lengths, options[_BWD_VARIANT], dropout[1])
    learned = derivative.learnable(kwargs["variant"]) if plans.mod_grads_asked(options) else ()
    grads = {id(t): torch.zeros(t.shape, dtype=torch.float32) for t in learned}
    # P and Δ from the forward's out and lse, as the kernels take them (a ring's local
    # backward sees only its keys, normalized over all of them).
    dq, dk, dv = attention_ref_backward(q, k, v, dout, dlse, aux_grads=grads, out=out,
                                        lse=lse, **kwargs)
    wide = _grads_fp32(options)
    return (*((g.float() if wide else g.to(t.dtype)).contiguous()
              for g, t in ((dq, q), (dk, k), (dv, v))),
            [grads[id(t)].to(t.dtype) for t in learned])


_LIB.impl("fwd", _fwd_cpu, "CPU")
_LIB.impl("bwd", _bwd_cpu, "CPU")


@torch.library.register_fake("flash_cute::fwd")
def _fwd_fake(q, k, v, cu_q, cu_k, used_q, used_k, *options):
    _variant(options[_FWD_VARIANT])
    problem = _reference_problem(q, k, v, (cu_q, cu_k, used_q, used_k), options,
                                 _dropout_of(options, _FWD_VARIANT), plans.fwd_splits(options),
                                 _page_table(options))
    out = q.new_empty((*q.shape[:-1], problem.hdim_v),
                      dtype=torch.float32 if _partial_out(options) else q.dtype)
    if cu_q is not None:
        lse = q.new_empty((problem.nheads, q.shape[0]), dtype=torch.float32)
    else:
        lse = q.new_empty((q.shape[0], problem.nheads, q.shape[1]), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_cute::bwd")
def _bwd_fake(dout, dlse, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, *options):
    _variant(options[_BWD_VARIANT])
    _reference_problem(q, k, v, (cu_q, cu_k, used_q, used_k), options,
                       _dropout_of(options, _BWD_VARIANT))
    learned = (derivative.learnable(_variant(options[_BWD_VARIANT]))
               if plans.mod_grads_asked(options) else ())
    # Contiguous, whatever the inputs' strides, as the kernels' gradients are.
    wide = {"dtype": torch.float32} if _grads_fp32(options) else {}
    return (q.new_empty(q.shape, **wide), k.new_empty(k.shape, **wide),
            v.new_empty(v.shape, **wide),
            [q.new_empty(t.shape, dtype=t.dtype) for t in learned])


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, *lengths = inputs[:7]
    dropout_p, rng_seed = _dropout_of(inputs[7:], _FWD_VARIANT)
    ctx.save_for_backward(q, k, v, output[0], output[1], *lengths, rng_seed)
    ctx.paged = _page_table(inputs[7:]) is not None
    # Without needs_grad and the seed (saved above).
    ctx.options = inputs[7:17] + (inputs[18], dropout_p)
    ctx.holders = registry.holders(inputs[18])   # the mods' registry entry, for the backward
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, dlse):
    q, k, v, out, lse, *lengths, rng_seed = ctx.saved_tensors
    if ctx.paged:
        raise NotImplementedError("no backward through flash_cute::fwd's page_table: "
                                  "flash_attn_func gathers the pages when gradients are needed")
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, _ = torch.ops.flash_cute.bwd(dout, dlse, q, k, v, out, lse, *lengths,
                                             *ctx.options, rng_seed)
    return (dq, dk, dv) + (None,) * 22


torch.library.register_autograd("flash_cute::fwd", _fwd_backward,
                                setup_context=_fwd_setup_context)
