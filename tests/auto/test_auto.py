"""flashlib.auto: routing SDPA calls to flashlib (decode-shaped ones to flashlib.decode), falling back
for the rest, restoring the original.

Tensors live on conftest's DEVICE: on a GPU machine routed calls run the compiled Triton kernels ("auto"
on CUDA tensors), on a CPU machine the reference backend.
"""
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashlib.auto as auto
from conftest import DEVICE

ORIGINAL = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _restore():
    yield
    auto.disable()
    assert F.scaled_dot_product_attention is ORIGINAL


def _qkv(b, h, hkv, nq, nk, d, dtype=torch.float32, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(DEVICE).requires_grad_(grad)  # noqa: E731
    return mk(b, h, nq, d), mk(b, hkv, nk, d), mk(b, hkv, nk, d)


def test_import_changes_nothing_and_disable_restores_the_same_object():
    assert F.scaled_dot_product_attention is ORIGINAL and not auto.is_enabled()
    auto.enable()
    auto.enable()                                      # idempotent
    assert F.scaled_dot_product_attention is auto.scaled_dot_product_attention and auto.is_enabled()
    auto.disable()
    assert F.scaled_dot_product_attention is ORIGINAL
    with auto.enabled():
        assert auto.is_enabled()
    assert F.scaled_dot_product_attention is ORIGINAL


@pytest.mark.parametrize("nq,nk", [(6, 6), (4, 11), (11, 4)])
def test_top_left_causal_is_sdpa_is_causal(nq, nk):
    q, k, v = (x.detach() for x in _qkv(1, 2, 2, nq, nk, 16))
    torch.testing.assert_close(auto.top_left_causal(q, k, v, None), ORIGINAL(q, k, v, is_causal=True))


@pytest.mark.parametrize("nq,nk,causal,h,hkv,gqa,scale", [
    (7, 7, True, 2, 2, False, None),
    (5, 13, True, 2, 2, False, None),    # SDPA top-left: keys >= 5 are never seen
    (13, 5, True, 2, 2, False, None),    # rows >= 5 see every key; no row is empty
    (9, 17, False, 4, 2, True, 0.3),     # GQA
    (1, 40, True, 4, 1, True, None),     # MQA decode-like
])
def test_routed_calls_equal_sdpa_with_gradients(nq, nk, causal, h, hkv, gqa, scale):
    q, k, v = _qkv(2, h, hkv, nq, nk, 24)
    want = ORIGINAL(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    before = dict(auto.stats)
    with auto.enabled():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                             enable_gqa=gqa)
    assert auto.stats["routed"] == before["routed"] + 1
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


def test_top_left_differs_from_bottom_right_and_auto_follows_sdpa():
    import flashlib
    q, k, v = _qkv(1, 1, 1, 3, 8, 16)
    sdpa = ORIGINAL(q, k, v, is_causal=True)
    bottom_right = flashlib.attention(q, k, v, causal=True)
    assert not torch.allclose(sdpa, bottom_right)       # the two conventions really differ here
    with auto.enabled():
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), sdpa)


@pytest.mark.parametrize("kwargs,shape_q,dtype", [
    ({"attn_mask": torch.ones(6, 6, dtype=torch.bool, device=DEVICE)}, (1, 2, 6, 8), torch.float32),
    ({"dropout_p": 0.5}, (1, 2, 6, 8), torch.float32),
    ({}, (2, 6, 8), torch.float32),                    # 3-D: not routed
    ({}, (1, 2, 6, 8), torch.float64),                 # float64: not routed
])
def test_unsupported_calls_fall_back_to_sdpa(kwargs, shape_q, dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(*shape_q, generator=g, dtype=dtype).to(DEVICE)
    before = dict(auto.stats)
    torch.manual_seed(0)
    want = ORIGINAL(q, q, q, **kwargs)
    with auto.enabled():
        torch.manual_seed(0)
        got = F.scaled_dot_product_attention(q, q, q, **kwargs)
    assert auto.stats["fallback"] == before["fallback"] + 1
    assert auto.stats["routed"] == before["routed"]
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_an_sdpa_error_stays_sdpas_error():
    q, k, v = _qkv(1, 4, 2, 5, 5, 8)                   # different heads without enable_gqa
    with pytest.raises(RuntimeError) as original_error:
        ORIGINAL(q, k, v)
    with auto.enabled(), pytest.raises(RuntimeError) as routed_error:
        F.scaled_dot_product_attention(q, k, v)
    assert str(routed_error.value) == str(original_error.value)


def test_route_reason_explains_the_fall_back():
    q, k, v = _qkv(1, 2, 2, 4, 4, 300)
    assert auto.route_reason(q, k, v) == "head dim > 256"
    q, k, v = _qkv(1, 2, 2, 4, 4, 8)
    assert auto.route_reason(q, k, v) is None
    assert "attn_mask" in auto.route_reason(q, k, v, attn_mask=torch.ones(4, 4, device=DEVICE))


def test_import_on_enables_in_one_line():
    code = ("import torch.nn.functional as F; orig = F.scaled_dot_product_attention; "
            "import flashlib.auto.on, flashlib.auto as a; "
            "assert a.is_enabled() and F.scaled_dot_product_attention is not orig; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr



# --------------------------------------------------------------------------------------------------
# Decode-shaped calls (few queries, a long cache, no mask, no gradient) go to flashlib.decode.
# --------------------------------------------------------------------------------------------------

@pytest.fixture
def decode_calls(monkeypatch):
    """flashlib.decode, spied on: the list of the q shapes it was called with."""
    import flashlib
    calls, real = [], flashlib.decode

    def spy(q, k_cache, v_cache, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, k_cache, v_cache, **kwargs)
    monkeypatch.setattr(flashlib, "decode", spy)
    return calls


def _routed(q, k, v, **kwargs):
    """F.scaled_dot_product_attention(q, k, v, **kwargs) with auto enabled, and the change of stats."""
    before = dict(auto.stats)
    with auto.enabled():
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    return out, {name: auto.stats[name] - before[name] for name in before}


@pytest.mark.parametrize("b,h,hkv,nq,nk,d,gqa,scale", [
    (2, 4, 4, 1, 40, 24, False, None),     # one token, MHA
    (2, 4, 2, 3, 37, 24, True, 0.3),       # a few tokens (speculative), GQA
    (1, 8, 1, 1, 9, 16, True, None),       # MQA
    (1, 2, 2, 16, 64, 8, False, None),     # the edges: Nq = 16, Nk = 4 Nq
])
def test_decode_shaped_calls_go_to_decode_and_equal_sdpa(decode_calls, b, h, hkv, nq, nk, d, gqa, scale):
    q, k, v = _qkv(b, h, hkv, nq, nk, d, grad=False)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)     # (B, H, Nq, d) strided as a HF model's query
    want = ORIGINAL(q, k, v, scale=scale, enable_gqa=gqa)
    assert auto.decode_shaped(q, k, v)
    got, counted = _routed(q, k, v, scale=scale, enable_gqa=gqa)     # grad mode on, nothing needs grad
    assert decode_calls == [(b, h, nq, d)]
    assert counted == {"routed": 1, "decode": 1, "fallback": 0}
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_inputs_that_require_grad_go_to_decode_only_under_no_grad(decode_calls):
    q, k, v = _qkv(1, 4, 2, 1, 30, 16)                      # requires grad
    want = ORIGINAL(q, k, v, enable_gqa=True)
    got, counted = _routed(q, k, v, enable_gqa=True)         # grad enabled: attention, differentiable
    assert decode_calls == [] and counted == {"routed": 1, "decode": 0, "fallback": 0}
    torch.testing.assert_close(torch.autograd.grad(got.sum(), q), torch.autograd.grad(want.sum(), q),
                               atol=2e-5, rtol=1e-5)
    with torch.no_grad():
        got, counted = _routed(q, k, v, enable_gqa=True)
    assert decode_calls == [(1, 4, 1, 16)] and counted["decode"] == 1
    torch.testing.assert_close(got, want.detach(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("nq,nk,causal", [
    (1, 40, True),      # SDPA's top-left mask: the one query sees key 0 only, not the cache
    (4, 40, True),
    (17, 200, False),   # more than 16 queries: the forward's query blocks fill up
    (2, 7, False),      # fewer than 4 keys per query: no cache to split
])
def test_calls_that_are_not_decode_shaped_go_to_attention(decode_calls, nq, nk, causal):
    q, k, v = _qkv(1, 4, 2, nq, nk, 16, grad=False)
    assert not auto.decode_shaped(q, k, v, is_causal=causal)
    want = ORIGINAL(q, k, v, is_causal=causal, enable_gqa=True)
    with torch.no_grad():
        got, counted = _routed(q, k, v, is_causal=causal, enable_gqa=True)
    assert decode_calls == [] and counted == {"routed": 1, "decode": 0, "fallback": 0}
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_masked_calls_never_reach_decode(decode_calls):
    q, k, v = _qkv(1, 2, 2, 1, 40, 16, grad=False)
    mask = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    with torch.no_grad():
        got, counted = _routed(q, k, v, attn_mask=mask)
    assert decode_calls == [] and counted == {"routed": 0, "decode": 0, "fallback": 1}
    torch.testing.assert_close(got, ORIGINAL(q, k, v, attn_mask=mask), atol=0, rtol=0)


@pytest.mark.parametrize("nq", [1, 3])
def test_top_left_causal_means_every_key_only_with_one_key(nq):
    """Why decode_shaped refuses every causal call: top-left is_causal lets query 0 see key 0 only, so
    it equals decode's "every key" exactly when Nk == 1, and one key is no cache."""
    for nk in (1, 2, 40):
        q, k, v = _qkv(1, 2, 2, nq, nk, 16, grad=False)
        same = torch.allclose(ORIGINAL(q, k, v, is_causal=True), ORIGINAL(q, k, v), atol=1e-6)
        assert same == (nk == 1), nk
        assert not auto.decode_shaped(q, k, v, is_causal=True)


def _hf_like_generate(weights, prompt, new_tokens, n_head, n_kv_head):
    """Greedy generation as a Hugging Face model with attn_implementation="sdpa" runs it: the prompt in
    one SDPA call per layer with is_causal=True (prefill), then one token per step, its one query per
    head against the KV cache grown by torch.cat, with is_causal=False; GQA through enable_gqa.
    ``weights``: token and position embeddings, then (Wq, Wk, Wv, Wo) per layer. Returns (B, T + new)."""
    tok_emb, pos_emb, layers = weights
    B, C = prompt.shape[0], tok_emb.shape[1]
    d = C // n_head
    cache = [None] * len(layers)
    out, ids, start = [prompt], prompt, 0
    for _ in range(new_tokens):
        T = ids.shape[1]
        x = tok_emb[ids] + pos_emb[start:start + T]                        # (B, T, C)
        for i, (wq, wk, wv, wo) in enumerate(layers):
            q = (x @ wq).view(B, T, n_head, d).transpose(1, 2)             # (B, H, T, d)
            k = (x @ wk).view(B, T, n_kv_head, d).transpose(1, 2)          # (B, Hkv, T, d)
            v = (x @ wv).view(B, T, n_kv_head, d).transpose(1, 2)
            if cache[i] is not None:
                k, v = torch.cat([cache[i][0], k], dim=2), torch.cat([cache[i][1], v], dim=2)
            cache[i] = (k, v)                                              # (B, Hkv, start + T, d)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=n_head != n_kv_head)
            x = x + a.transpose(1, 2).reshape(B, T, C) @ wo                # (B, T, C)
        ids = (x[:, -1] @ tok_emb.T).argmax(-1, keepdim=True)              # (B, 1) greedy
        out.append(ids)
        start += T
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("n_head,n_kv_head", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_hf_like_generation_is_token_identical_and_decodes_token_by_token(decode_calls, n_head, n_kv_head):
    """flashlib.models' GPT decodes from its KV cache with flashlib.decode itself, never through SDPA,
    so this loop plays the Hugging Face model: it calls SDPA as HF's sdpa attention does."""
    g = torch.Generator().manual_seed(0)
    C, vocab, layers, prompt_len, new = 32, 50, 2, 7, 12
    mk = lambda *s, std=C ** -0.5: (torch.randn(*s, generator=g) * std).to(DEVICE)   # noqa: E731
    d = C // n_head
    weights = (mk(vocab, C, std=1.0), mk(prompt_len + new, C, std=1.0),
               [(mk(C, C), mk(C, n_kv_head * d), mk(C, n_kv_head * d), mk(C, C)) for _ in range(layers)])
    prompt = torch.randint(vocab, (3, prompt_len), generator=g).to(DEVICE)
    with torch.no_grad():
        plain = _hf_like_generate(weights, prompt, new, n_head, n_kv_head)
        before = dict(auto.stats)
        with auto.enabled():
            routed = _hf_like_generate(weights, prompt, new, n_head, n_kv_head)
    assert torch.equal(routed, plain)
    assert len(set(plain[:, prompt_len:].flatten().tolist())) > 1        # not one token repeated
    assert decode_calls == [(3, n_head, 1, d)] * (layers * (new - 1))    # every step after the prefill
    assert auto.stats["decode"] - before["decode"] == layers * (new - 1)
    assert auto.stats["routed"] - before["routed"] == layers * new       # the prefill went to attention


def test_compiled_model_sends_decode_shaped_calls_to_one_decode_op():
    """torch.compile of a model routed by flashlib.auto: a decode-shaped SDPA call becomes the one
    custom op flashlib::decode (dynamo used to trace into the backend and fail), equal to eager SDPA."""
    q, k, v = _qkv(1, 8, 2, 1, 64, 16, grad=False)

    def layer(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True) * 2

    want = ORIGINAL(q, k, v, enable_gqa=True) * 2
    with auto.enabled(), torch.no_grad():
        torch._dynamo.reset()
        explain = torch._dynamo.explain(layer)(q, k, v)
        torch._dynamo.reset()
        before = auto.stats["decode"]
        got = torch.compile(layer, backend="aot_eager", fullgraph=True)(q, k, v)
        assert auto.stats["decode"] == before + 1                   # traced once, through decode
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons
    called = [str(n.target) for n in explain.graphs[0].graph.nodes if str(n.target).startswith("flashlib.")]
    assert called == ["flashlib.decode.default"]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


# ---- odd arguments: under auto, SDPA's own answer or SDPA's own exception, never flashlib's ----
# Each case: (id, build(q, k, v) -> (args, kwargs), "routed" or "sdpa"). "routed": flashlib computes it
# (values close to SDPA's, gradients too); "sdpa": the router hands the call to SDPA unchanged (the same
# values bit for bit, or the same exception type and message). Before: scale=True failed under auto
# (flashlib refuses a bool scale; SDPA reads it as 1.0), scale=nan raised flashlib's ValueError, and
# is_causal="yes" or np.bool_(True) was accepted (SDPA refuses anything but a bool).
def _other(q, **changes):
    """A tensor like ``q`` with some of (B, H, N, d) or the dtype changed, from a fixed seed."""
    shape = dict(zip("bhnd", q.shape), **{k: v for k, v in changes.items() if k in "bhnd"})
    g = torch.Generator().manual_seed(7)
    dtype = changes.get("dtype", q.dtype)
    return torch.randn(*shape.values(), generator=g).to(DEVICE, dtype)


ODD_CALLS = [
    ("scale=True", lambda q, k, v: ((q, k, v), {"scale": True}), "sdpa"),
    ("scale=False", lambda q, k, v: ((q, k, v), {"scale": False}), "sdpa"),
    ("scale=np.float64", lambda q, k, v: ((q, k, v), {"scale": np.float64(0.3)}), "routed"),
    ("scale=np.float32", lambda q, k, v: ((q, k, v), {"scale": np.float32(0.3)}), "sdpa"),
    ("scale=tensor", lambda q, k, v: ((q, k, v), {"scale": torch.tensor(0.3)}), "sdpa"),
    ("scale=nan", lambda q, k, v: ((q, k, v), {"scale": float("nan")}), "sdpa"),
    ("scale=inf", lambda q, k, v: ((q, k, v), {"scale": float("inf")}), "sdpa"),
    ("scale=1e300", lambda q, k, v: ((q, k, v), {"scale": 1e300}), "sdpa"),
    ("scale=10**400", lambda q, k, v: ((q, k, v), {"scale": 10 ** 400}), "sdpa"),
    ("scale='1'", lambda q, k, v: ((q, k, v), {"scale": "1"}), "sdpa"),
    ("scale=0", lambda q, k, v: ((q, k, v), {"scale": 0}), "routed"),
    ("scale=-0.5", lambda q, k, v: ((q, k, v), {"scale": -0.5}), "routed"),
    ("scale=2 (int)", lambda q, k, v: ((q, k, v), {"scale": 2}), "routed"),
    ("is_causal='yes'", lambda q, k, v: ((q, k, v), {"is_causal": "yes"}), "sdpa"),
    ("is_causal=''", lambda q, k, v: ((q, k, v), {"is_causal": ""}), "sdpa"),
    ("is_causal=np.bool_", lambda q, k, v: ((q, k, v), {"is_causal": np.bool_(True)}), "sdpa"),
    ("is_causal=1", lambda q, k, v: ((q, k, v), {"is_causal": 1}), "sdpa"),
    ("is_causal=None", lambda q, k, v: ((q, k, v), {"is_causal": None}), "sdpa"),
    ("is_causal=tensor", lambda q, k, v: ((q, k, v), {"is_causal": torch.tensor(True)}), "sdpa"),
    ("is_causal positional", lambda q, k, v: ((q, k, v, None, 0.0, True), {}), "routed"),
    ("enable_gqa='yes'", lambda q, k, v: ((q, k, v), {"enable_gqa": "yes"}), "sdpa"),
    ("enable_gqa=np.bool_", lambda q, k, v: ((q, k, v), {"enable_gqa": np.bool_(True)}), "sdpa"),
    ("enable_gqa=1", lambda q, k, v: ((q, k, v), {"enable_gqa": 1}), "sdpa"),
    ("enable_gqa=None", lambda q, k, v: ((q, k, v), {"enable_gqa": None}), "sdpa"),
    ("gqa", lambda q, k, v: ((_other(q, h=4), k, v), {"enable_gqa": True}), "routed"),
    ("gqa without enable_gqa", lambda q, k, v: ((_other(q, h=4), k, v), {}), "sdpa"),
    ("gqa H % Hkv != 0", lambda q, k, v: ((_other(q, h=3), k, v), {"enable_gqa": True}), "sdpa"),
    ("attn_mask bool", lambda q, k, v: ((q, k, v), {"attn_mask": torch.rand(5, 7, device=DEVICE) > 0.3}),
     "sdpa"),
    ("attn_mask float", lambda q, k, v: ((q, k, v), {"attn_mask": torch.randn(5, 7, device=DEVICE)}), "sdpa"),
    ("attn_mask with is_causal", lambda q, k, v: (
        (q, k, v), {"attn_mask": torch.ones(5, 7, dtype=torch.bool, device=DEVICE), "is_causal": True}), "sdpa"),
    ("dropout_p=0.5", lambda q, k, v: ((q, k, v), {"dropout_p": 0.5}), "sdpa"),
    ("dropout_p=True", lambda q, k, v: ((q, k, v), {"dropout_p": True}), "sdpa"),
    ("dropout_p=False", lambda q, k, v: ((q, k, v), {"dropout_p": False}), "routed"),
    ("dropout_p=np.float32(0)", lambda q, k, v: ((q, k, v), {"dropout_p": np.float32(0)}), "sdpa"),
    ("dropout_p=tensor(0)", lambda q, k, v: ((q, k, v), {"dropout_p": torch.tensor(0.0)}), "sdpa"),
    ("dropout_p=tensor([0, 0])", lambda q, k, v: ((q, k, v), {"dropout_p": torch.zeros(2)}), "sdpa"),
    ("dropout_p=-0.5", lambda q, k, v: ((q, k, v), {"dropout_p": -0.5}), "sdpa"),
    ("dropout_p=nan", lambda q, k, v: ((q, k, v), {"dropout_p": float("nan")}), "sdpa"),
    ("dropout_p='0'", lambda q, k, v: ((q, k, v), {"dropout_p": "0"}), "sdpa"),
    ("dropout_p=None", lambda q, k, v: ((q, k, v), {"dropout_p": None}), "sdpa"),
    ("3-D", lambda q, k, v: ((q[0], k[0], v[0]), {}), "sdpa"),
    ("5-D", lambda q, k, v: ((q[None], k[None], v[None]), {}), "sdpa"),
    ("2-D", lambda q, k, v: ((q[0, 0], k[0, 0], v[0, 0]), {}), "sdpa"),
    ("float64", lambda q, k, v: ((q.double(), k.double(), v.double()), {}), "sdpa"),
    ("int64", lambda q, k, v: ((q.long(), k.long(), v.long()), {}), "sdpa"),
    ("mixed dtypes", lambda q, k, v: ((q, k.half(), v), {}), "sdpa"),
    ("v head dim differs", lambda q, k, v: ((q, k, _other(v, d=12)), {}), "sdpa"),
    ("head dim 300", lambda q, k, v: ((_other(q, d=300), _other(k, d=300), _other(v, d=300)), {}), "sdpa"),
    ("k, v lengths differ", lambda q, k, v: ((q, k, _other(v, n=6)), {}), "sdpa"),
    ("batch differs", lambda q, k, v: ((q, _other(k, b=3), _other(v, b=3)), {}), "sdpa"),
    ("Nq = 0", lambda q, k, v: ((q[:, :, :0], k, v), {}), "sdpa"),
    ("B = 0", lambda q, k, v: ((q[:0], k[:0], v[:0]), {}), "sdpa"),
    ("numpy query", lambda q, k, v: ((q.cpu().numpy(), k, v), {}), "sdpa"),
    ("meta tensors", lambda q, k, v: ((q.to("meta"), k.to("meta"), v.to("meta")), {}), "sdpa"),
    ("non-contiguous", lambda q, k, v: ((q.transpose(1, 2).contiguous().transpose(1, 2), k, v), {}), "routed"),
    ("requires_grad, causal", lambda q, k, v: ((q.requires_grad_(), k.requires_grad_(), v), {"is_causal": True}),
     "routed"),
    ("scale positional", lambda q, k, v: ((q, k, v, None, 0.0, False, 0.5), {}), "signature"),
    ("unknown keyword", lambda q, k, v: ((q, k, v), {"causal": True}), "signature"),
    ("value missing", lambda q, k, v: ((q, k), {}), "signature"),
]


def _outcome(fn, args, kwargs):
    """``fn(*args, **kwargs)`` from a fixed seed: ("value", tensor, grads) or ("error", type, message)."""
    torch.manual_seed(0)
    try:
        out = fn(*args, **kwargs)
    except Exception as e:                   # noqa: BLE001 - the exception is the answer compared
        return "error", type(e), str(e)
    inputs = [t for t in args[:3] if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), inputs) if inputs else ()
    return "value", out, grads


@pytest.mark.parametrize("build, expected", [c[1:] for c in ODD_CALLS], ids=[c[0] for c in ODD_CALLS])
def test_odd_arguments_get_sdpa_s_own_answer_under_auto(build, expected):
    q, k, v = _qkv(1, 2, 2, 5, 7, 8, grad=False)
    want = _outcome(ORIGINAL, *build(q, k, v))
    q, k, v = _qkv(1, 2, 2, 5, 7, 8, grad=False)         # fresh tensors: a build may set requires_grad
    before = dict(auto.stats)
    with auto.enabled():
        got = _outcome(F.scaled_dot_product_attention, *build(q, k, v))
    assert got[0] == want[0], (got, want)
    if want[0] == "error":
        assert got[1] is want[1], (got, want)
        if expected != "signature":          # the router's Python signature words a TypeError its own way
            assert got[2] == want[2]
        return
    routed = auto.stats["routed"] - before["routed"]
    assert (routed, auto.stats["fallback"] - before["fallback"]) == ((1, 0) if expected == "routed" else (0, 1))
    (_, out, grads), (_, want_out, want_grads) = got, want
    assert (out.shape, out.dtype, out.device) == (want_out.shape, want_out.dtype, want_out.device)
    if out.device.type == "meta":
        return
    exact = dict(atol=0, rtol=0, equal_nan=True) if expected == "sdpa" else dict(atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, want_out, **exact)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
