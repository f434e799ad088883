"""The CUDA backward (flashlib/kernels/cuda/csrc/fa2_bwd_v1_mma.cu: delta, dK/dV and dQ kernels with
mma.sync, ldmatrix and cp.async) in the CPU emulator, against the float64 oracle: both paths (sm_80+ and
the sm_75 one, FA2V3_SM80 = 0), under ASan and TSan, with planted bugs the emulator must catch; the
launch geometry, the arguments it refuses, and how backend="cuda" uses it.

Tolerances: FlashAttention's rule for gradients — at most 3x the error of plain PyTorch in the same dtype
(flashlib.testing.assert_attention_right). Shapes as forward v3's tests: Nq, Nk not multiples of any
tile, Nq != Nk both ways (causal rows that see nothing), N = 1, d = 40 / 59 / 111 (padded to 64 / 128, 16-byte
or element copies), d = 32 and 128 (the other buckets, BQ = 16 at 128), GQA and MQA.
"""
from __future__ import annotations

import pytest
from conftest import need_module, require_tool

need_module("hypothesis")
from hypothesis import given, settings, strategies as st

import flashlib
import flashlib.kernels.cuda as fc
from flashlib import testing
from flashlib.kernels.cuda import build, launch
from flashlib.kernels.cuda.launch import EmulatorError

torch = pytest.importorskip("torch")

SRC_NAME = fc.SOURCES["bwd"]
SRC = (build.CSRC / SRC_NAME).read_text()
SM75 = ("fa2_bwd_v1_sm75_path", "#define FA2V3_SM80 0\n" + SRC)


@pytest.fixture(autouse=True)
def _gxx():
    require_tool("g++")


def make(b, h, hkv, nq, nk, d, dtype, causal, seed=0):
    """q, k, v, do and the forward's o, lse (forward v3, itself tested against the oracle)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*s, generator=g).to(dtype)
                   for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, h, nq, d)))
    o, lse = fc.forward(q, k, v, causal=causal)
    return q, k, v, do, o, lse


def run_bwd(q, k, v, do, o, lse, causal, *, source=None, sanitizer=None):
    """The three launches through launch.run_emulated, optionally from another source (a planted bug)."""
    b, h, nq, d = q.shape
    dt = "f16" if q.dtype == torch.float16 else "bf16"
    specs = launch.bwd_launch(b, h, k.shape[1], nq, k.shape[2], d, d ** -0.5, causal, dt)
    bufs = {"q": q, "k": k, "v": v, "o": o, "do": do, "lse": lse, "delta": torch.empty(b, h, nq),
            "dq": torch.empty_like(q), "dk": torch.empty_like(k), "dv": torch.empty_like(v)}
    launch.run_emulated(specs, bufs, ["dq", "dk", "dv"], source=source, sanitizer=sanitizer)
    return bufs["dq"], bufs["dk"], bufs["dv"]


def check(q, k, v, do, causal, grads):
    testing.assert_attention_right(q, k, v, do, causal=causal, grads=grads, floor=1e-6)
    assert all(not torch.isnan(x).any() for x in grads)


# (B, H, Hkv, Nq, Nk, d)
SHAPES = [
    (1, 2, 1, 37, 45, 40),       # MQA, Nq < Nk
    (1, 2, 2, 45, 17, 59),       # Nq > Nk: causal rows that see nothing; element copies
    (1, 4, 2, 33, 33, 111),      # GQA 4:2, padded to D = 128 (BQ = 16, BKV = 32: several tiles)
    (2, 1, 1, 1, 1, 16),         # N = 1, D = 32
    (1, 4, 2, 130, 70, 64),      # three query tiles, two key blocks, GQA
    (1, 1, 1, 17, 130, 128),     # Nq < Nk: three key blocks, one query tile
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backward_follows_the_flashattention_rule(shape, causal, dtype):
    q, k, v, do, o, lse = make(*shape, dtype, causal, seed=1)
    check(q, k, v, do, causal, fc.backward(q, k, v, o, lse, do, causal=causal))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[2], SHAPES[4]], ids=lambda s: "x".join(map(str, s)))
def test_the_sm75_path(shape, causal):
    """FA2V3_SM80 = 0: two mma.m16n8k8 per k16 step, plain 16-byte loads (fp16 only)."""
    q, k, v, do, o, lse = make(*shape, torch.float16, causal, seed=2)
    check(q, k, v, do, causal, run_bwd(q, k, v, do, o, lse, causal, source=SM75))


@settings(max_examples=8, deadline=None, derandomize=True)
@given(nq=st.integers(1, 80), nk=st.integers(1, 80), d=st.integers(1, 128), group=st.sampled_from([1, 2]),
       causal=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_backward_property(nq, nk, d, group, causal, bf16, seed):
    q, k, v, do, o, lse = make(1, 2 * group, 2, nq, nk, d, torch.bfloat16 if bf16 else torch.float16, causal, seed)
    check(q, k, v, do, causal, fc.backward(q, k, v, o, lse, do, causal=causal))


def test_rows_that_see_nothing_get_zero_dq_and_add_nothing():
    """Causal, Nq > Nk: the first Nq - Nk rows see no key (lse = -inf): dq there is exactly 0, and their
    dO (made huge) changes no dk or dv."""
    q, k, v, do, o, lse = make(1, 2, 1, 50, 20, 64, torch.float16, True, seed=5)
    dq, dk, dv = fc.backward(q, k, v, o, lse, do, causal=True)
    assert torch.isneginf(lse[:, :, :30]).all() and (dq[:, :, :30] == 0).all()
    loud = do.clone()
    loud[:, :, :30] = 1e4
    _, dk2, dv2 = fc.backward(q, k, v, o, lse, loud, causal=True)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


def test_two_calls_are_bit_identical():
    """No atomics: the dK/dV blocks sum the GQA group themselves and dQ is its own pass."""
    q, k, v, do, o, lse = make(1, 4, 1, 70, 70, 64, torch.bfloat16, True, seed=6)
    first, second = fc.backward(q, k, v, o, lse, do, causal=True), fc.backward(q, k, v, o, lse, do, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("sanitizer", ["address", "thread"])
@pytest.mark.parametrize("path", ["sm80", "sm75"])
def test_backward_is_clean_under_sanitizers(path, sanitizer):
    """Causal GQA with a key block no query tile reaches (Nk > Nq) and element copies (d = 59)."""
    src = SRC_NAME if path == "sm80" else SM75
    for shape in [(1, 2, 1, 20, 90, 40), (1, 1, 1, 30, 17, 59)]:
        q, k, v, do, o, lse = make(*shape, torch.float16, True, seed=3)
        check(q, k, v, do, True, run_bwd(q, k, v, do, o, lse, True, source=src, sanitizer=sanitizer))


# ---- planted bugs: each must fail on a CPU ---------------------------------------------------------
def planted(old, new, name):
    assert SRC.count(old) == 1, old
    return (name, SRC.replace(old, new))


def test_planted_missing_delta_gives_wrong_dk_and_dq():
    """dS = P ∘ dP, forgetting FlashAttention's rowsum(dO ∘ O) term: dV stays right, dK is wrong."""
    bug = planted("s[n][i] * (dp[n][i] - dlt_s[8 * n + 2 * t + (i & 1)]);",
                  "s[n][i] * dp[n][i];", "bwd_bug_no_delta")
    q, k, v, do, o, lse = make(1, 2, 1, 40, 50, 64, torch.float16, False, seed=7)
    dq, dk, dv = run_bwd(q, k, v, do, o, lse, False, source=bug)
    _, _, (rdq, rdk, rdv) = testing.reference_gqa(q, k, v, do=do)
    assert testing.max_error(dv.double(), rdv) < 1e-2 and testing.max_error(dk.double(), rdk) > 0.05


def test_planted_untransposed_operand_gives_a_wrong_result():
    """mma_xb reading its B tile without .trans (dO instead of dOᵀ's fragments): wrong dV and dK."""
    bug = planted("ptx::ldmatrix_x4_trans(b, at<T, D>(bs,", "ptx::ldmatrix_x4(b, at<T, D>(bs,", "bwd_bug_no_trans")
    q, k, v, do, o, lse = make(1, 1, 1, 40, 40, 32, torch.float16, False, seed=8)
    _, dk, dv = run_bwd(q, k, v, do, o, lse, False, source=bug)
    _, _, (_, rdk, rdv) = testing.reference_gqa(q, k, v, do=do)
    assert testing.max_error(dv.double(), rdv) > 0.05 and testing.max_error(dk.double(), rdk) > 0.05


def test_planted_missing_barrier_before_the_next_query_tile_is_a_race():
    """Without the barrier at the top of the query loop, a fast warp overwrites Q_i while another reads it."""
    bug = planted("            // every warp is done with the previous Q_i, dO_i\n"
                  "            __syncthreads();\n", "", "bwd_bug_race")
    q, k, v, do, o, lse = make(1, 1, 1, 130, 64, 64, torch.float16, False, seed=9)
    with pytest.raises(EmulatorError, match="ThreadSanitizer: data race"):
        run_bwd(q, k, v, do, o, lse, False, source=bug, sanitizer="thread")


def test_planted_wrong_fragment_index_gives_a_wrong_result():
    """Pᵀ's query column taken from the accumulator's row half (i >> 1) instead of its column parity
    (i & 1): every other query gets its neighbour's LSE."""
    bug = planted("col = 8 * n + 2 * t + (i & 1), query = q0 + col;", "col = 8 * n + 2 * t + (i >> 1), query = q0 + col;",
                  "bwd_bug_fragment_index")
    q, k, v, do, o, lse = make(1, 1, 1, 40, 40, 32, torch.float16, False, seed=10)
    _, dk, dv = run_bwd(q, k, v, do, o, lse, False, source=bug)
    _, _, (_, rdk, rdv) = testing.reference_gqa(q, k, v, do=do)
    assert testing.max_error(dv.double(), rdv) > 0.05 and testing.max_error(dk.double(), rdk) > 0.05


def test_cache_keys_follow_the_files_the_backward_includes():
    """The backward includes forward v3's file (which includes ptx.h): both are part of its build keys, so
    an edit to v3's building blocks rebuilds the backward's emulator and nvcc caches."""
    texts = build.local_includes(SRC)
    assert texts == [(build.CSRC / fc.SOURCES["v3"]).read_text(), (build.CSRC / "ptx.h").read_text()]
    assert build.local_includes('#include "ptx.h"\n#include <cuda_fp16.h>\n') == [texts[1]]


# ---- geometry, arguments, and the backend ----------------------------------------------------------
@pytest.mark.parametrize("d", [1, 32, 33, 64, 100, 128])
def test_tiles_fit_48kb_and_follow_the_kernel_constants(d):
    dim, bq, bkv, dkdv_smem, dq_smem = launch.bwd_tile(d)
    assert dim == min(x for x in launch.BWD_HEAD_DIMS if x >= d)
    assert (bq, bkv) == (build.cu_constant(SRC_NAME, f"BWD_BQ_D{dim}"), build.cu_constant(SRC_NAME, f"BWD_BKV_D{dim}"))
    assert max(dkdv_smem, dq_smem) <= launch.SMEM_BUDGET and bq % 16 == 0 and bkv % 16 == 0
    specs = launch.bwd_launch(2, 6, 3, 100, 130, d, 0.1, True, "bf16")
    assert [s.kernel for s in specs] == [f"fa2_bwd_v1_delta_bf16", f"fa2_bwd_v1_dkdv_bf16_d{dim}",
                                         f"fa2_bwd_v1_dq_bf16_d{dim}"]
    assert [s.grid[0] for s in specs] == [25 * 6 * 2, 3 * 3 * 2, 2 * 6 * 2]


def test_bad_arguments_are_refused_by_name():
    q, k, v, do, o, lse = make(1, 2, 1, 8, 8, 16, torch.float16, False)
    with pytest.raises(TypeError, match="q: the CUDA backward takes float16 and bfloat16, not float32"):
        fc.backward(q.float(), k.float(), v.float(), o.float(), lse, do.float())
    big = torch.zeros(1, 1, 4, 129, dtype=torch.float16)
    with pytest.raises(ValueError, match="q: the CUDA backward supports head dims up to 128, not 129"):
        fc.backward(big, big, big, big, torch.zeros(1, 1, 4), big)
    with pytest.raises(ValueError, match=r"lse must be float32 of shape \(1, 2, 8\)"):
        fc.backward(q, k, v, o, lse[:, :1], do)
    with pytest.raises(ValueError, match=r"do must match q: shape \(1, 2, 8, 16\)"):
        fc.backward(q, k, v, o, lse, do[..., :8])
    with pytest.raises(TypeError, match="o must be a torch.Tensor, got ndarray"):
        fc.backward(q, k, v, o.numpy(), lse, do)


def test_backend_cuda_takes_its_gradient_from_these_kernels(monkeypatch):
    """flashlib.attention(backend="cuda") at fp16 differentiates through fc.backward (counted); float32 and
    d > 128 keep the reference backward on a CPU."""
    calls = []
    real = fc.backward
    monkeypatch.setattr(fc, "backward", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    q, k, v, do, _, _ = make(1, 2, 1, 30, 40, 48, torch.float16, True, seed=11)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flashlib.attention(*leaves, causal=True, backend="cuda")
    grads = torch.autograd.grad(out, leaves, do)
    assert calls == [q.shape]
    check(q, k, v, do, True, grads)
    for x in (q.float(), torch.zeros(1, 1, 4, 136, dtype=torch.float16)):
        assert fc.backward_supported(x) is not None
        leaf = x.clone().requires_grad_()
        flashlib.attention(leaf, leaf, leaf, backend="cuda").sum().backward()
    assert len(calls) == 1


def test_compile_rows_of_the_backward(rows_bwd):
    """nvcc: every backward kernel on every architecture without spills, tensor cores used, ldmatrix
    used, cp.async from sm_80 only."""
    assert {r["kernel"] for r in rows_bwd if r["arch"] == "sm_80"} == {
        f"fa2_bwd_v1_{k}_{dt}{dim}" for k in ("dkdv", "dq") for dt in ("f16", "bf16") for dim in ("_d64", "_d128")
    } | {"fa2_bwd_v1_delta_f16", "fa2_bwd_v1_delta_bf16"}
    assert not any("bf16" in r["kernel"] for r in rows_bwd if r["arch"] == "sm_75")
    for r in rows_bwd:
        assert r["spill_bytes"] == 0 and r["registers"] * 32 * launch.BWD_WARPS <= 65536, r   # one block fits
        assert r["shared_bytes"] <= launch.SMEM_BUDGET, r
        if r["kernel"].startswith(("fa2_bwd_v1_dkdv", "fa2_bwd_v1_dq")):
            assert r["mma_instructions"] > 0 and r["ldsm_instructions"] > 0, r
            assert (r["ldgsts_instructions"] > 0) == (r["arch"] != "sm_75"), r


@pytest.fixture(scope="module")
def rows_bwd():
    require_tool("nvcc")
    require_tool("cuobjdump")
    rows = [r for r in fc.compile_rows() if r["kernel"].startswith("fa2_bwd_v1")]
    assert {r["arch"] for r in rows} == set(fc.ARCHS) and all(r["ok"] for r in rows)
    return rows
