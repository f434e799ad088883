"""GPU tier: the attention variants (sliding window, softcap, ALiBi, sinks, dropout) in the compiled Triton
kernels, at sizes that reach the real configs (N ~ 1000, d = 128), on CUDA tensors.

The interpreter proves the semantics on small shapes (tests/kernels/triton/test_triton_variants_*.py);
here the compiled kernels must give the same: fp32 tightly against the float64 oracle, fp16/bf16 under
FlashAttention's rule (2x a plain same-dtype implementation, 3x for gradients) with every variant and
their combination, forward, backward (dsinks included) and decode; the backward bit for bit
deterministic; dropout's mask the same bits as the reference backend's (the same Philox counters), and
the dropout statistics. The CUDA C++ backend refuses every variant by name (flashlib.backends.cuda).
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from flashlib.hardware import kernel_dtypes
from flashlib.testing import assert_attention_right

DEVICE = torch.device("cuda")
DTYPES = [getattr(torch, n) for n in kernel_dtypes(DEVICE)]
FLOOR = 1e-5


def _variants(name, H, B, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    slopes = (2.0 ** (-8.0 * torch.arange(1, H + 1) / H)).float().to(device)  # ALiBi's geometric slopes
    sinks = torch.randn(H, generator=g).float().to(device)
    return {
        "window": dict(window_size=(127, 0)),
        "window_both": dict(window_size=(200, 33)),
        "softcap": dict(softcap=5.0),
        "alibi": dict(alibi_slopes=slopes),
        "alibi_batch": dict(alibi_slopes=slopes.expand(B, H).contiguous()),
        "sinks": dict(sinks=sinks),
        "all": dict(window_size=(255, 0), softcap=30.0, alibi_slopes=slopes, sinks=sinks),
    }[name]


def _oracle_kw(kw):
    return {n: (x.double().cpu().numpy() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}


NAMES = ["window", "window_both", "softcap", "alibi", "alibi_batch", "sinks", "all"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1000, 1000, 128), (1, 4, 4, 333, 1021, 59), (1, 6, 2, 1021, 333, 111)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_follow_the_flashattention_rule(shape, causal, name, dtype):
    B, H, HKV, NQ, NK, D = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, h, n, D, generator=g).to(DEVICE, dtype).requires_grad_()
               for h, n in ((H, NQ), (HKV, NK), (HKV, NK)))
    do = torch.randn(B, H, NQ, D, generator=g).to(DEVICE, dtype)
    kw = _variants(name, H, B, DEVICE)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    o, lse = flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="triton", **kw)
    o.backward(do)
    grads = [q.grad, k.grad, v.grad] + ([kw["sinks"].grad] if "sinks" in kw else [])
    ref = _oracle_kw({n: x.detach() if isinstance(x, torch.Tensor) else x for n, x in kw.items()})
    assert_attention_right(q.detach(), k.detach(), v.detach(), do, causal=causal, o=o, lse=lse, grads=grads,
                           floor=FLOOR, **ref)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
def test_backward_with_every_variant_is_bit_for_bit_deterministic(dtype):
    B, H, HKV, N, D = 2, 8, 2, 1000, 128
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(B, h, N, D, generator=g).to(DEVICE, dtype) for h in (H, HKV, HKV, H))
    kw = _variants("all", H, B, DEVICE)
    runs = []
    for _ in range(3):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        sinks = kw["sinks"].clone().requires_grad_()
        o = flashlib.attention(*leaves, causal=True, backend="triton", dropout_p=0.1, dropout_seed=(9, 0),
                               **{**kw, "sinks": sinks})
        o.backward(do)
        runs.append([o] + [x.grad for x in leaves] + [sinks.grad])
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


def test_dropout_mask_is_the_reference_backends_bit_for_bit():
    """The Triton kernel's Z and the reference backend's are the same Philox bits: with V = I (one-hot
    value rows) the output column j of row i is P_ij Z_ij / (1 - p), so Z is read off the output."""
    B, H, N, p = 1, 2, 64, 0.4
    q = torch.randn(B, H, N, N, device=DEVICE) * 0.01
    k = torch.randn(B, H, N, N, device=DEVICE) * 0.01
    v = torch.eye(N, device=DEVICE).expand(B, H, N, N).contiguous()
    o = flashlib.attention(q, k, v, dropout_p=p, dropout_seed=(123, 456), backend="triton")
    z = flashlib.dropout_mask(q, k, p, (123, 456))
    assert torch.equal(o != 0, z)
    o_ref = flashlib.attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), dropout_p=p,
                               dropout_seed=(123, 456), backend="reference")
    torch.testing.assert_close(o.cpu().double(), o_ref, atol=1e-5, rtol=1e-4)


def test_dropout_keeps_one_minus_p():
    q = torch.randn(4, 8, 512, 64, device=DEVICE, dtype=torch.float16)
    k = torch.randn(4, 8, 512, 64, device=DEVICE, dtype=torch.float16)
    v = torch.ones(4, 8, 512, 64, device=DEVICE, dtype=torch.float16)
    o = flashlib.attention(q, k, v, dropout_p=0.2, backend="triton")
    # with V = 1, o = sum_j P_ij Z_ij / 0.8, whose mean over 16384 rows is 1 within a few 1e-3
    assert abs(float(o.float().mean()) - 1.0) < 5e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["window", "softcap", "alibi_batch", "sinks", "all"])
def test_decode_with_variants_follows_the_flashattention_rule(name, dtype):
    B, H, HKV, NQ, NMAX, D = 3, 8, 2, 2, 3000, 128
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(B, H, NQ, D, generator=g).to(DEVICE, dtype)
    kc, vc = (torch.randn(B, HKV, NMAX, D, generator=g).to(DEVICE, dtype) for _ in "kv")
    lens = torch.tensor([3000, 0, 1777], device=DEVICE, dtype=torch.int32)
    kw = _variants(name, H, B, DEVICE)
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, return_lse=True, backend="triton", **kw)
    ref = _oracle_kw(kw)
    for b, n in enumerate(lens.tolist()):
        rb = dict(ref)
        if "alibi_slopes" in rb and rb["alibi_slopes"].ndim == 2:
            rb["alibi_slopes"] = rb["alibi_slopes"][b]
        if n == 0:
            assert (o[b] == 0).all()
            continue
        assert_attention_right(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], None, o=o[b:b + 1],
                               lse=lse[b:b + 1], **rb)


def test_cuda_backend_refuses_every_variant_by_name():
    q = torch.randn(1, 2, 8, 64, device=DEVICE, dtype=torch.float16)
    for kw in (dict(window_size=(4, 0)), dict(softcap=1.0), dict(sinks=torch.zeros(2, device=DEVICE)),
               dict(alibi_slopes=torch.ones(2, device=DEVICE)), dict(dropout_p=0.1)):
        with pytest.raises(ValueError, match=f"backend='cuda' does not compute {next(iter(kw))}"):
            flashlib.attention(q, q, q, backend="cuda", **kw)
