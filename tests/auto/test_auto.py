"""flashlib.auto: routing SDPA calls to flashlib, falling back for the rest, restoring the original.

Tensors live on conftest's DEVICE: on a GPU machine routed calls run the compiled Triton kernels ("auto"
on CUDA tensors), on a CPU machine the reference backend.
"""
import subprocess
import sys

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


def _qkv(b, h, hkv, nq, nk, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(DEVICE).requires_grad_()  # noqa: E731
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
