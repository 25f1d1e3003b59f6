"""SDPA with flash-cute activated, and a Llama-shaped transformers model under
attn_implementation="flash_cute", on the GPU (issue 22)."""

import pytest
import torch
import torch.nn.functional as F

from flash_cute import flash_attn_func

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16


def _close(a, b, rel=0.02):
    a, b = a.float(), b.float()
    return float((a - b).abs().max()) <= rel * float(b.abs().max()) + 1e-3


def test_sdpa_with_flash_cute_activated_runs_ours_and_matches():
    import torch.nn.attention as attention
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flash_cute.integrations import sdpa

    if not hasattr(attention, "register_flash_attention_impl"):
        pytest.skip(f"torch {torch.__version__} has no flash-attention registry")
    q = torch.randn(2, 8, 300, 128, device="cuda", dtype=BF16, requires_grad=True)
    k = torch.randn(2, 8, 300, 128, device="cuda", dtype=BF16, requires_grad=True)
    v = torch.randn(2, 8, 300, 128, device="cuda", dtype=BF16, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        want_grads = torch.autograd.grad(want.float().sum(), (q, k, v))
    calls, fwd = [], torch.ops.flash_cute.fwd
    sdpa.register()
    attention.activate_flash_attention_impl("flash_cute")
    try:
        torch.ops.flash_cute.fwd = lambda *a: calls.append(1) or fwd(*a)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grads = torch.autograd.grad(got.float().sum(), (q, k, v))
        assert _close(got, want)
        for g, w in zip(grads, want_grads):
            assert _close(g, w)
        # Dropout runs ours too: the mask flash_attn_func draws under the same seed, and the
        # backward redraws it from the seed SDPA hands back.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.manual_seed(5)
            dropped = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
            dgrads = torch.autograd.grad(dropped.float().sum(), (q, k, v))
        torch.manual_seed(5)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        direct = flash_attn_func(qt, kt, vt, causal=True, dropout_p=0.1)[0]
        assert torch.equal(dropped, direct.transpose(1, 2))
        for g, w in zip(dgrads, torch.autograd.grad(direct.float().sum(), (q, k, v))):
            assert _close(g, w)
        assert len(calls) == 2   # SDPA's flash backend ran flash-cute's kernels
        # A head dim with no kernel here: torch's previous flash kernel runs, with a warning.
        q40 = torch.randn(1, 2, 64, 40, device="cuda", dtype=BF16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.warns(UserWarning,
                                                                   match="previous flash"):
            F.scaled_dot_product_attention(q40, q40, q40)
    finally:
        torch.ops.flash_cute.fwd = fwd
        attention.restore_flash_attention_impl()


def _llama(impl: str, seed=0):
    transformers = pytest.importorskip("transformers")
    from flash_cute.integrations import transformers as fc_hf

    fc_hf.register()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=2, max_position_embeddings=1024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    return model.to("cuda", BF16)


@pytest.fixture(scope="module")
def models():
    ours = _llama("flash_cute")
    sdpa = _llama("sdpa")
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def test_llama_logits_loss_and_gradients_match_sdpa(models):
    ours, sdpa = models
    ids = torch.randint(0, 1000, (2, 257), device="cuda")
    results = []
    for model in (ours, sdpa):
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out.logits, out.loss,
                        [p.grad for p in model.parameters() if p.grad is not None]))
    (lo, lso, go), (ls, lss, gs) = results
    assert _close(lo, ls) and abs(float(lso) - float(lss)) <= 0.02 * abs(float(lss))
    assert len(go) == len(gs)
    for a, b in zip(go, gs):
        assert _close(a, b, rel=0.05)


def test_llama_padded_batch_matches_sdpa(models):
    ours, sdpa = models
    ids = torch.randint(0, 1000, (3, 100), device="cuda")
    mask = torch.ones(3, 100, dtype=torch.long, device="cuda")
    mask[0, :37] = 0
    mask[2, :5] = 0
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = sdpa(ids, attention_mask=mask).logits
    for b, first in enumerate((37, 0, 5)):
        assert _close(got[b, first:], want[b, first:])


def test_llama_32_decode_steps_with_the_kv_cache_match_sdpa(models):
    """Teacher-forced decoding: both models are fed the same 32 tokens one at a time with
    their KV caches; every step's logits agree."""
    import transformers

    ours, sdpa = models
    prompt = torch.randint(0, 1000, (2, 50), device="cuda")
    steps = torch.randint(0, 1000, (2, 32), device="cuda")
    caches = [transformers.DynamicCache(), transformers.DynamicCache()]
    with torch.no_grad():
        out = [m(prompt, past_key_values=c, use_cache=True) for m, c in zip(models, caches)]
        assert _close(out[0].logits, out[1].logits)
        for t in range(32):
            out = [m(steps[:, t:t + 1], past_key_values=c, use_cache=True)
                   for m, c in zip(models, caches)]
            assert _close(out[0].logits, out[1].logits), f"step {t}"
        generated = ours.generate(prompt, max_new_tokens=32, do_sample=False)
    assert generated.shape == (2, 82)


def test_llama_training_step_compiles_fullgraph_without_breaks(models):
    ours, _ = models
    ids = torch.randint(0, 1000, (2, 128), device="cuda")

    def step(input_ids):
        return ours(input_ids, labels=input_ids).loss

    explained = torch._dynamo.explain(step)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(ids)
    loss.backward()
    assert torch.isfinite(loss)
    torch._dynamo.reset()
