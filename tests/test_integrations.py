"""The SDPA registry and Hugging Face transformers integrations (CPU: registration, and a
small Llama on the CPU operators against transformers' SDPA path)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")


def test_sdpa_impl_registers_and_activates():
    import torch.nn.attention as attention

    from flash_cute.integrations import sdpa

    if not hasattr(attention, "register_flash_attention_impl"):
        with pytest.raises(RuntimeError, match="no pluggable flash-attention registry"):
            sdpa.register()
        return
    sdpa.register()
    assert "flash_cute" in attention.list_flash_attention_impls()
    attention.activate_flash_attention_impl("flash_cute")
    try:
        assert attention.current_flash_attention_impl() == "flash_cute"
    finally:
        attention.restore_flash_attention_impl()


def _llama(attn: str, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def models():
    from flash_cute.integrations import transformers as fc_hf

    fc_hf.register()
    ours = _llama("flash_cute")
    assert ours.config._attn_implementation == "flash_cute"
    sdpa = _llama("sdpa")
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def _close(a, b, rel=0.02):
    a, b = a.float(), b.float()
    return float((a - b).abs().max()) <= rel * float(b.abs().max()) + 1e-3


def test_llama_logits_match_sdpa(models, monkeypatch):
    from flash_cute.integrations import transformers as fc_hf

    ours, sdpa = models
    calls, original = [], fc_hf.flash_attn_func
    monkeypatch.setattr(fc_hf, "flash_attn_func",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    ids = torch.randint(0, 97, (2, 37))
    assert _close(ours(ids).logits, sdpa(ids).logits)
    assert len(calls) == 2   # one per layer: the model ran flash-cute


def test_left_padded_batch_matches_sdpa_on_its_tokens(models):
    ours, sdpa = models
    ids = torch.randint(0, 97, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :9] = 0   # left padding, as generate pads
    got = ours(ids, attention_mask=mask).logits
    want = sdpa(ids, attention_mask=mask).logits
    assert _close(got[0, 9:], want[0, 9:]) and _close(got[1], want[1])


def test_generate_with_the_kv_cache_matches_sdpa_step_by_step(models):
    """Teacher-forced: both models decode the same tokens with their KV caches; each step's
    logits agree (random weights give flat logits, so greedy tokens are no comparison)."""
    ours, sdpa = models
    ids = torch.randint(0, 97, (1, 12))
    steps = torch.randint(0, 97, (1, 6))
    caches = [transformers.DynamicCache(), transformers.DynamicCache()]
    out = [m(ids, past_key_values=c, use_cache=True) for m, c in zip((ours, sdpa), caches)]
    assert _close(out[0].logits, out[1].logits)
    for t in range(steps.shape[1]):
        out = [m(steps[:, t:t + 1], past_key_values=c, use_cache=True)
               for m, c in zip((ours, sdpa), caches)]
        assert _close(out[0].logits, out[1].logits), f"step {t}"


def test_gemma2_sliding_window_and_softcap_match_eager():
    """Gemma-2 style (sliding-window layers, attention-logit softcap) against transformers'
    eager attention; dropping the window changes the logits far more than the tolerance.
    Each model gets its own config: from_config sets the implementation on the config."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from flash_cute.integrations import transformers as fc_hf

    fc_hf.register()

    def build(impl, window=16):
        config = Gemma2Config(vocab_size=97, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=32, sliding_window=window, attn_logit_softcapping=30.0,
                              initializer_range=0.3)
        return AutoModelForCausalLM.from_config(config, attn_implementation=impl).to(
            torch.bfloat16).eval()

    torch.manual_seed(0)
    ours = build("flash_cute")
    eager, unwindowed = build("eager"), build("eager", window=4096)
    eager.load_state_dict(ours.state_dict())
    unwindowed.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 97, (2, 50))
    mask = torch.ones(2, 50, dtype=torch.long)
    mask[0, :11] = 0
    with torch.no_grad():
        got, want, far = (m(ids).logits for m in (ours, eager, unwindowed))
        got_pad, want_pad = (m(ids, attention_mask=mask).logits for m in (ours, eager))
    assert _close(got, want) and not _close(far, want)
    assert _close(got_pad[0, 11:], want_pad[0, 11:]) and _close(got_pad[1], want_pad[1])


def test_attention_dropout_reaches_the_kernels():
    """A training layer's dropout goes to dropout_p (the same mask as a direct call under the
    same seed), padded batches included."""
    from types import SimpleNamespace

    from flash_cute import flash_attn_func
    from flash_cute.integrations.transformers import attention_forward

    q, k, v = (torch.randn(2, 4, 24, 64, dtype=torch.bfloat16) for _ in range(3))
    layer = SimpleNamespace(is_causal=True)
    torch.manual_seed(3)
    out, _ = attention_forward(layer, q, k, v, None, dropout=0.3)
    torch.manual_seed(3)
    want, _ = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True,
                              dropout_p=0.3)
    assert torch.equal(out, want)
    assert not torch.equal(out, attention_forward(layer, q, k, v, None)[0])
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :5] = 0
    padded, _ = attention_forward(layer, q, k, v, mask, dropout=0.3)
    assert padded[1, :5].eq(0).all() and padded.isfinite().all()
