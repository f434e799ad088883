"""backend="cuda" on a real GPU: flashlib/kernels/cuda/csrc compiled at run time (NVRTC through CuPy, or nvcc when
NVRTC cannot find complete CUDA headers), against the float64 oracle.

Each test guards a defect or a semantic the CPU emulator cannot show on a GPU: the CUDA headers NVRTC
is given (crt/mma.h), tensors that require grad handed to CuPy (BufferError), and grids beyond 65,535
sequences (B in gridDim.z); for v3 (mma.sync, the 16-bit default on sm_75+) also long sequences (many
cp.async tiles in flight) and misaligned tensors (its element-wise copy path). Shapes are the awkward ones:
Nq != Nk both ways, head dims 40/59/111/128/256, GQA, causal rows that see nothing. The CUDA backend
runs on torch's stream, so it is captured in a CUDA graph and replayed on new inputs, forward and decode.

CuPy is required (tests/conftest.py's need_module: a skip with the reason, a failure under
FLASHLIB_REQUIRE_ALL). What this GPU cannot run is chosen at collection, not skipped: bfloat16 cases
exist from sm_80 on (flashlib.hardware.kernel_dtypes), v3 and the CUDA backward from sm_75; below
those, the refusal is tested to be the documented TypeError.
"""
from __future__ import annotations

import pytest
import torch
from conftest import need_module

import flashlib
import flashlib.kernels.cuda as fc
from flashlib import testing
from flashlib.hardware import kernel_dtypes

need_module("cupy")

DEVICE = torch.device("cuda")
pytestmark = pytest.mark.gpu
CAPABILITY = torch.cuda.get_device_capability(DEVICE)
V3_OK = CAPABILITY >= (7, 5)                       # mma.sync m16n8k16 (v3 and the CUDA backward)
# The 16-bit dtypes this GPU takes (bfloat16 from sm_80), and those it refuses: chosen here, never skipped.
HALF = [getattr(torch, n) for n in kernel_dtypes(DEVICE) if n != "float32"]
REFUSED_HALF = [t for t in (torch.float16, torch.bfloat16) if t not in HALF]
ALL = [torch.float32, *HALF]
ids = lambda t: {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[t]  # noqa: E731

# (B, H, Hkv, Nq, Nk, d)
SHAPES = [
    (1, 2, 1, 37, 45, 59),       # MQA, Nq < Nk
    (2, 4, 2, 45, 17, 111),      # GQA, Nq > Nk: causal rows that see nothing
    (1, 4, 4, 130, 130, 128),
    (1, 2, 1, 20, 300, 256),
    (2, 2, 2, 300, 20, 256),     # Nq > Nk at d = 256
    (1, 1, 1, 1, 1, 64),
]


def make(b, h, hkv, nq, nk, d, dtype, seed=0, requires_grad=False):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(*s, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)
            .requires_grad_(requires_grad) for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))]


def check_fa_rule(q, k, v, causal, o, lse):
    ro, rl = testing.reference_gqa(q, k, v, causal=causal)
    assert o.dtype == q.dtype and o.device.type == "cuda" and lse.shape == q.shape[:3]
    testing.assert_fa_rule(o, testing.plain_torch_attention(q, k, v, causal=causal), ro, name="o")
    testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5, name="lse")


@pytest.mark.parametrize("dtype", HALF, ids=ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_v2_forward_follows_the_flashattention_rule(shape, causal, dtype):
    q, k, v = make(*shape, dtype, seed=1)
    check_fa_rule(q, k, v, causal, *fc.forward(q, k, v, causal=causal, version="v2"))


# v3 (mma.sync): also d = 40 (16-byte copies, a partial last tile) and N = 2048 (32 K/V tiles in flight)
V3_SHAPES = SHAPES + [(1, 2, 1, 70, 130, 40), (1, 4, 2, 2048, 2048, 128), (2, 2, 2, 2048, 1000, 64)]


@pytest.mark.parametrize("dtype", HALF, ids=ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", V3_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_v3_forward_follows_the_flashattention_rule(shape, causal, dtype):
    """backend='cuda' runs v3 for 16-bit inputs on sm_75+ (bf16: sm_80+)."""
    assert fc.pick_version(str(dtype)[6:], capability=CAPABILITY) == "v3"
    q, k, v = make(*shape, dtype, seed=1)
    check_fa_rule(q, k, v, causal, *flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="cuda"))


@pytest.mark.parametrize("d", [64, 59])
def test_v3_on_misaligned_tensors(d):
    """q, k, v, o one element past a 16-byte boundary: v3 must take its element-wise copies, not cp.async."""
    shapes = ((1, 2, 45, d), (1, 1, 70, d), (1, 1, 70, d))
    q, k, v = (torch.randn(torch.Size(s).numel() + 1, device=DEVICE, dtype=torch.float16)[1:].view(s)
               for s in shapes)
    assert q.is_contiguous() and q.data_ptr() % 16 != 0
    check_fa_rule(q, k, v, True, *fc.forward(q, k, v, causal=True, version="v3"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_v1_fp32_forward_matches_the_oracle(shape, causal):
    q, k, v = make(*shape, torch.float32, seed=2)
    o, lse = flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="cuda")
    ro, rl = testing.reference_gqa(q, k, v, causal=causal)
    testing.assert_close(o, ro, atol=2e-5, rtol=1e-5, name="o")
    testing.assert_close(lse, rl, atol=2e-5, rtol=1e-5, name="lse")


@pytest.mark.parametrize("dtype", ALL, ids=ids)
def test_inputs_that_require_grad_forward_and_backward(dtype):
    """cupy.from_dlpack refuses tensors that require grad: run_gpu detaches them (the H100 failure)."""
    q, k, v = make(2, 4, 2, 45, 33, 59, dtype, seed=3, requires_grad=True)
    o, lse = flashlib.attention(q, k, v, causal=True, return_lse=True, backend="cuda")
    assert o.requires_grad and not torch.isnan(o).any()
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ro, rl, rg = testing.reference_gqa(q, k, v, causal=True, do=do)
    plain = testing.plain_torch_attention(q, k, v, causal=True)
    base = torch.autograd.grad(plain, (q, k, v), do)
    testing.assert_fa_rule(o, plain, ro, name="o")
    testing.assert_close(lse, rl, atol=1e-4, rtol=1e-5, name="lse")
    for name, got, b, want in zip(("dq", "dk", "dv"), grads, base, rg):
        assert not torch.isnan(got).any(), name
        testing.assert_fa_rule(got, b, want, factor=3.0, floor=1e-5, name=name)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("dtype", ALL, ids=ids)
def test_ragged_decode_with_lengths_zero_and_one(dtype, num_splits):
    q, kc, vc = make(4, 4, 2, 1, 50, 128, dtype, seed=4)
    lens = torch.tensor([0, 1, 37, 50], dtype=torch.int32, device=DEVICE)
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="cuda")
    assert bool((o[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())     # length 0: o = 0, lse = -inf
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for b, n in enumerate(lens.tolist()[1:], start=1):
        ro, rl = testing.reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n])
        testing.assert_close(o[b:b + 1].double(), ro, atol=tol, rtol=0, name=f"o[{b}]")
        testing.assert_close(lse[b:b + 1], rl, atol=2e-5, rtol=1e-5, name=f"lse[{b}]")


# ---- grids past 65,535 in B or H (they once sat in gridDim.z and gridDim.y) -------------------------
SAMPLE = [0, 1, 65534, 65535, 65536, 99998, 99999]      # sequences either side of the old limit


VERSIONS = [("v1", torch.float32), ("v2", torch.float16)] + ([("v3", torch.float16)] if V3_OK else [])


@pytest.mark.parametrize("version,dtype", VERSIONS, ids=[v for v, _ in VERSIONS])
def test_forward_with_100000_sequences(version, dtype):
    b = 100_000
    q, k, v = make(b, 1, 1, 16, 16, 64, dtype, seed=5)
    o, lse = fc.forward(q, k, v, causal=True, version=version)
    torch.cuda.synchronize()
    idx = torch.tensor(SAMPLE, device=DEVICE)
    qs, ks, vs = q[idx], k[idx], v[idx]
    ro, rl = testing.reference_gqa(qs, ks, vs, causal=True)
    if dtype == torch.float32:
        testing.assert_close(o[idx], ro, atol=2e-5, rtol=1e-5, name="o")
    else:
        testing.assert_fa_rule(o[idx], testing.plain_torch_attention(qs, ks, vs, causal=True), ro, name="o")
    testing.assert_close(lse[idx], rl, atol=1e-4, rtol=1e-5, name="lse")
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()           # every block ran


def test_forward_with_131072_heads_in_a_batch():
    q, k, v = make(2, 65536, 65536, 8, 24, 32, torch.float16, seed=6)      # B * H = 131072, H > 65,535
    o, lse = flashlib.attention(q, k, v, causal=True, return_lse=True, backend="cuda")
    for b, h in [(0, 0), (0, 65535), (1, 0), (1, 65535)]:
        qs, ks, vs = (x[b:b + 1, h:h + 1] for x in (q, k, v))
        ro, rl = testing.reference_gqa(qs, ks, vs, causal=True)
        testing.assert_fa_rule(o[b:b + 1, h:h + 1], testing.plain_torch_attention(qs, ks, vs, causal=True), ro)
        testing.assert_close(lse[b:b + 1, h:h + 1], rl, atol=1e-4, rtol=1e-5)
    assert not torch.isnan(o).any()


def test_decode_with_100000_sequences():
    b = 100_000
    q, kc, vc = make(b, 2, 1, 1, 40, 64, torch.float16, seed=7)
    lens = (torch.arange(b, device=DEVICE, dtype=torch.int32) * 7) % 41      # 0..40, ragged
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=3, return_lse=True, backend="cuda")
    for i in SAMPLE:
        n = int(lens[i])
        if n == 0:
            assert bool((o[i] == 0).all()) and bool(torch.isneginf(lse[i]).all())
            continue
        ro, rl = testing.reference_gqa(q[i:i + 1], kc[i:i + 1, :, :n], vc[i:i + 1, :, :n])
        testing.assert_close(o[i:i + 1].double(), ro, atol=2e-3, rtol=0, name=f"o[{i}]")
        testing.assert_close(lse[i:i + 1], rl, atol=2e-5, rtol=1e-5, name=f"lse[{i}]")
    assert not torch.isnan(o).any()


# ---- the CUDA backward (fa2_bwd_v1_mma.cu) ----------------------------------------------------------
BWD_SHAPES = [
    (1, 2, 1, 37, 45, 40),       # MQA, Nq < Nk
    (2, 4, 2, 45, 17, 111),      # GQA, Nq > Nk: causal rows that see nothing; element copies
    (1, 4, 4, 130, 130, 128),    # BQ = 16, BKV = 32: many tiles
    (1, 1, 1, 1, 1, 64),
    (1, 4, 2, 1000, 1000, 128),  # N ~ 1000: the grid and tile counts of real calls
]


@pytest.mark.parametrize("dtype", HALF, ids=ids)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_backward_follows_the_flashattention_rule(shape, causal, dtype):
    """fc.backward on the GPU: 3x plain same-dtype torch for dq, dk, dv; never NaN."""
    assert fc.backward_supported(torch.empty(1, 1, 1, shape[-1], dtype=dtype, device=DEVICE)) is None
    q, k, v = make(*shape, dtype, seed=21)
    do = torch.randn_like(q)
    o, lse = fc.forward(q, k, v, causal=causal)
    grads = fc.backward(q, k, v, o, lse, do, causal=causal)
    testing.assert_attention_right(q, k, v, do, causal=causal, grads=grads, floor=1e-5)
    assert all(not torch.isnan(x).any() for x in grads)


@pytest.mark.parametrize("dtype", HALF, ids=ids)
def test_cuda_backward_is_bit_for_bit_deterministic(dtype):
    """No atomics anywhere: two backward passes at N ~ 1000, d = 128, GQA give identical bits."""
    q, k, v = make(2, 8, 2, 1031, 997, 128, dtype, seed=22)
    do = torch.randn_like(q)
    o, lse = fc.forward(q, k, v, causal=True)
    first = fc.backward(q, k, v, o, lse, do, causal=True)
    second = fc.backward(q, k, v, o, lse, do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_cuda_backward_on_misaligned_tensors():
    """q, k, v, do one element past a 16-byte boundary: the element-wise copies, not cp.async."""
    q, k, v, do = (torch.randn(torch.Size(s).numel() + 1, device=DEVICE, dtype=torch.float16)[1:].view(s)
                   for s in ((1, 2, 45, 64), (1, 1, 70, 64), (1, 1, 70, 64), (1, 2, 45, 64)))
    assert q.data_ptr() % 16 != 0
    o, lse = fc.forward(q, k, v, causal=True)
    grads = fc.backward(q, k, v, o, lse, do, causal=True)
    testing.assert_attention_right(q, k, v, do, causal=True, grads=grads, floor=1e-5)


def test_backend_cuda_gradients_come_from_the_cuda_backward(monkeypatch):
    """flashlib.attention(backend="cuda") on the GPU calls the CUDA backward at fp16, d <= 128."""
    calls = []
    real = fc.backward
    monkeypatch.setattr(fc, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = make(1, 4, 2, 300, 257, 64, torch.float16, seed=23, requires_grad=True)
    o = flashlib.attention(q, k, v, causal=True, backend="cuda")
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    assert calls == [1]
    testing.assert_attention_right(q, k, v, do, causal=True, grads=grads, floor=1e-5)


def test_cuda_backward_with_100000_sequences():
    """The dK/dV and dQ grids are flat like the forward's: B = 100,000 launches."""
    q, k, v = make(100_000, 1, 1, 16, 16, 64, torch.float16, seed=24)
    do = torch.randn_like(q)
    o, lse = fc.forward(q, k, v, causal=True)
    dq, dk, dv = fc.backward(q, k, v, o, lse, do, causal=True)
    torch.cuda.synchronize()
    idx = torch.tensor(SAMPLE, device=DEVICE)
    testing.assert_attention_right(q[idx], k[idx], v[idx], do[idx], causal=True,
                                   grads=(dq[idx], dk[idx], dv[idx]), floor=1e-5)


# ---- CUDA-graph capture: the backend runs on torch's stream (flashlib.kernels.cuda.launch.run_gpu) ----
# _capture: warm up on a side stream, then capture (written once, in test_graphs_gpu.py).
from test_graphs_gpu import _capture  # noqa: E402


def _refill(*tensors, seed):
    for i, t in enumerate(tensors):
        g = torch.Generator(device=DEVICE).manual_seed(seed + i)
        t.copy_(torch.randn(t.shape, generator=g, device=DEVICE, dtype=torch.float32).to(t.dtype))


@pytest.mark.parametrize("dtype", ALL, ids=ids)
def test_cuda_backend_forward_is_captured_in_a_cuda_graph_and_replays_on_new_inputs(dtype):
    """Before the conversion to CuPy moved inside torch's stream, DLPack synchronised with the legacy
    stream on every call, which capture forbids (tests/kernels/cuda/test_cuda_launch.py checks the order
    on a CPU)."""
    q, k, v = make(2, 4, 2, 300, 517, 64, dtype, seed=31)

    def step():
        with torch.no_grad():
            return flashlib.attention(q, k, v, causal=True, return_lse=True, backend="cuda")

    graph, (o, lse) = _capture(step)
    _refill(q, k, v, seed=32)
    graph.replay()
    want_o, want_lse = step()                           # eager, the same kernels on the new inputs
    torch.testing.assert_close(o, want_o, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    if dtype == torch.float32:
        testing.assert_close(o, testing.reference_gqa(q, k, v, causal=True)[0], atol=2e-5, rtol=1e-5, name="o")
    else:
        check_fa_rule(q, k, v, True, o, lse)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", ALL, ids=ids)
def test_cuda_backend_decode_is_captured_in_a_cuda_graph_and_replays_on_new_inputs(dtype, num_splits):
    q, kc, vc = make(3, 8, 2, 1, 1037, 128, dtype, seed=35)
    lens = torch.tensor([1037, 0, 513], dtype=torch.int32, device=DEVICE)
    graph, (o, lse) = _capture(lambda: flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits,
                                                       return_lse=True, backend="cuda"))
    _refill(q, kc, vc, seed=36)
    lens.copy_(torch.tensor([5, 1037, 0], dtype=torch.int32))
    graph.replay()
    want = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                           backend="cuda")
    torch.testing.assert_close(o, want[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, want[1], rtol=0, atol=0)
    assert bool((o[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())       # length 0 after replay
    ro, _ = testing.reference_gqa(q[1:2], kc[1:2], vc[1:2])
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    testing.assert_close(o[1:2].double(), ro, atol=tol, rtol=0, name="o[1] after replay")


# ---- what this GPU cannot run: those tests are removed (not skipped), and the refusal is tested ------
if not V3_OK:
    del (test_v3_forward_follows_the_flashattention_rule, test_v3_on_misaligned_tensors,
         test_cuda_backward_follows_the_flashattention_rule, test_cuda_backward_is_bit_for_bit_deterministic,
         test_cuda_backward_on_misaligned_tensors, test_backend_cuda_gradients_come_from_the_cuda_backward,
         test_cuda_backward_with_100000_sequences)

    def test_v3_and_the_cuda_backward_are_refused_below_sm75_with_the_documented_error():
        cc = f"sm_{CAPABILITY[0]}{CAPABILITY[1]}"
        q, k, v = make(1, 2, 1, 33, 40, 64, torch.float16, seed=41)
        with pytest.raises(TypeError, match=f"CUDA kernel v3 needs sm_75 or newer; this GPU is {cc}"):
            fc.forward(q, k, v, version="v3")
        assert "built on kernel v3" in fc.backward_supported(q)
        o, lse = fc.forward(q, k, v, causal=True)       # version=None takes v2 here
        with pytest.raises(TypeError, match="q: the CUDA backward is built on kernel v3"):
            fc.backward(q, k, v, o, lse, torch.randn_like(q), causal=True)

if REFUSED_HALF:
    @pytest.mark.parametrize("dtype", REFUSED_HALF, ids=ids)
    def test_16_bit_dtypes_this_gpu_lacks_are_refused_with_the_documented_error(dtype):
        """bfloat16 below sm_80 (kernel_dtypes leaves it out): a TypeError naming sm_80, never a wrong
        result or a compiler crash."""
        q, k, v = make(1, 2, 1, 33, 40, 64, dtype, seed=42)
        with pytest.raises(TypeError, match="bfloat16 needs sm_80 or newer"):
            flashlib.attention(q, k, v, causal=True, backend="cuda")
        assert fc.backward_supported(q) is not None
