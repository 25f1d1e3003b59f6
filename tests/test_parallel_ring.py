"""Context parallelism over gloo process groups (`flash_cute.parallel`): ring attention in
each layout, Ulysses and the hybrid on a 2 x 2 mesh, forward and backward, against the
test's own float64 attention over the whole sequence (dense, autograd), each rank checking
the rows, dK and dV it holds. One spawn per world size runs every case; the full matrix is
`slow`. Bad input raises on every rank and no rank hangs (`ranks.run` kills ranks that
outlive its timeout, and fails)."""

import itertools
import math

import pytest
import ranks
import torch

LAYOUTS = ("contiguous", "striped", "zigzag")


def rel_bias(score, b, h, q_idx, kv_idx):
    """A score mod that reads global positions and the head."""
    return score + 0.03 * (q_idx - kv_idx).abs() * (h + 1) / 4


def documents(b, h, q_idx, kv_idx):
    """A mask mod of documents of 12 tokens."""
    return (q_idx // 12) == (kv_idx // 12)


MODS = {"none": (None, None), "bias": (rel_bias, None), "documents": (None, documents)}


def model(q, k, v, causal=False, window=(-1, -1), softcap=0.0, score_mod=None, mask_mod=None,
          sink=None, cu_seqlens=None, dropout=None):
    """Attention over the whole sequence, float64, torch autograd: (out, lse). Packed
    documents (`cu_seqlens`; q [t, h, d]): each document on its own, the mods' b its index;
    out [t, h, d], lse [h, t]."""
    if cu_seqlens is not None:
        parts = [_model_one(q[None, s:e], k[None, s:e], v[None, s:e], causal, window, softcap,
                            score_mod, mask_mod, sink, doc, dropout)
                 for doc, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:]))]
        return (torch.cat([o[0] for o, _ in parts]), torch.cat([lse[0] for _, lse in parts],
                                                               dim=-1))
    return _model_one(q, k, v, causal, window, softcap, score_mod, mask_mod, sink, None, dropout)


def _model_one(q, k, v, causal, window, softcap, score_mod, mask_mod, sink, doc, dropout):
    b, n, h, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    batch = torch.arange(b)[:, None, None, None] if doc is None else torch.tensor(doc)
    grids = (batch, torch.arange(h)[None, :, None, None], i[None, None], j[None, None])
    if score_mod is not None:
        s = score_mod(s, *grids)
    keep = torch.ones(n, n, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    keep = keep[None, None]
    if mask_mod is not None:
        keep = keep & mask_mod(*grids)
    s = s.masked_fill(~keep, -math.inf)
    if sink is not None:
        s = torch.cat([s, sink.double()[None, :, None, None].expand(b, h, n, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])[..., :n]
    if dropout is not None:
        # The library's Philox stream (its spec) at (b · h + head, q, k) of the whole sequence.
        from flash_cute.reference.rng import keep_threshold, random16

        prob, seed = dropout
        bits = random16(torch.tensor([seed]), batch * h + grids[1], i[None, None], j[None, None])
        p = torch.where(bits < keep_threshold(prob), p / (1 - prob), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _inputs(case, seqlen, dtype=torch.float64):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    h, hk, d = case.get("heads", 4), case.get("heads_kv", 2), 8
    lead = () if case.get("docs") else (2,)      # packed documents: [t, h, d]
    q = torch.randn(*lead, seqlen, h, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(*lead, seqlen, hk, d, generator=g, dtype=torch.float64)
            for _ in range(2))
    dout = torch.randn(*lead, seqlen, h, d, generator=g, dtype=torch.float64)
    sink = torch.randn(h, generator=g, dtype=torch.float64) if case.get("sink") else None
    return [t.to(dtype) for t in (q, k, v, dout)], sink


def _cu(case, world):
    """Global offsets of the case's documents (lengths in units of 2w)."""
    lengths = [2 * world * n for n in case["docs"]]
    return torch.tensor([0] + lengths).cumsum(0).tolist()


def _positions(case, seqlen, rank, world):
    from flash_cute.parallel import hybrid_positions, positions
    from flash_cute.parallel.layouts import varlen_rows

    if case.get("docs"):
        return varlen_rows(_cu(case, world), case["layout"], world, rank)[0]
    if case["kind"] == "hybrid":
        return hybrid_positions(seqlen, case["layout"], world // 2, 2, rank // 2, rank % 2)
    return positions(seqlen, case.get("layout", "contiguous"), world, rank)


def _call(case, q, k, v, sink, local, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flash_cute import parallel

    score_mod, mask_mod = MODS[case.get("mods", "none")]
    kw = dict(layout=case.get("layout", "contiguous"), causal=case.get("causal", False),
              window_size=case.get("window", (-1, -1)), softcap=case.get("softcap", 0.0),
              learnable_sink=sink, score_mod=score_mod, mask_mod=mask_mod, return_lse=True,
              local=local, dropout_p=case.get("dropout", 0.0),
              dropout_seed=1234 + dist.get_rank())
    if case["kind"] == "ring":
        cu = torch.tensor(_cu(case, world)) if case.get("docs") else None
        return parallel.ring_attention(q, k, v, mode=case.get("mode", "ring"), cu_seqlens=cu,
                                       **kw)
    if case["kind"] == "ulysses":
        return parallel.ulysses_attention(q, k, v, **kw)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("ring", "ulysses"))
    assert dist.get_world_size() == world
    return parallel.hybrid_attention(q, k, v, mesh, **kw)


def _float64_cases(rank, world, cases):
    """Each case on this rank: out, LSE, dQ, dK, dV of its rows against the model's."""
    from flash_cute.parallel import Float64Local

    worst = {}
    for case in cases:
        packed = bool(case.get("docs"))
        seqlen = _cu(case, world)[-1] if packed else 24 if world == 2 else 48
        (q, k, v, dout), sink = _inputs(case, seqlen)
        score_mod, mask_mod = MODS[case.get("mods", "none")]
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        sink_ref = None if sink is None else sink.clone().requires_grad_(True)
        # Each rank passes its own dropout seed: the call uses rank 0's (1234).
        dropout = (case["dropout"], 1234) if case.get("dropout") else None
        out_ref, lse_ref = model(*leaves, case.get("causal", False), case.get("window", (-1, -1)),
                                 case.get("softcap", 0.0), score_mod, mask_mod, sink_ref,
                                 _cu(case, world) if packed else None, dropout)
        (out_ref * dout).sum().backward()
        pos = _positions(case, seqlen, rank, world)
        # The sequence dim: 0 packed ([t, h, d]), 1 padded; the LSE's: last.
        take = (lambda t: t[pos]) if packed else (lambda t: t[:, pos])
        mine = [take(t).clone().requires_grad_(True) for t in (q, k, v)]
        sink_mine = None if sink is None else sink.clone().requires_grad_(True)
        out, lse = _call(case, *mine, sink_mine, Float64Local(), world)
        (out * take(dout)).sum().backward()
        pairs = [("out", out, take(out_ref)), ("lse", lse, lse_ref[..., pos])]
        pairs += [(name, got.grad, take(want.grad))
                  for name, got, want in zip(("dq", "dk", "dv"), mine, leaves)]
        if sink is not None:
            # Every rank's sink gradient is its rows' share: their sum is the model's.
            import torch.distributed as dist
            total = sink_mine.grad.clone()
            dist.all_reduce(total)
            pairs.append(("dsink", total, sink_ref.grad))
        for name, got, want in pairs:
            finite = torch.isfinite(want)
            assert torch.equal(torch.isfinite(got), finite), (case, name)
            err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
            assert err < 1e-9, (case, name, err)
            worst[name] = max(worst.get(name, 0.0), err)
    return worst


def _cases(world, full: bool):
    cases = []
    for layout, causal in itertools.product(LAYOUTS, (False, True)):
        cases.append(dict(kind="ring", layout=layout, causal=causal))
    cases += [dict(kind="ring", layout="zigzag", causal=True, window=(5, 0)),
              dict(kind="ring", layout="striped", window=(7, 3), softcap=3.0),
              dict(kind="ring", layout="contiguous", causal=True, mods="bias", sink=True),
              dict(kind="ring", layout="striped", mods="documents", heads_kv=1),
              dict(kind="ulysses", causal=True, sink=True, heads=8, heads_kv=4),
              dict(kind="ulysses", layout="zigzag", window=(6, 2), mods="bias", heads=4,
                   heads_kv=4)]
    # Packed documents (lengths in units of 2w tokens), each sharded on its own, and the
    # all-gather mode.
    # Dropout at global coordinates: ring, packed, Ulysses (global heads).
    cases += [dict(kind="ring", layout="zigzag", causal=True, dropout=0.25),
              dict(kind="ring", layout="striped", docs=[2, 1], dropout=0.3, mods="bias"),
              dict(kind="ulysses", causal=True, dropout=0.2, heads=4, heads_kv=4)]
    cases += [dict(kind="ring", layout="zigzag", causal=True, docs=[1, 3, 2]),
              dict(kind="ring", layout="striped", window=(5, 1), mods="bias", docs=[2, 1],
                   sink=True),
              dict(kind="ring", layout="contiguous", causal=True, docs=[1, 2], mode="allgather"),
              dict(kind="ring", layout="striped", causal=True, mode="allgather", softcap=2.0)]
    if world == 4:
        cases += [dict(kind="hybrid", layout="zigzag", causal=True, dropout=0.2),
                  dict(kind="hybrid", layout="striped", mods="bias", softcap=2.0)]
    if full:
        for kind, layout, causal, window, softcap, mods in itertools.product(
                ("ring",), LAYOUTS, (False, True), ((-1, -1), (4, 1)), (0.0, 2.5),
                ("none", "bias", "documents")):
            cases.append(dict(kind=kind, layout=layout, causal=causal, window=window,
                              softcap=softcap, mods=mods, seed=len(cases)))
    return cases


def _all_cases(rank, world, full):
    worst = _float64_cases(rank, world, _cases(world, full))
    worst.update(_operator_cases(rank, world))
    if world == 2:
        worst["drop-in names"] = _drop_in(rank, world)   # one spawn for both
    worst["shard and unshard"] = _sharding(rank, world)
    return worst


def _operator_cases(rank, world):
    """The CPU operator inside the ring (bf16 inputs, float32 partials) against the
    single-process operator (`flash_attn_func`) by the FlashAttention rule."""
    import flash_cute
    from flash_cute.parallel import positions, ring_attention
    from flash_cute.reference.attention import tolerance_check
    from flash_cute.reference.rng import draw_seed

    results = {}
    for layout, causal, window, mods, drop in (("zigzag", True, (-1, -1), "none", 0.0),
                                               ("striped", False, (6, 2), "none", 0.0),
                                               ("contiguous", True, (9, 0), "none", 0.0),
                                               ("striped", True, (-1, -1), "bias", 0.0),
                                               ("zigzag", False, (-1, -1), "documents", 0.0),
                                               ("zigzag", True, (-1, -1), "none", 0.3),
                                               ("striped", False, (6, 2), "bias", 0.2)):
        seqlen = 8 * world
        score_mod, mask_mod = MODS[mods]
        kw = dict(causal=causal, window_size=window, score_mod=score_mod, mask_mod=mask_mod)
        (q, k, v, dout), _ = _inputs({"seed": 3}, seqlen, torch.bfloat16)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        # The single-process call draws its seed from torch's generator: the ring is
        # given that seed, so both drop the same weights.
        torch.manual_seed(11)
        seed = int(draw_seed("cpu").item())
        torch.manual_seed(11)
        single = flash_cute.flash_attn_func(*leaves, dropout_p=drop, **kw)
        single = single[0] if isinstance(single, tuple) else single
        (single.float() * dout.float()).sum().backward()
        exact = [t.double().requires_grad_(True) for t in (q, k, v)]
        out64, _ = model(*exact, causal, window, score_mod=score_mod, mask_mod=mask_mod,
                         dropout=(drop, seed) if drop else None)
        (out64 * dout.double()).sum().backward()
        pos = positions(seqlen, layout, world, rank)
        mine = [t[:, pos].clone().requires_grad_(True) for t in (q, k, v)]
        kw.update(dropout_p=drop, dropout_seed=seed)
        out = ring_attention(*mine, layout=layout, **kw)
        (out.float() * dout[:, pos].float()).sum().backward()
        with torch.no_grad():   # inference: the forward alone, nothing saved
            assert torch.equal(ring_attention(*mine, layout=layout, **kw), out.detach())
        checks = [("out", out, out64[:, pos], single[:, pos])]
        checks += [(n, got.grad, ref.grad[:, pos], nat.grad[:, pos])
                   for n, got, ref, nat in zip(("dq", "dk", "dv"), mine, exact, leaves)]
        for name, got, ref, native in checks:
            res = tolerance_check(got, ref, native)
            assert res.ok, (layout, causal, window, name, res)
            results[f"op {name}"] = max(results.get(f"op {name}", 0.0), res.err)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_ring_ulysses_and_hybrid_match_whole_sequence_attention(world):
    """The float64 cases, the CPU operator in the ring, and (w = 2) ring-flash-attention's
    names: one spawn per world size."""
    worst = ranks.run(world, _all_cases, False, timeout=120)
    assert all(w for w in worst), worst


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_the_full_ring_matrix_matches_whole_sequence_attention(world):
    ranks.run(world, _all_cases, True, timeout=600)


def _bad_call(rank, world, case):
    """One bad call; returns normally only if this rank did not raise."""
    from torch.distributed.device_mesh import init_device_mesh

    from flash_cute import parallel

    seqlen_local, heads_kv, dtype, layout = 4, 2, torch.float64, "contiguous"
    if case == "odd zigzag shard":
        seqlen_local, layout = 3, "zigzag"
    if case == "shapes differ" and rank == 1:
        seqlen_local = 6
    if case == "dtypes differ" and rank == world - 1:
        dtype = torch.float32
    if case == "layouts differ" and rank == 0:
        layout = "striped"
    if case == "one rank's tensors are malformed" and rank == 1:
        heads_kv = 3
    q = torch.randn(1, seqlen_local, 4, 8, dtype=dtype)
    k = v = torch.randn(1, seqlen_local, heads_kv, 8, dtype=dtype)
    local = parallel.Float64Local()
    if case == "ulysses degree above the K/V heads":
        return parallel.ulysses_attention(q, k[:, :, :1], v[:, :, :1], local=local)
    if case == "hybrid, one rank refuses":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        if rank == 3:
            q = q[:, :3]
        return parallel.hybrid_attention(q, k, v, mesh, local=local)
    return parallel.ring_attention(q, k, v, layout=layout, local=local)


BAD = {  # case: (world, what every rank's error says, what the refusing rank's says)
    "odd zigzag shard": (2, "multiple of 2 tokens", None),
    "ulysses degree above the K/V heads": (2, "Ulysses degree of 2", None),
    "shapes differ": (2, "disagree on ['seqlen_local']", None),
    "dtypes differ": (2, "disagree on ['dtype']", None),
    "layouts differ": (2, "disagree on ['layout']", None),
    "one rank's tensors are malformed": (2, "rank(s) [1]", "not a multiple of 3 K/V heads"),
    "hybrid, one rank refuses": (4, "rank(s) [", "share batch and seqlen_local"),
}


def _bad_calls(rank, world, cases):
    """Each bad call in turn on this rank: its error's first line, or None if it returned.
    After a refusal every rank has left the same collectives, so the next call can run."""
    found = {}
    for case in cases:
        try:
            _bad_call(rank, world, case)
            found[case] = None
        except ValueError as e:
            found[case] = str(e).splitlines()[0]
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input_raises_on_every_rank_without_a_hang(world):
    cases = [case for case, (w, _, _) in BAD.items() if w == world]
    results = ranks.run(world, _bad_calls, cases, timeout=60)
    for rank, found in enumerate(results):
        for case in cases:
            _, every, refusing = BAD[case]
            message = found[case]
            assert message is not None, (case, rank, "returned")
            assert every in message or (refusing is not None and refusing in message), \
                (case, rank, message)


def test_sixteen_bit_partials_fail_the_rule_as_the_ring_grows_and_float32_ones_do_not():
    """One process, no group: the ring simulated over w = 2 ... 32 (contiguous shards, V
    centred on 1, as activations are not on 0). The 16-bit ring's error grows with w and
    fails the FlashAttention rule at some w <= 32; the float32 ring passes at every w, that
    one included. docs/guide/parallel.md has the table (`bench/ring_precision.py`)."""
    from flash_cute.parallel.precision import simulate_ring
    from flash_cute.reference.attention import attention_ref, tolerance_check

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2304, 1, 64, generator=g) for _ in range(3))
    q, k, v = q.bfloat16(), k.bfloat16(), (v + 1.0).bfloat16()
    ref = attention_ref(q, k, v, mode="float64")[0]
    native = attention_ref(q, k, v, mode="native")[0]
    errors, first_fail = [], None
    for w in (2, 4, 8, 16, 32):
        r16, r32 = (tolerance_check(simulate_ring(q, k, v, w, dt).bfloat16(), ref, native)
                    for dt in (torch.bfloat16, torch.float32))
        assert r32.ok, (w, r32)
        errors.append((r16.err, r32.err))
        if not r16.ok and first_fail is None:
            first_fail = w
    assert first_fail is not None, errors
    assert all(a[0] < b[0] for a, b in zip(errors, errors[1:])), errors     # grows with w
    assert max(e[1] for e in errors) < errors[0][0], errors   # float32 below bf16 at w = 2


def _sharding(rank, world):
    """`shard` gives this rank the rows `positions` / `varlen_rows` name, and `unshard`
    puts every rank's shard back in order, padded and packed, in each layout."""
    from flash_cute.parallel import shard, unshard
    from flash_cute.parallel.layouts import varlen_rows

    x = torch.arange(2 * 8 * world * 3, dtype=torch.float64).view(2, 8 * world, 3)
    cu = [0, 2 * world, 8 * world]
    for layout in LAYOUTS:
        mine = shard(x, layout)
        assert torch.equal(mine, x[:, _positions({"kind": "ring", "layout": layout},
                                                 8 * world, rank, world)])
        assert torch.equal(unshard(mine, layout), x)
        packed = x[0]
        mine = shard(packed, layout, dim=0, cu_seqlens=cu)
        assert torch.equal(mine, packed[varlen_rows(cu, layout, world, rank)[0]])
        assert torch.equal(unshard(mine, layout, dim=0, cu_seqlens=cu), packed)
    return True


def _drop_in(rank, world):
    """ring-flash-attention's names against `ring_attention` (the operators inside): the
    same output, the packed forms equal the unpacked one, the LSE returned as theirs."""
    from flash_cute.parallel import positions, ring_attention
    from flash_cute.parallel import ring_flash_attn as rfa
    from flash_cute.parallel.layouts import varlen_rows

    for name, layout in (("ring", "contiguous"), ("zigzag_ring", "zigzag"),
                         ("stripe", "striped")):
        (q, k, v, _), _ = _inputs({"seed": 5, "heads_kv": 4}, 8 * world, torch.bfloat16)
        pos = positions(8 * world, layout, world, rank)
        q, k, v = (t[:, pos] for t in (q, k, v))
        want = ring_attention(q, k, v, layout=layout, causal=True)
        func = getattr(rfa, f"{name}_flash_attn_func")
        assert torch.equal(func(q, k, v, causal=True), want)
        out, lse, none = func(q, k, v, causal=True, return_attn_probs=True)
        assert torch.equal(out, want) and lse.shape == (2, 4, 8) and none is None
        kv = torch.stack([k, v], dim=2)
        assert torch.equal(getattr(rfa, f"{name}_flash_attn_kvpacked_func")(q, kv, causal=True),
                           want)
        qkv = torch.stack([q, k, v], dim=2)
        assert torch.equal(getattr(rfa, f"{name}_flash_attn_qkvpacked_func")(qkv, causal=True),
                           want)
        # The varlen forms: cu_seqlens this rank's offsets (every document split evenly).
        cu = torch.tensor([0, 4 * world, 12 * world])
        (q, k, v, _), _ = _inputs({"seed": 6, "heads_kv": 4, "docs": [1]}, 12 * world,
                                  torch.bfloat16)
        rows = varlen_rows(cu, layout, world, rank)[0]
        q, k, v = (t[rows] for t in (q, k, v))
        want = ring_attention(q, k, v, layout=layout, causal=True, cu_seqlens=cu)
        local_cu = (cu // world).int()
        got = getattr(rfa, f"{name}_flash_attn_varlen_func")(q, k, v, local_cu, 8, causal=True)
        assert torch.equal(got, want)
        qkv = torch.stack([q, k, v], dim=1)
        assert torch.equal(getattr(rfa, f"{name}_flash_attn_varlen_qkvpacked_func")(
            qkv, local_cu, 8, causal=True), want)
    _llama3(rank, world)
    return True


def _llama3(rank, world):
    """`llama3_flash_attn_varlen_func`: the packed stream split contiguously, a document
    crossing the ranks' boundary; out, dQ, dK, dV of this rank's rows against the
    single-process FA2-form varlen call (the same CPU operator)."""
    from flash_cute import flash_attn_interface as fa2
    from flash_cute.parallel import ring_flash_attn as rfa

    total = 8 * world
    cu = torch.tensor([0, 5, total - 3, total], dtype=torch.int32)
    (q, k, v, dout), _ = _inputs({"seed": 7, "heads_kv": 2, "docs": [1]}, total,
                                 torch.bfloat16)
    for causal in (True, False):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        want = fa2.flash_attn_varlen_func(*leaves, cu, cu, 13, 13, causal=causal)
        (want.float() * dout.float()).sum().backward()
        rows = slice(rank * 8, (rank + 1) * 8)
        mine = [t[rows].clone().requires_grad_(True) for t in (q, k, v)]
        prepared = rfa.llama3_flash_attn_prepare_cu_seqlens(cu, causal, rank, world)
        out = rfa.llama3_flash_attn_varlen_func(*mine, *prepared[:4], 1, prepared[4],
                                                causal=causal)
        (out.float() * dout[rows].float()).sum().backward()
        for got, ref in [(out, want[rows])] + [(m.grad, leaf.grad[rows])
                                               for m, leaf in zip(mine, leaves)]:
            scale = ref.float().abs().max().item()
            assert (got.float() - ref.float()).abs().max().item() <= 2e-2 * scale, causal
