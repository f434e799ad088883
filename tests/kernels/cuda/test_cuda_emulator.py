"""The CUDA emulator (flashlib/kernels/cuda/emulator.h) on its own: semantics, checked preconditions, and the
planted bugs it must catch — an out-of-bounds write under AddressSanitizer and a missing __syncthreads()
under ThreadSanitizer. Every launch runs in a child process; these tests assert on its report.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import require_tool
from flashlib.kernels.cuda import build, launch
from flashlib.kernels.cuda.launch import EmulatorError, LaunchSpec

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _gxx():
    require_tool("g++")                              # the CUDA emulator is built with g++ (C++20)


def run(text, kernel, grid, block, args, buffers, outputs, *, smem=0, sanitizer=None, name=None):
    spec = LaunchSpec("test", kernel, grid, block, smem, tuple(args), "test")
    return launch.run_emulated([spec], buffers, outputs, sanitizer=sanitizer,
                               source=(name or f"test_{kernel}", text))


# ---- planted bugs ---------------------------------------------------------------------------------
OOB = r"""
extern "C" __global__ void fill(float* out, int n, int planted_bug) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (planted_bug ? i <= n : i < n) out[i] = 1.0f;      // the bug: <= writes one element too many
}
"""


def test_asan_catches_out_of_bounds_write():
    out = torch.zeros(64)
    with pytest.raises(EmulatorError) as err:
        run(OOB, "fill", (1, 1, 1), (96, 1, 1), [("buf", "out"), ("i32", 64), ("i32", 1)], {"out": out},
            ["out"], sanitizer="address")
    assert "AddressSanitizer: heap-buffer-overflow" in err.value.report
    assert "WRITE of size 4" in err.value.report


def test_asan_clean_without_the_bug():
    out = torch.zeros(64)
    run(OOB, "fill", (1, 1, 1), (96, 1, 1), [("buf", "out"), ("i32", 64), ("i32", 0)], {"out": out}, ["out"],
        sanitizer="address")
    assert bool((out == 1).all())


RACE = r"""
extern "C" __global__ void rotate(const float* in, float* out, int planted_bug) {
    __shared__ float tile[64];
    const int t = threadIdx.x;
    tile[t] = in[t];                         // write the shared tile ...
    if (!planted_bug) __syncthreads();       // the bug: no barrier between the write and the read
    out[t] = tile[(t + 1) % 64];             // ... read a neighbour's element
}
"""


def test_tsan_catches_missing_syncthreads():
    x, out = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    with pytest.raises(EmulatorError) as err:
        run(RACE, "rotate", (1, 1, 1), (64, 1, 1), [("buf", "x"), ("buf", "out"), ("i32", 1)],
            {"x": x, "out": out}, ["out"], sanitizer="thread")
    assert "ThreadSanitizer: data race" in err.value.report
    assert "rotate" in err.value.report


def test_tsan_clean_with_syncthreads():
    x, out = torch.arange(64, dtype=torch.float32), torch.zeros(64)
    run(RACE, "rotate", (1, 1, 1), (64, 1, 1), [("buf", "x"), ("buf", "out"), ("i32", 0)],
        {"x": x, "out": out}, ["out"], sanitizer="thread")
    assert torch.equal(out, torch.roll(x, -1))


# ---- execution model ------------------------------------------------------------------------------
INDEX = r"""
extern "C" __global__ void ids(int* out) {
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    out[bid * nt + tid] = bid * 1000 + tid;
}
"""


def test_thread_and_block_indices_cover_the_grid():
    out = torch.zeros(2 * 3 * 2 * 4 * 2 * 2, dtype=torch.int32)
    run(INDEX, "ids", (2, 3, 2), (4, 2, 2), [("buf", "out")], {"out": out}, ["out"])
    nt = 16
    expect = torch.tensor([b * 1000 + t for b in range(12) for t in range(nt)], dtype=torch.int32)
    assert torch.equal(out, expect)


SHUFFLE = r"""
extern "C" __global__ void warp_ops(const float* in, float* out) {
    const int t = threadIdx.x, lane = t % 32;
    float x = in[t], s = x, d = x;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);   // butterfly: all lanes
    for (int off = 16; off > 0; off >>= 1) d += __shfl_down_sync(0xffffffffu, d, off);  // tree: lane 0
    const float b = __shfl_sync(0xffffffffu, x, 5);                                   // broadcast lane 5
    const float u = __shfl_up_sync(0xffffffffu, x, 1);                                // lane - 1 (lane 0 keeps)
    out[4 * t + 0] = s; out[4 * t + 1] = lane == 0 ? d : 0.0f; out[4 * t + 2] = b; out[4 * t + 3] = u;
}
"""


def test_warp_shuffles():
    x = torch.arange(64, dtype=torch.float32) ** 1.5
    out = torch.zeros(64 * 4)
    run(SHUFFLE, "warp_ops", (1, 1, 1), (64, 1, 1), [("buf", "x"), ("buf", "out")], {"x": x, "out": out}, ["out"])
    out = out.view(64, 4)
    for w in range(2):
        seg = x[32 * w:32 * w + 32]
        assert torch.allclose(out[32 * w:32 * w + 32, 0], seg.sum().expand(32), rtol=1e-5)
        assert torch.allclose(out[32 * w, 1], seg.sum(), rtol=1e-5)
        assert torch.equal(out[32 * w:32 * w + 32, 2], seg[5].expand(32))
        assert torch.equal(out[32 * w:32 * w + 32, 3], torch.cat([seg[:1], seg[:-1]]))


DYN = r"""
extern "C" __global__ void dyn(float* out, int write_first) {
    extern __shared__ __align__(16) float buf[];
    const int t = threadIdx.x;
    if (write_first) buf[t] = float(t);
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = buf[(t + 3) % blockDim.x];
}
"""


def test_dynamic_shared_memory_and_uninitialised_reads_are_nan():
    out = torch.zeros(2 * 32)
    run(DYN, "dyn", (2, 1, 1), (32, 1, 1), [("buf", "out"), ("i32", 1)], {"out": out}, ["out"], smem=32 * 4)
    assert torch.equal(out.view(2, 32), ((torch.arange(32) + 3) % 32).float().expand(2, 32))
    run(DYN, "dyn", (2, 1, 1), (32, 1, 1), [("buf", "out"), ("i32", 0)], {"out": out}, ["out"], smem=32 * 4)
    assert bool(torch.isnan(out).all()), "shared memory nobody wrote must read as NaN, not 0"


def test_dynamic_shared_memory_overrun_caught_by_asan():
    out = torch.zeros(32)
    with pytest.raises(EmulatorError) as err:   # 31 floats of dynamic smem, 32 threads write one each
        run(DYN, "dyn", (1, 1, 1), (32, 1, 1), [("buf", "out"), ("i32", 1)], {"out": out}, ["out"], smem=31 * 4,
            sanitizer="address")
    assert "heap-buffer-overflow" in err.value.report


DIVERGE = r"""
extern "C" __global__ void diverge(float* out) {
    if (threadIdx.x < 16) {
        __syncthreads();                     // half the block waits here ...
    } else {
        __syncthreads();                     // ... the other half at a different barrier
    }
    out[threadIdx.x] = 1.0f;
}
"""


def test_divergent_syncthreads_is_reported():
    with pytest.raises(EmulatorError, match="divergent block"):
        run(DIVERGE, "diverge", (1, 1, 1), (32, 1, 1), [("buf", "out")], {"out": torch.zeros(32)}, ["out"])


HANG = r"""
extern "C" __global__ void hang(const int* flag, int* out) {
    if (threadIdx.x == 0) { volatile const int* f = flag; while (*f == 0) { } }   // nobody ever sets it
    out[threadIdx.x] = 1;
}
"""


def test_deadlock_is_reported_not_hung(monkeypatch):
    monkeypatch.setenv("FLASHLIB_EMU_TIMEOUT", "1")
    with pytest.raises(EmulatorError, match="deadlock"):
        run(HANG, "hang", (1, 1, 1), (4, 1, 1), [("buf", "flag"), ("buf", "out")],
            {"flag": torch.zeros(1, dtype=torch.int32), "out": torch.zeros(4, dtype=torch.int32)}, ["out"])


def test_argument_kinds_are_checked():
    with pytest.raises(EmulatorError, match="argument 1 of fill"):
        run(OOB, "fill", (1, 1, 1), (4, 1, 1), [("buf", "out"), ("f32", 4.0), ("i32", 0)],
            {"out": torch.zeros(4)}, ["out"])


# ---- 16-bit types ---------------------------------------------------------------------------------
CONVERT = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void convert(const float* x, float* h, float* b, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        h[i] = __half2float(__float2half(x[i]));
        b[i] = __bfloat162float(__float2bfloat16(x[i]));
    }
}
"""


def test_half_and_bfloat16_round_like_torch():
    rng = np.random.default_rng(0)
    vals = np.concatenate([rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000),
                           [0.0, -0.0, 65504.0, 65520.0, 1e6, 5.96e-8, 2.98e-8, 1e-10, 1.0009765625,
                            1.00048828125, 1.00146484375, 3.0e38, np.inf, -np.inf]]).astype(np.float32)
    x = torch.from_numpy(vals)
    h, b = torch.zeros_like(x), torch.zeros_like(x)
    run(CONVERT, "convert", (1, 1, 1), (32, 1, 1), [("buf", "x"), ("buf", "h"), ("buf", "b"), ("i32", x.numel())],
        {"x": x, "h": h, "b": b}, ["h", "b"])
    assert torch.equal(h, x.half().float())
    assert torch.equal(b, x.bfloat16().float())


# ---- WMMA -----------------------------------------------------------------------------------------
WMMA = r"""
#include <cuda_fp16.h>
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void gemm16(const __half* a, const __half* b, float* c, int offset, int ldm, int lanes) {
    if (threadIdx.x >= lanes) return;                       // lanes < 32: a lane leaves early
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a + offset, ldm);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}
"""


def _gemm(offset=0, ldm=16, lanes=32):
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.standard_normal((16 * 24,))).half()
    b = torch.from_numpy(rng.standard_normal((16, 16))).half()      # column-major B = b.T row-major
    c = torch.zeros(16, 16)
    run(WMMA, "gemm16", (1, 1, 1), (32, 1, 1),
        [("buf", "a"), ("buf", "b"), ("buf", "c"), ("i32", offset), ("i32", ldm), ("i32", lanes)],
        {"a": a, "b": b, "c": c}, ["c"])
    a_tile = a[offset:offset + 16 * ldm].view(16, ldm)[:, :16].double()
    return c, a_tile @ b.double().T


def test_wmma_mma_sync_matches_a_float_matmul():
    c, expect = _gemm()
    assert torch.allclose(c.double(), expect, atol=1e-4)
    c, expect = _gemm(offset=0, ldm=24)               # ldm 24 halves = 48 bytes: allowed
    assert torch.allclose(c.double(), expect, atol=1e-4)


@pytest.mark.parametrize("kwargs, message", [
    ({"offset": 8}, "not 256-bit"),                 # 16 bytes off a 32-byte boundary
    ({"ldm": 20}, "not a multiple of 8"),           # ldm for half must be a multiple of 8
    ({"lanes": 31}, "all 32 lanes"),                # lane 31 returned before the collective
])
def test_wmma_preconditions_are_checked(kwargs, message):
    with pytest.raises(EmulatorError, match=message):
        _gemm(**kwargs)


def test_a_build_error_quotes_the_compiler():
    with pytest.raises(RuntimeError, match="g\\+\\+ could not build"):
        build.emulator_binary(("broken", 'extern "C" __global__ void k(float* x) { x[0] = y; }'))


def test_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match="needs `g\\+\\+`"):
        build.emulator_binary(("any", OOB))


def test_the_gpu_path_names_cupy_when_missing():
    import importlib.util
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(RuntimeError, match="CuPy"):
        launch._gpu_function("fa2_fwd_v1_scalar.cu", "fa2_fwd_v1_f32")
