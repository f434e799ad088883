"""The PTX wrappers (flashlib/kernels/cuda/csrc/ptx.h) in the CPU emulator, against the PTX ISA's
per-lane fragment tables, and the planted bugs the emulator must catch in a cp.async → ldmatrix →
mma.sync tile (tests/kernels/cuda/ptx_kernels.cu). nvcc compiles the same kernels to HMMA, LDSM and
(sm_80+) LDGSTS instructions.

The expected registers are computed here from the ISA's tables, written out again independently of
emulator.h (groupID g = lane >> 2, threadID_in_group t = lane & 3; low half = lower index), and a few
lanes are checked against values worked out by hand.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import ROOT, require_tool
import flashlib.kernels.cuda as fc
from flashlib.kernels.cuda import build, launch, toolkit
from flashlib.kernels.cuda.launch import EmulatorError, LaunchSpec
from flashlib.tools import toolchain

torch = pytest.importorskip("torch")

SRC = ROOT / "tests" / "kernels" / "cuda" / "ptx_kernels.cu"


@pytest.fixture(autouse=True)
def _gxx():
    require_tool("g++")


def run(kernel, block, args, buffers, outputs, *, smem=0, sanitizer=None, counters=None):
    spec = LaunchSpec(SRC.name, kernel, (1, 1, 1), (block, 1, 1), smem, tuple(args), "test")
    launch.run_emulated([spec], buffers, outputs, sanitizer=sanitizer, source=SRC, counters=counters)


def bits16(x, dtype):
    """The 16-bit patterns of ``x`` rounded to ``dtype`` (torch.float16 / torch.bfloat16), as int64."""
    return torch.as_tensor(np.asarray(x, np.float32)).to(dtype).view(torch.int16).numpy().astype(np.int64) & 0xFFFF


def pair(lo, hi):
    return (int(lo) & 0xFFFF) | ((int(hi) & 0xFFFF) << 16)


def u32(t):
    return t.numpy().view(np.uint32)


# ---- the ISA's fragment tables, written out for the tests ----------------------------------------
def mma_a_regs(A):
    """(32, 4) registers of A (16 x K bit patterns) for m16n8k16 (K = 16) or m16n8k8 (K = 8, 2 regs)."""
    regs = np.zeros((32, 4), np.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        starts = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)][: A.shape[1] // 4]
        for i, (r, c) in enumerate(starts):
            regs[lane, i] = pair(A[r, c], A[r, c + 1])
    return regs


def mma_b_regs(B):
    """(32, 2) registers of B (K x 8 bit patterns): b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]."""
    regs = np.zeros((32, 2), np.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(B.shape[0] // 8):
            regs[lane, i] = pair(B[2 * t + 8 * i, g], B[2 * t + 8 * i + 1, g])
    return regs


def mma_c_regs(C):
    """(32, 4) fp32 values of C (16 x 8): c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]."""
    out = np.zeros((32, 4), np.float32)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out[lane] = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
    return out


def mma_d_matrix(regs):
    """The 16 x 8 matrix D from each lane's d[0..3] (the C table read backwards)."""
    D = np.full((16, 8), np.nan, np.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1] = regs[lane]
    return D


def ldmatrix_regs(rows, perm, x, trans):
    """(32, 4) registers ldmatrix .x{x} returns when lane L passes shared row perm[L] of ``rows``."""
    regs = np.zeros((32, 4), np.int64)
    for i in range(x):
        M = rows[perm[8 * i: 8 * i + 8]]              # matrix i: the rows lanes 8i..8i+7 point at
        if trans:
            M = M.T
        for lane in range(32):
            regs[lane, i] = pair(M[lane // 4, 2 * (lane % 4)], M[lane // 4, 2 * (lane % 4) + 1])
    return regs


# ---- ldmatrix -------------------------------------------------------------------------------------
def run_ldmatrix(rows, perm, which, counters=None):
    out = torch.zeros(32 * 4, dtype=torch.int32)
    run("ptx_ldmatrix", 32, [("buf", "rows"), ("buf", "perm"), ("buf", "out"), ("i32", which)],
        {"rows": torch.as_tensor(rows.astype(np.int16)), "perm": torch.as_tensor(perm.astype(np.int32)),
         "out": out}, ["out"], smem=32 * 8 * 2, counters=counters)
    return u32(out).reshape(32, 4).astype(np.int64)


def test_ldmatrix_x4_by_hand():
    rows = np.arange(256).reshape(32, 8)               # shared row R holds 8R .. 8R+7
    got = run_ldmatrix(rows, np.arange(32), 4)
    # lane 13: g = 3, t = 1 -> row 3 of each matrix, elements 2 and 3
    assert list(got[13]) == [pair(26, 27), pair(90, 91), pair(154, 155), pair(218, 219)]
    assert list(got[0]) == [pair(0, 1), pair(64, 65), pair(128, 129), pair(192, 193)]
    assert list(got[31]) == [pair(62, 63), pair(126, 127), pair(190, 191), pair(254, 255)]


def test_ldmatrix_trans_by_hand():
    rows = np.arange(256).reshape(32, 8)
    got = run_ldmatrix(rows, np.arange(32), 14)
    # .trans, lane 13: column 3 of each matrix, rows 2 and 3: 8*2+3 = 19 and 8*3+3 = 27 in matrix 0
    assert list(got[13]) == [pair(19, 27), pair(83, 91), pair(147, 155), pair(211, 219)]
    assert list(got[4]) == [pair(1, 9), pair(65, 73), pair(129, 137), pair(193, 201)]


@pytest.mark.parametrize("which", [1, 2, 4, 12, 14])
def test_ldmatrix_matches_the_isa_table(which):
    rng = np.random.default_rng(which)
    rows = rng.integers(0, 1 << 16, size=(32, 8))
    perm = rng.permutation(32)                         # lanes point at rows in a scrambled order
    x, trans = which % 10, which > 10
    got = run_ldmatrix(rows, perm, which)
    assert np.array_equal(got, ldmatrix_regs(rows, perm, x, trans))
    assert not got[:, x:].any()                        # registers the variant does not have stay 0


# The shared tile is 32 rows of 16 bytes: row R is words 4R..4R+3, banks 4(R mod 8)..4(R mod 8)+3. Lane L
# points at row perm[L]; lanes 8i..8i+7 give matrix i's rows. Wavefronts per matrix, worked out by hand:
BANK_CASES = {
    "rows 8i..8i+7: 32 banks once": (np.arange(32), 1),
    "rows i, i+8, i+16, i+24 twice: 4 rows in the same 4 banks": (np.array([(L % 4) * 8 + L // 8 for L in range(32)]), 4),
    "every lane the same row: one row, a broadcast": (np.zeros(32, int), 1),
    "rows 2j + 16(i mod 2) (j = 0..7): 2-way": (np.array([2 * (L % 8) + 16 * ((L // 8) % 2) for L in range(32)]), 2),
}


@pytest.mark.parametrize("case", BANK_CASES)
def test_ldmatrix_bank_conflicts_are_counted_as_worked_out_by_hand(case):
    perm, waves = BANK_CASES[case]
    counters = {}
    run_ldmatrix(np.arange(256).reshape(32, 8), perm, 4, counters)
    (what, site), = counters
    assert what == "ldmatrix.x4" and site.endswith("ptx_kernels.cu:22"), counters
    assert counters[(what, site)] == {"requests": 4, "wavefronts": 4 * waves}


# ---- mma.sync -------------------------------------------------------------------------------------
KINDS = {"m16n8k16-f16": (0, 16, torch.float16), "m16n8k16-bf16": (1, 16, torch.bfloat16),
         "m16n8k8-f16": (2, 8, torch.float16)}


def run_mma(kind, A, B, C):
    code, k, dtype = KINDS[kind]
    a = np.zeros((32, 4), np.int64)
    a[:, : k // 4] = mma_a_regs(bits16(A, dtype))[:, : k // 4]
    b = np.zeros((32, 2), np.int64)
    b[:, : k // 8] = mma_b_regs(bits16(B, dtype))[:, : k // 8]
    d = torch.zeros(32 * 4)
    run("ptx_mma", 32, [("buf", "a"), ("buf", "b"), ("buf", "c"), ("buf", "d"), ("i32", code)],
        {"a": torch.as_tensor(a.astype(np.uint32).view(np.int32).ravel()),
         "b": torch.as_tensor(b.astype(np.uint32).view(np.int32).ravel()),
         "c": torch.as_tensor(mma_c_regs(C).ravel()), "d": d}, ["d"])
    return d.numpy().reshape(32, 4)


def test_mma_by_hand():
    A = np.eye(16)                                     # D = I · B + C = B + C
    B = np.arange(128).reshape(16, 8)                  # B[k][n] = 8k + n
    C = np.full((16, 8), 0.5)
    d = run_mma("m16n8k16-f16", A, B, C)
    # lane 5: g = 1, t = 1 -> D[1][2], D[1][3], D[9][2], D[9][3]
    assert list(d[5]) == [10.5, 11.5, 74.5, 75.5]
    assert list(d[0]) == [0.5, 1.5, 64.5, 65.5]
    d8 = run_mma("m16n8k8-f16", A[:, :8], B[:8], 0 * C)   # K = 8: D's rows 8-15 are zero
    assert list(d8[5]) == [10.0, 11.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_mma_matches_numpy(kind):
    _, k, dtype = KINDS[kind]
    rng = np.random.default_rng(k)
    A, B, C = rng.integers(-8, 9, (16, k)), rng.integers(-8, 9, (k, 8)), rng.integers(-50, 50, (16, 8))
    D = mma_d_matrix(run_mma(kind, A, B, C))
    assert np.array_equal(D, A @ B + C)                # small integers: every step exact in fp32
    A, B, C = rng.standard_normal((16, k)), rng.standard_normal((k, 8)), rng.standard_normal((16, 8))
    D = mma_d_matrix(run_mma(kind, A, B, C))
    Ar = torch.as_tensor(A, dtype=torch.float32).to(dtype).double().numpy()    # the inputs as rounded
    Br = torch.as_tensor(B, dtype=torch.float32).to(dtype).double().numpy()
    np.testing.assert_allclose(D, Ar @ Br + C.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_pack_helpers():
    x = torch.tensor([1.0, -2.5, 1 / 3, 65504.0, 1e-8, 3.14159, -0.0, 7.0])
    out = torch.zeros(8, dtype=torch.int32)
    run("ptx_pack", 4, [("buf", "x"), ("buf", "out")], {"x": x, "out": out}, ["out"])
    got, xs = u32(out), x.numpy()
    for i in range(4):
        lo, hi = xs[2 * i], xs[2 * i + 1]
        assert got[2 * i] == pair(bits16(lo, torch.float16), bits16(hi, torch.float16))
        assert got[2 * i + 1] == pair(bits16(lo, torch.bfloat16), bits16(hi, torch.bfloat16))


# ---- cp.async -------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_bytes", [16, 6, 0])
def test_cp_async_zero_fill_and_stale_before_wait(src_bytes):
    src = torch.arange(1, 257, dtype=torch.int16)
    out, early = torch.zeros(256, dtype=torch.int16), torch.zeros(256, dtype=torch.int16)
    run("ptx_cp_async", 32, [("buf", "src"), ("buf", "out"), ("buf", "early"), ("i32", src_bytes), ("i32", 1)],
        {"src": src, "out": out, "early": early}, ["out", "early"], smem=512)
    want = src.reshape(32, 8).clone()
    want[:, src_bytes // 2:] = 0                       # the bytes past src_bytes are zero-filled
    assert torch.equal(out.reshape(32, 8), want)
    assert bool((early == -1).all())                   # before the wait: shared memory's 0xFF fill


@pytest.mark.parametrize("what, message", [
    (1, "not 16-byte aligned"), (2, "not in shared memory"), (3, "src_bytes = 17"),
    (4, "must both be 16-byte aligned"), (5, "is not in shared memory")])
def test_misuse_is_reported(what, message):
    g, gout = torch.zeros(256, dtype=torch.int16), torch.zeros(256, dtype=torch.int16)
    with pytest.raises(EmulatorError) as err:
        run("ptx_misuse", 32, [("buf", "g"), ("buf", "gout"), ("i32", what)], {"g": g, "gout": gout}, ["gout"],
            smem=1024)
    assert message in err.value.report


# ---- the tile: cp.async -> ldmatrix -> mma.sync, and the planted bugs -----------------------------
def run_tile(dtype, b_kn, planted_bug=0, sanitizer=None, seed=0):
    rng = np.random.default_rng(seed)
    A, B = rng.integers(-8, 9, (16, 16)), rng.integers(-8, 9, (16, 8))
    a = torch.as_tensor(bits16(A, dtype).astype(np.uint16).view(np.int16))
    b = torch.as_tensor(bits16(B if b_kn else B.T, dtype).astype(np.uint16).view(np.int16).copy())
    d = torch.zeros(16 * 8)
    run("ptx_tile_mma", 64, [("buf", "a"), ("buf", "b"), ("buf", "d"), ("i32", int(dtype == torch.bfloat16)),
                             ("i32", b_kn), ("i32", planted_bug)],
        {"a": a, "b": b, "d": d}, ["d"], smem=(256 + 128) * 2, sanitizer=sanitizer)
    return d.numpy().reshape(16, 8), A @ B


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_kn", [1, 0])
def test_tile_mma(dtype, b_kn):
    got, want = run_tile(dtype, b_kn)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_tile_mma_clean_under_sanitizers(sanitizer):
    got, want = run_tile(torch.float16, 1, sanitizer=sanitizer)
    assert np.array_equal(got, want)


def test_planted_wrong_fragment_index_gives_a_wrong_result():
    got, want = run_tile(torch.float16, 1, planted_bug=1)
    assert not np.isnan(got).any() and not np.array_equal(got, want)


def test_planted_missing_wait_is_reported():
    with pytest.raises(EmulatorError) as err:
        run_tile(torch.float16, 1, planted_bug=2)
    assert "cp.async copies" in err.value.report and "no cp.async.wait_group completed" in err.value.report


def test_planted_wait_for_too_few_groups_reads_stale_data():
    got, _ = run_tile(torch.float16, 1, planted_bug=3)  # B still in flight: its 0xFF fill (NaN) is read
    assert np.isnan(got).all()


def test_planted_missing_syncthreads_is_a_race():
    with pytest.raises(EmulatorError) as err:
        run_tile(torch.float16, 1, planted_bug=4, sanitizer="thread")
    assert "ThreadSanitizer: data race" in err.value.report


def test_planted_lane_exit_before_a_collective_is_reported():
    with pytest.raises(EmulatorError) as err:
        run_tile(torch.float16, 1, planted_bug=5)
    assert "all 32 lanes of the warp must execute" in err.value.report


# ---- nvcc: the same kernels become tensor-core, ldmatrix and async-copy instructions ----------------
@pytest.mark.parametrize("arch", fc.ARCHS)
def test_nvcc_emits_hmma_ldsm_ldgsts(arch):
    require_tool("nvcc")
    require_tool("cuobjdump")
    sass = toolchain.run_tool("cuobjdump", "-sass", build.nvcc_cubin(SRC, arch), purpose="reading the SASS")
    ops = set(re.findall(r"\b(HMMA(?:\.\w+)+|LDSM(?:\.\w+)+|LDGSTS)\b", sass))
    assert "HMMA.1688.F32" in ops and "LDSM.16.M88.4" in ops and "LDSM.16.MT88.2" in ops, ops
    if arch == "sm_75":                                # no m16n8k16 nor cp.async before sm_80
        assert not any(op.startswith(("HMMA.16816", "LDGSTS")) for op in ops), ops
    else:
        assert {"HMMA.16816.F32", "HMMA.16816.F32.BF16", "LDGSTS"} <= ops, ops


def test_ptx_h_travels_with_the_kernels_not_the_toolkit():
    # a kernel's `#include "ptx.h"` is found with -I csrc, so the CUDA toolkit is not asked for it
    assert "ptx.h" in [name for name, _ in toolkit.includes(SRC.read_text())]
    assert "ptx.h" not in toolkit.required_headers([SRC])
