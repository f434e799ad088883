"""No GPU→CPU synchronisation in flashlib.attention and flashlib.decode, and both capturable in a CUDA graph.

A decode step that reads anything back from the GPU (for example the range of ``cache_seqlens``) makes
the host wait for every queued kernel, about 100 µs on an H100, and cannot be captured in a CUDA graph.
torch's sync debug mode turns any such read into an error; a captured graph replayed on new inputs
must give what an eager call gives. The attention tests run twice: with the default Triton kernels
(kernel=("v1", "v2")) and with the TMA kernels (kernel=("v4", "v5")), whose launches also allocate
descriptor scratch, where this Triton has them (3.4 on), and in every 16-bit dtype this GPU takes
(bfloat16 from sm_80: flashlib.hardware.kernel_dtypes), chosen when collected. backend="cuda" under
capture: tests/gpu/test_cuda_gpu.py.
"""
from __future__ import annotations

import pytest
import torch

import flashlib
from flashlib.hardware import kernel_dtypes
from flashlib.kernels.triton import versions
from triton_cases import make_qkv

HALF = [getattr(torch, n) for n in kernel_dtypes("cuda") if n != "float32"]     # bfloat16 from sm_80
# flashlib.attention's kernel=: versions 1/2, and the TMA kernels where this Triton has descriptors
KERNELS = [("v1", "v2")] + ([("v4", "v5")] if versions.has_tensor_descriptors() else [])


@pytest.fixture
def no_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(params=KERNELS, ids="-".join)
def kernels(request):
    """The Triton kernels flashlib.attention runs, as its kernel= (forward, backward): versions 1/2, or
    the TMA kernels (versions 4/5). A version named with kernel= runs or raises ValueError, never
    falls back, so the TMA param is not vacuous."""
    return request.param


def assert_kernels(versions, q, k, v, do):
    """The versions named run these tensors (a ValueError says why where one cannot)."""
    from flashlib.backends import triton as triton_backend
    assert (triton_backend.forward_version(q, k, v, versions[0]),
            triton_backend.backward_version(q, k, v, do, versions[1])) == versions


def _decode_inputs(seed=0):
    q, kc, vc, _ = make_qkv(3, 8, 2, 1, 1037, 128, torch.float16, seed=seed, device="cuda")
    lens = torch.tensor([1037, 0, 513], dtype=torch.int32, device="cuda")
    return q, kc, vc, lens


def test_decode_never_syncs(request):
    # The inputs are made, and the kernels compiled, before the debug mode: copying the CPU-drawn
    # inputs to the GPU is itself a synchronizing copy (the first H200 run of this tier, 2026-11-26,
    # failed there, inside the test's own set-up, before flashlib ran).
    q, kc, vc, lens = _decode_inputs()
    lens64 = lens.long()
    calls = [dict(cache_seqlens=lens), {},            # {}: cache_seqlens=None, every key is valid
             dict(cache_seqlens=lens64, num_splits=4), dict(num_splits=1)]     # one split: no combine
    for kwargs in calls:
        flashlib.decode(q, kc, vc, **kwargs)
    request.getfixturevalue("no_sync")
    for kwargs in calls:
        flashlib.decode(q, kc, vc, **kwargs)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_and_backward_never_sync(causal, kernels):
    q, k, v, do = make_qkv(2, 8, 2, 1000, 1037, 128, torch.float16, seed=1, device="cuda")
    assert_kernels(kernels, q, k, v, do)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    flashlib.attention(*leaves, causal=causal, kernel=kernels).backward(do)   # compiled outside debug mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o = flashlib.attention(*leaves, causal=causal, kernel=kernels)
        torch.autograd.grad(o, leaves, do)
        with torch.no_grad():
            flashlib.attention(q, k, v, causal=causal, kernel=kernels)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _capture(fn):
    """Warm ``fn`` up on a side stream (Triton compiles, allocators settle), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("with_lengths", [True, False])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_is_captured_in_a_cuda_graph_and_replays_on_new_inputs(with_lengths, num_splits):
    """With lengths and without (None: the kernel compiled without them), with the split rule and with
    one split (no combine launch)."""
    q, kc, vc, lens = _decode_inputs()
    lens = lens if with_lengths else None
    graph, out = _capture(lambda: flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits))
    q2, kc2, vc2, _ = _decode_inputs(seed=7)
    for dst, src in ((q, q2), (kc, kc2), (vc, vc2)):
        dst.copy_(src)
    if with_lengths:
        lens.copy_(torch.tensor([5, 1037, 0], dtype=torch.int32))
    graph.replay()
    want = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits)
    torch.testing.assert_close(out, want, rtol=0, atol=0)          # the same kernels on the same inputs


@pytest.mark.parametrize("dtype", HALF, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_inference_is_captured_in_a_cuda_graph(causal, kernels, dtype):
    q, k, v, do = make_qkv(2, 8, 2, 300, 517, 64, dtype, seed=2, device="cuda")
    assert_kernels(kernels, q, k, v, do)

    def step():
        with torch.no_grad():
            return flashlib.attention(q, k, v, causal=causal, kernel=kernels)

    graph, out = _capture(step)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)
