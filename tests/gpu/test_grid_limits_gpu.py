"""The flat grids on a real GPU: batch·heads beyond CUDA's 65,535 programs on a second grid axis.

``flashlib.attention`` at B = 1024, H = 128 (B·H = 131,072) raised "Triton Error [CUDA]: invalid
argument" on an H100 while the kernels put B·H on grid axis 1. Every Triton kernel now launches a flat
axis-0 grid (flashlib.kernels.triton.flat_grid); here each one runs at that size, forward + backward (MHA and
GQA) and decode (ragged cache), checked against a plain same-dtype torch computation under
FlashAttention's rule (flashlib.testing.assert_fa_rule) with a float64 truth computed on the GPU.
Memory stays below about 4 GB: the float64 truth is computed a slice of the batch at a time.
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from flashlib.testing import assert_close, assert_fa_rule, plain_torch_attention, reference_gqa

DEVICE = torch.device("cuda")
B, H, N, D = 1024, 128, 16, 64          # B·H = 131,072 > 65,535
SLICE = 128                             # batch entries per float64 slice


def _randn(*shape, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float16)


def _attention_and_grads(fn, q, k, v, do):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(*leaves)
    return (o.detach(), *torch.autograd.grad(o, leaves, do))


@pytest.mark.parametrize("hkv", [128, 8], ids=["mha", "gqa-128/8"])
def test_forward_backward_at_131072_batch_heads(hkv):
    q, do = _randn(B, H, N, D, seed=1), _randn(B, H, N, D, seed=2)
    k, v = _randn(B, hkv, N, D, seed=3), _randn(B, hkv, N, D, seed=4)
    got = _attention_and_grads(lambda *x: flashlib.attention(*x, causal=True, backend="triton"),
                               q, k, v, do)
    torch.cuda.synchronize()                   # a launch error surfaces here at the latest
    base = _attention_and_grads(lambda *x: plain_torch_attention(*x, causal=True), q, k, v, do)
    # The float64 truth, a slice of the batch at a time (every slice checked: the programs of the last
    # batch·heads are the ones a too-large grid axis would have lost).
    for s in range(0, B, SLICE):
        part = slice(s, s + SLICE)
        want = _attention_and_grads(lambda *x: plain_torch_attention(*x, causal=True),
                                    *(x[part].double() for x in (q, k, v, do)))
        for name, a, b, w, factor in zip(("o", "dq", "dk", "dv"), got, base, want, (2, 3, 3, 3)):
            assert_fa_rule(a[part], b[part], w, factor=factor, name=f"{name} (batch {s}..{s + SLICE - 1})")
    # the float64 torch truth is the oracle's: check it once, on the last batch entry
    o_ref, _, g_ref = reference_gqa(q[-1:], k[-1:], v[-1:], causal=True, do=do[-1:])
    want = _attention_and_grads(lambda *x: plain_torch_attention(*x, causal=True),
                                *(x[-1:].double() for x in (q, k, v, do)))
    for w, r in zip(want, (o_ref, *g_ref)):
        assert_close(w, r, atol=1e-10, rtol=1e-10)


def _masked_decode(q, kc, vc, lens):
    """Plain torch decode in q's dtype: sequence b sees its first lens[b] keys (none: output 0). A GQA
    group's query rows are stacked against their kv head (a view: no copy of the cache)."""
    b, h, nq, d = q.shape
    hkv = kc.shape[1]
    qs = q.reshape(b, hkv, (h // hkv) * nq, d)                               # (b, Hkv, group·Nq, d)
    s = (qs @ kc.transpose(-1, -2)) * d ** -0.5                              # (b, Hkv, group·Nq, Nmax)
    valid = torch.arange(kc.shape[2], device=q.device)[None, :] < lens[:, None]   # (b, Nmax)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    seen = (lens > 0)[:, None, None, None]
    p = torch.softmax(s.masked_fill(~seen, 0.0), dim=-1) * seen              # no key: 0, not NaN
    return (p @ vc).reshape(b, h, nq, d)


@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_at_1024_sequences_and_128_heads(num_splits):
    hkv, nmax = 8, 300
    q = _randn(B, H, 1, D, seed=5)
    kc, vc = _randn(B, hkv, nmax, D, seed=6), _randn(B, hkv, nmax, D, seed=7)
    lens = torch.randint(0, nmax + 1, (B,), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    lens[:3] = torch.tensor([0, nmax, 1])                           # empty, full, one key
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="triton")
    torch.cuda.synchronize()
    empty = lens == 0
    assert torch.all(o[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    assert torch.isfinite(lse[~empty]).all()
    base = _masked_decode(q, kc, vc, lens)
    for s in range(0, B, SLICE):
        part = slice(s, s + SLICE)
        want = _masked_decode(*(x[part].double() for x in (q, kc, vc)), lens[part])
        assert_fa_rule(o[part], base[part], want, name=f"decode o (batch {s}..{s + SLICE - 1})")
