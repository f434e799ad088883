"""Empty batches and meta tensors, answered as torch's SDPA answers them, on every backend.

B = 0 (an empty bucket in serving) or H = 0: flashlib.attention and flashlib.decode return empty
``o`` and ``lse`` and attention's gradients are empty (zeros for a k, v that are not empty), with no
kernel launched (Triton and CUDA refused "a launch of 0 programs"). Meta tensors give the outputs'
shapes, dtypes and device, computing nothing ("Cannot copy out of meta tensor" before). Both are
answered in flashlib._ops, before any backend.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flashlib
from conftest import DEVICE, require_tool

BACKENDS = ["reference", "triton", "cuda", "auto"]
# (q shape, k/v shape): B = 0 with GQA, H = 0 with one kv head (SDPA also takes H = Hkv = 0, which
# flashlib's validator refuses: GQA needs Hkv >= 1)
EMPTY = [((0, 4, 5, 16), (0, 2, 7, 16)), ((2, 0, 5, 16), (2, 1, 7, 16))]


def _device(backend: str) -> str:
    if backend == "cuda":
        require_tool("g++")                      # the CUDA emulator (CPU tensors)
    return DEVICE if backend in ("triton", "auto") else "cpu"


def _sdpa(q, k, v, causal):
    """torch's answer, GQA expanded (SDPA's enable_gqa needs Hkv >= 1 dividing H, as flashlib's)."""
    group = q.shape[1] // k.shape[1] if k.shape[1] else 1
    k, v = (x.repeat_interleave(group, 1) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", EMPTY, ids=["B0", "H0"])
def test_an_empty_batch_gives_empty_outputs_and_gradients(backend, shapes):
    device = _device(backend)
    (qs, ks) = shapes
    q, k, v = (torch.randn(s, device=device, requires_grad=True) for s in (qs, ks, ks))
    o, lse = flashlib.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    want = _sdpa(q, k, v, True)
    assert o.shape == want.shape == qs and o.dtype == q.dtype and o.device == q.device
    assert lse.shape == qs[:3] and lse.dtype == torch.float32 and lse.device == q.device
    o.sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == x.dtype and not x.grad.any()
    sdpa_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert [g.shape for g in sdpa_grads] == [x.grad.shape for x in (q, k, v)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", EMPTY, ids=["B0", "H0"])
@pytest.mark.parametrize("lengths", [False, True])
def test_decode_of_an_empty_batch_gives_empty_outputs(backend, shapes, lengths):
    device = _device(backend)
    (qs, ks) = shapes
    q, kc, vc = (torch.randn(s, device=device) for s in (qs, ks, ks))
    lens = torch.full((qs[0],), 3, dtype=torch.int64, device=device) if lengths else None
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=3, return_lse=True,
                             backend=backend)
    assert o.shape == qs and o.dtype == q.dtype
    assert lse.shape == qs[:3] and lse.dtype == torch.float32
    o = flashlib.decode(q, kc, vc, cache_seqlens=lens, backend=backend)        # num_splits=None too
    assert o.shape == qs


def test_attention_qkvpacked_of_an_empty_batch():
    qkv = torch.randn(0, 6, 3, 2, 16, device=DEVICE, requires_grad=True)
    o, lse = flashlib.attention_qkvpacked(qkv, return_lse=True, backend="triton")
    assert o.shape == (0, 6, 2, 16) and lse.shape == (0, 2, 6)
    o.sum().backward()
    assert qkv.grad.shape == qkv.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_meta_tensors_give_shapes_without_computing(backend, dtype):
    """As SDPA on meta tensors: the outputs' shapes, dtypes and device; gradients too. No backend
    computes (it could not read a meta tensor) and no tool is needed ("cuda" without g++ or CuPy)."""
    q = torch.empty(2, 4, 5, 16, device="meta", dtype=dtype, requires_grad=True)
    k, v = (torch.empty(2, 2, 7, 16, device="meta", dtype=dtype, requires_grad=True) for _ in "kv")
    o, lse = flashlib.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    want = _sdpa(q, k, v, True)
    assert (o.shape, o.dtype, o.device) == (want.shape, want.dtype, want.device)
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32 and lse.is_meta
    o.sum().backward()
    assert all(x.grad.shape == x.shape and x.grad.is_meta for x in (q, k, v))
    with torch.no_grad():
        lens = torch.empty(2, dtype=torch.int32, device="meta")
        o, lse = flashlib.decode(q, k, v, cache_seqlens=lens, return_lse=True, backend=backend)
    assert o.shape == q.shape and o.is_meta and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


def test_meta_tensors_are_still_validated():
    """Meta tensors skip the compute, not the checks: bad shapes and dtypes are refused as ever."""
    q = torch.empty(1, 3, 5, 16, device="meta")
    k = torch.empty(1, 2, 7, 16, device="meta")
    with pytest.raises(ValueError, match="multiple of kv heads Hkv=2"):
        flashlib.attention(q, k, k)
    q64 = torch.empty(1, 2, 5, 16, device="meta", dtype=torch.float64)
    with pytest.raises(TypeError, match="use backend='reference' for float64"):
        flashlib.attention(q64, q64, q64, backend="triton")
