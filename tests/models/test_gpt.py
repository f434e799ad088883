"""Tests of flashlib/models (gpt.py): the three attention choices agree, GQA, training, generation with a
KV cache through flashlib.decode, flashlib.auto routing, the tokenizer and the shipped text, and bad
input. Tiny models: the whole file runs in seconds.

float32 models live on conftest's DEVICE (a GPU machine runs their flashlib attention in the compiled
Triton kernels); float64 models stay on the CPU, where the reference backend computes float64.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings
from hypothesis import strategies as st

import flashlib.auto
import flashlib.models.gpt as gpt
from conftest import DEVICE
from flashlib.models import (ATTENTION_CHOICES, GPT, CharTokenizer, GPTConfig, KVCache, causal_attention,
                             generate, get_batch, load_text, texts, train)


def tiny(attention="flashlib", *, n_head=4, n_kv_head=None, n_embd=32, n_layer=2, vocab=11, block=16,
         dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab, block, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd,
                    attention=attention)
    return GPT(cfg).to(device_for(dtype), dtype)


def device_for(dtype):
    """DEVICE for what Triton computes; float64 (no Triton kernel) on the CPU's reference backend."""
    return "cpu" if dtype == torch.float64 else DEVICE


def tokens(B=2, T=13, vocab=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (B, T), generator=g), torch.randint(vocab, (B, T), generator=g)


def run(model, idx, targets):
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    logits, loss = model(idx.to(device), targets.to(device))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def max_abs(a, b):
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------------------------------
# The three attention choices compute the same model.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("heads", [(4, None), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_three_attentions_same_logits_loss_and_gradients(dtype, atol, heads):
    idx, targets = tokens(T=13)                                          # T = 13: no block multiple
    results = {}
    for att in ATTENTION_CHOICES:
        model = tiny(att, n_head=heads[0], n_kv_head=heads[1], dtype=dtype)
        results[att] = run(model, idx, targets)
    ref_logits, ref_loss, ref_grads = results["naive"]
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for att in ("flashlib", "sdpa"):
        logits, loss, grads = results[att]
        assert logits.dtype == dtype and logits.shape == (2, 13, 11)
        assert max_abs(logits, ref_logits) <= atol, att
        assert abs(loss.item() - ref_loss.item()) <= atol, att
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            assert max_abs(g, ref_grads[name]) <= atol * max(1.0, scale), f"{att} grad {name}"


def test_set_attention_switches_every_block_and_keeps_weights():
    model = tiny("naive")
    idx, targets = tokens()
    naive = run(model, idx, targets)
    state = copy.deepcopy(model.state_dict())
    assert model.set_attention("flashlib") is model
    assert model.config.attention == "flashlib"
    assert all(b.attn.attention == "flashlib" for b in model.transformer.h)
    flash = run(model, idx, targets)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert max_abs(flash[0], naive[0]) <= 1e-10
    with pytest.raises(ValueError, match="attention must be one of"):
        model.set_attention("flash")


def test_weight_tying_and_same_init_for_every_attention():
    models = [tiny(att) for att in ATTENTION_CHOICES]
    for m in models:
        assert m.lm_head.weight is m.transformer.wte.weight
    sd = [m.state_dict() for m in models]
    assert all(torch.equal(sd[0][k], s[k]) for s in sd[1:] for k in sd[0])
    # the tied weight is counted once; c_attn has (n_head + 2 n_kv_head) * head_dim outputs
    gqa = tiny(n_head=4, n_kv_head=1, n_embd=32)
    assert gqa.transformer.h[0].attn.c_attn.out_features == (4 + 2) * 8
    assert gqa.num_params() == len(torch.nn.utils.parameters_to_vector(gqa.parameters()))


@pytest.mark.parametrize("attention", ATTENTION_CHOICES)
def test_block_is_causal_and_residual(attention):
    torch.manual_seed(0)
    cfg = GPTConfig(11, 16, n_head=4, n_kv_head=2, n_embd=32, attention=attention)
    block = gpt.Block(cfg).double()
    assert isinstance(block.attn, gpt.CausalSelfAttention) and isinstance(block.mlp, gpt.MLP)
    assert block.mlp.c_fc.out_features == 4 * 32                         # (B, T, C) -> (B, T, 4C)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    later = x.clone()
    later[:, 5:] += 1.0                                                  # change only the future
    y, y_later = block(x), block(later)
    assert max_abs(y[:, :5], y_later[:, :5]) <= 1e-12                    # the past does not see it
    assert max_abs(y[:, 5:], y_later[:, 5:]) > 0.1
    for proj in (block.attn.c_proj, block.mlp.c_proj):                   # both branches output 0:
        torch.nn.init.zeros_(proj.weight)
        torch.nn.init.zeros_(proj.bias)
    assert torch.equal(block(x), x)                                      # only the residual path is left


@settings(max_examples=8, deadline=None)
@given(n_kv=st.sampled_from([1, 2, 4]), T=st.integers(1, 16), B=st.integers(1, 3), seed=st.integers(0, 9))
def test_causal_attention_property_flashlib_equals_naive(n_kv, T, B, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 4, T, 8, generator=g, dtype=torch.float64)
    k = torch.randn(B, n_kv, T, 8, generator=g, dtype=torch.float64)
    v = torch.randn(B, n_kv, T, 8, generator=g, dtype=torch.float64)
    ref = causal_attention(q, k, v, "naive")
    for att in ("flashlib", "sdpa"):
        assert max_abs(causal_attention(q, k, v, att), ref) <= 1e-12
    # causal: the first query sees only the first key, whatever the rest
    assert max_abs(ref[:, :, 0], v.repeat_interleave(4 // n_kv, dim=1)[:, :, 0]) <= 1e-12


# --------------------------------------------------------------------------------------------------
# Training and sampling.
# --------------------------------------------------------------------------------------------------

def test_training_flashlib_and_sdpa_give_the_same_losses():
    data = torch.randint(11, (600,), generator=torch.Generator().manual_seed(3))
    losses = {}
    for att in ("flashlib", "sdpa"):
        model = tiny(att, dtype=torch.float32)
        losses[att] = train(model, data, steps=3, batch_size=4, seq_len=16, lr=1e-2, seed=7)
    assert len(losses["flashlib"]) == 3
    assert losses["flashlib"][0] == pytest.approx(losses["sdpa"][0], abs=1e-5)   # same init and batch
    assert max(abs(a - b) for a, b in zip(losses["flashlib"], losses["sdpa"])) <= 1e-4
    assert losses["flashlib"][-1] < losses["flashlib"][0]                        # it learns
    # deterministic: the same seed gives the same losses again
    again = train(tiny("flashlib", dtype=torch.float32), data, steps=3, batch_size=4, seq_len=16,
                  lr=1e-2, seed=7)
    assert again == losses["flashlib"]


def test_get_batch_windows_and_targets():
    data = torch.arange(100)
    x, y = get_batch(data, 5, 7, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 7) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)                                          # y is x shifted by one
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(5, 6, dtype=torch.int64))   # contiguous windows
    x2, _ = get_batch(data, 5, 7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
    x3, _ = get_batch(data, 3, 99)                                        # the longest window fits
    assert torch.equal(x3[0], torch.arange(99))


def test_generate_shapes_determinism_and_greedy_agreement():
    idx = torch.tensor([[1, 2, 3]])
    out = {}
    for att in ATTENTION_CHOICES:
        model = tiny(att, block=8)
        model.train()
        a = generate(model, idx, 12, seed=5)
        assert model.training                                             # mode restored
        assert a.shape == (1, 15) and torch.equal(a[:, :3], idx)
        assert int(a.min()) >= 0 and int(a.max()) < 11
        assert torch.equal(a, generate(model, idx, 12, seed=5))           # crosses block_size = 8
        out[att] = generate(model, idx, 12, top_k=1)                      # greedy
    assert torch.equal(out["flashlib"], out["naive"]) and torch.equal(out["sdpa"], out["naive"])
    assert generate(tiny(), idx, 0).shape == (1, 3)


# --------------------------------------------------------------------------------------------------
# Generation with a KV cache: the prompt once, then each token through flashlib.decode.
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def calls(monkeypatch):
    """Spy on gpt.py's three flashlib calls: the arguments of each call, per function, in order."""
    seen = {"decode": [], "attention": [], "qkvpacked": []}
    for key, name in (("decode", "flash_decode"), ("attention", "flash_attention"),
                      ("qkvpacked", "attention_qkvpacked")):
        def spy(*args, _real=getattr(gpt, name), _key=key, **kwargs):
            seen[_key].append((args, kwargs))
            return _real(*args, **kwargs)
        monkeypatch.setattr(gpt, name, spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("heads", [(4, None), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("T", [1, 4, 11])
def test_kv_cache_gives_the_full_recompute_tokens_through_flashlib_decode(dtype, heads, T, calls):
    model = tiny(n_head=heads[0], n_kv_head=heads[1], dtype=dtype, block=16)
    idx = tokens(B=3, T=T, seed=T)[0].to(device_for(dtype))              # (3, T): a batch of prompts
    new = 16 - T                                                         # fills the window exactly
    cached = generate(model, idx, new, top_k=1)                          # greedy
    assert cached.shape == (3, 16) and torch.equal(cached[:, :T], idx)
    decoded = [kw["cache_seqlens"].tolist() for _, kw in calls["decode"]]
    # one decode per block per token after the first; the new token sees every cached key, itself too
    assert decoded == [[n] * 3 for n in range(T + 1, 16) for _ in range(2)]
    assert all(args[1].shape == (3, model.config.n_kv_head, 16, 8) for args, _ in calls["decode"])
    assert len(calls["attention"]) == 2                                  # the prefill, once per block
    full = generate(model, idx, new, top_k=1, kv_cache=False)
    assert len(calls["decode"]) == 2 * (new - 1)                         # the recompute never decodes
    assert torch.equal(cached, full)


def test_mha_uses_attention_qkvpacked_and_gqa_splits(calls):
    idx = tokens(T=9)[0]
    for n_kv, packed in ((None, 2), (2, 0)):                             # one call per block, or none
        model = tiny(n_kv_head=n_kv)
        for key in calls:
            calls[key].clear()
        model(idx)
        assert len(calls["qkvpacked"]) == packed and len(calls["attention"]) == 2 - packed
        if packed:
            (qkv,), kw = calls["qkvpacked"][0]
            assert qkv.shape == (2, 9, 3, 4, 8) and kw == {"causal": True}   # (B, T, 3, H, hs)
        generate(model, idx, 3, top_k=1, kv_cache=False)
        assert len(calls["qkvpacked"]) == 4 * packed                     # three more model calls


def test_beyond_the_window_the_cache_re_prefills_and_keeps_the_tokens(calls):
    model = tiny(block=16)
    for T in (5, 20):                                                    # window fills, or starts full
        for key in calls:
            calls[key].clear()
        idx = tokens(B=2, T=T, seed=T)[0]
        cached = generate(model, idx, 20, top_k=1)
        assert len(calls["decode"]) == 2 * max(0, 16 - T)                # decodes while there is room
        assert len(calls["attention"]) == 2 * (20 - max(0, 16 - T))     # then a full window per token
        assert torch.equal(cached, generate(model, idx, 20, top_k=1, kv_cache=False))
    sampled = generate(model, idx, 20, temperature=0.8, seed=3)
    assert torch.equal(sampled, generate(model, idx, 20, temperature=0.8, seed=3, kv_cache=False))


def test_cached_forward_equals_the_full_forward():
    model = tiny(n_kv_head=2, block=12).eval()
    idx = tokens(B=2, T=10)[0]
    cache = KVCache(model, 2)
    assert cache.k.shape == cache.v.shape == (2, 2, 2, 12, 8) and cache.length == 0
    with torch.no_grad():
        full, _ = model(idx)                                             # (2, 10, 11)
        prefill, _ = model(idx[:, :6], cache=cache)
        steps = [model(idx[:, n:n + 1], cache=cache)[0] for n in range(6, 10)]
    assert cache.length == 10
    assert max_abs(prefill, full[:, :6]) <= 1e-12
    assert max_abs(torch.cat(steps, dim=1), full[:, 6:]) <= 1e-12      # each token from the cache
    assert (cache.k[:, :, :, 10:] == 0).all()                            # nothing written past length
    assert cache.reset() is cache and cache.length == 0


def test_kv_cache_bad_arguments():
    model = tiny(block=8)
    idx = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="kv_cache must be a bool, got int"):
        generate(model, idx, 2, kv_cache=1)
    with pytest.raises(TypeError, match="model must be a flashlib.models.GPT, got Linear"):
        KVCache(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        KVCache(model, 0)
    with pytest.raises(TypeError, match="cache must be a flashlib.models.KVCache or None, got dict"):
        with torch.no_grad():
            model(idx, cache={})
    cache = KVCache(model, 2)
    with pytest.raises(ValueError, match="a KVCache is for generation"):
        model(idx, cache=cache)                                          # grad enabled
    with torch.no_grad():
        with pytest.raises(ValueError, match="for batch size 1"):
            model(idx[:1], cache=cache)
        with pytest.raises(ValueError, match="float32 on cpu"):
            model(idx, cache=KVCache(tiny(block=8, dtype=torch.float32).cpu(), 2))
        model(idx, cache=cache)
        with pytest.raises(ValueError, match=r"non-empty cache \(length 3\) idx must hold one new token"):
            model(idx, cache=cache)
        for _ in range(5):
            model(idx[:, :1], cache=cache)
        with pytest.raises(ValueError, match=r"holds 8 of the block_size \(8\) positions"):
            model(idx[:, :1], cache=cache)
    assert cache.length == 8                                             # refused calls wrote nothing


# --------------------------------------------------------------------------------------------------
# flashlib.auto around a model that calls SDPA.
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def sdpa_not_routed():
    """Start from the real SDPA (whatever another test left) and put the previous state back after."""
    was = flashlib.auto.is_enabled()
    flashlib.auto.disable()
    yield
    if was:
        flashlib.auto.enable()


def test_flashlib_auto_routes_the_models_sdpa_calls(sdpa_not_routed):
    original = F.scaled_dot_product_attention
    idx, targets = tokens(T=13)
    for heads in ((4, None), (4, 2)):
        model = tiny("sdpa", n_head=heads[0], n_kv_head=heads[1], dtype=torch.float32)
        plain = run(model, idx, targets)
        before = flashlib.auto.stats["routed"]
        with flashlib.auto.enabled():
            assert F.scaled_dot_product_attention is not original
            routed = run(model, idx, targets)
        assert flashlib.auto.stats["routed"] - before == model.config.n_layer   # one call per block
        assert F.scaled_dot_product_attention is original                       # restored
        flash = run(tiny("flashlib", n_head=heads[0], n_kv_head=heads[1], dtype=torch.float32), idx, targets)
        assert abs(routed[1].item() - plain[1].item()) <= 1e-5
        assert max_abs(routed[0], plain[0]) <= 2e-5
        assert routed[1].item() == flash[1].item()                              # routed == flashlib's
        for name, g in routed[2].items():
            assert max_abs(g, plain[2][name]) <= 2e-5, name


# --------------------------------------------------------------------------------------------------
# Tokenizer and the shipped text.
# --------------------------------------------------------------------------------------------------

def test_shipped_text_is_packaged_and_header_dropped():
    assert "alice" in texts()
    text = load_text("alice")
    assert len(text) > 20_000
    assert text.startswith("CHAPTER I. Down the Rabbit-Hole")
    assert not any(line.startswith("#") for line in text.splitlines())
    assert text.isascii()


def test_char_tokenizer_round_trip():
    text = load_text()
    tok = CharTokenizer(text)
    assert tok.chars == sorted(set(text)) and tok.vocab_size == len(set(text))
    ids = tok.encode(text[:500])
    assert tok.decode(ids) == text[:500]
    assert tok.decode(torch.tensor(ids)) == text[:500]
    assert all(0 <= i < tok.vocab_size for i in ids)


# --------------------------------------------------------------------------------------------------
# Bad input.
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(n_embd=30, n_head=4), "n_embd must be a multiple of n_head"),
    (dict(n_head=4, n_kv_head=3), "must be a multiple of n_kv_head"),
    (dict(attention="flash"), "attention must be one of"),
    (dict(attention=None), "attention must be one of"),
    (dict(vocab_size=0), "vocab_size must be an int >= 1"),
    (dict(block_size=-2), "block_size must be an int >= 1"),
    (dict(n_layer=0), "n_layer must be an int >= 1"),
    (dict(n_kv_head=0), "n_kv_head must be an int >= 1"),
    (dict(n_head=1, n_embd=512), "head dim"),
])
def test_bad_config_raises_value_error(kwargs, match):
    base = dict(vocab_size=11, block_size=16, n_layer=2, n_head=4, n_embd=32)
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**base, **kwargs})


def test_bad_types_and_inputs():
    with pytest.raises(TypeError, match="n_head must be an int"):
        GPTConfig(11, 16, n_head=4.0)
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPT({"vocab_size": 11})
    model = tiny(block=16)
    with pytest.raises(ValueError, match="T = 17"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\)"):
        model(torch.zeros(17, dtype=torch.long))
    with pytest.raises(TypeError, match="idx must hold integer token ids"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention must be one of"):
        causal_attention(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), "flash")
    data = torch.arange(50) % 11
    with pytest.raises(ValueError, match="seq_len must be at most the model's block_size"):
        train(model, data, steps=1, batch_size=2, seq_len=17)
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        train(model, data, steps=1, batch_size=2, seq_len=8, lr=0.0)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        train(model, data, steps=0, batch_size=2, seq_len=8)
    with pytest.raises(TypeError, match="model must be a flashlib.models.GPT"):
        train(torch.nn.Linear(2, 2), data, steps=1, batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="data must be longer than seq_len"):
        get_batch(torch.arange(8), 2, 8)
    with pytest.raises(ValueError, match="data must be a 1-D tensor"):
        get_batch(torch.zeros(2, 50, dtype=torch.long), 2, 8)
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        generate(model, torch.zeros(1, 2, dtype=torch.long), 3, temperature=0.0)
    tok = CharTokenizer("abc")
    with pytest.raises(ValueError, match="'z', which is not in the tokenizer's vocabulary"):
        tok.encode("abz")
    with pytest.raises(ValueError, match=r"ids must be ints in \[0, 3\)"):
        tok.decode([0, 3])
    with pytest.raises(ValueError, match="text must hold at least one character"):
        CharTokenizer("")
    with pytest.raises(ValueError, match="name must be one of"):
        load_text("no-such-text")
