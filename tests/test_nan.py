"""NaN follows one rule on every backend (issue 23): SDPA's, for the forward's ``o`` and ``lse``.

* a NaN in ``q[i]`` makes row i's o and lse NaN;
* a NaN in ``k[j]`` at a key j that row i sees makes row i's o and lse NaN;
* a NaN in ``v[j]`` at a key j that row i sees makes row i's o NaN (lse depends on q and k only);
* a NaN at a key row i does not see — hidden by the causal mask, past ``cache_seqlens`` in decode, or in
  memory past the end of a view (a partial tile's padding) — changes nothing in row i;
* a row that sees no key outputs 0 with lse = -inf, NaN or not.

Each call puts several NaN placements in different batch entries at once (batches are independent), so
a NaN that leaks from one row, head or sequence into another is caught as well. The expected pattern is
computed from the rule itself (nan_cases.rule_rows); the values of the rows the rule leaves finite are
checked against the float64 oracle (flashlib.testing, which follows the same rule). The cases and the
checker live in tests/nan_cases.py, shared with the GPU tier. "Row i's o is NaN"
means: some element of it is NaN (a backend may make the whole row NaN, or only the columns that hold
the NaN). Backends: "reference", "triton" (Triton's interpreter on a CPU), its TMA forward, "cuda"
(the emulator; v1 for float32, v3 for 16-bit) and its v2 kernel, flashlib.decode on all three, and
flashlib.auto's routes; SDPA's own answer where SDPA agrees with the rule (it spreads a NaN of v that
the causal mask hides: 0 * NaN in its P @ V). The gradients of a NaN row are not specified.
tests/gpu/test_nan_gpu.py runs the same cases on CUDA tensors.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import require_module, require_tool
from nan_cases import (LENGTHS, assert_rule, attention_case, decode_case, decode_oracle, rule_rows,
                       seen_keys)

import flashlib
from flashlib.testing import reference, reference_gqa

NAN = float("nan")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# No warning filter here: pyproject turns RuntimeWarnings into errors, and a NaN input must not raise
# one out of any backend (Triton's interpreter computes in NumPy, which warns on NaN rows: flashlib's
# launcher silences those, flashlib.kernels.triton.spec).

# (Nq, Nk): equal; Nq < Nk; Nq > Nk (causal: rows that see no key); and one long enough that CUDA v3's
# warps meet both whole and cut key tiles (BR = 64 rows, 64 keys a tile at d = 16).
SHAPES = [(24, 24), (12, 40), (40, 12), (70, 90)]


def oracle(q, k, v, causal):
    return reference_gqa(q, k, v, causal=causal)


def need(backend):
    """What ``backend`` (or one of its kernels) needs on a CPU: triton (the interpreter), g++ (the CUDA
    emulator); a skip, or a failure under FLASHLIB_REQUIRE_ALL, where it is missing."""
    if backend.startswith("triton"):
        require_module("triton")
    elif backend.startswith("cuda"):
        require_tool("g++")


def run_attention(backend, q, k, v, causal):
    """``(o, lse)`` of one backend (or one of its kernels by name) on CPU tensors."""
    need(backend)
    if backend == "triton-tma":
        from flashlib.kernels.triton import fa2_fwd_v4_tma
        return fa2_fwd_v4_tma.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5,
                                   config=_small_blocks())
    if backend == "cuda-v2":
        from flashlib.kernels import cuda
        return cuda.forward(q, k, v, causal=causal, version="v2")
    blocks = dict(block_q=16, block_k=16) if backend in ("triton", "reference") else {}
    return flashlib.attention(q, k, v, causal=causal, return_lse=True, backend=backend, **blocks)


def _small_blocks():
    from flashlib.kernels.triton.configs import Config
    return Config(16, 16, num_warps=4, num_stages=1)


BACKENDS = ["reference", "triton", "cuda"]
# The three backends in every dtype on the short shapes (Triton's 16 x 16 blocks already meet FULL and
# MASKED stages there), the long one where it matters (CUDA v3's warps) and is cheap (not the
# interpreter); the TMA forward and CUDA v2 (16-bit kernels that flashlib.attention picks only on some
# GPUs) in fp16/bf16 on the short shapes.
ATTENTION_CASES = [(b, dt, shape) for b in BACKENDS for dt in DTYPES for shape in SHAPES
                   if shape != SHAPES[-1] or b != "triton"] + [
    (b, dt, shape) for b in ("triton-tma", "cuda-v2") for dt in DTYPES[1:] for shape in SHAPES[:3]]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("backend, dtype, shape", ATTENTION_CASES, ids=str)
def test_attention_follows_the_nan_rule(backend, dtype, shape, causal):
    nq, nk = shape
    q, k, v = attention_case(nq, nk, causal, dtype)
    o, lse = run_attention(backend, q, k, v, causal)
    o_ref, lse_ref = oracle(q, k, v, causal)
    assert_rule(o, lse, q, k, v, seen_keys(nq, nk, causal, batch=q.shape[0]), o_ref, lse_ref,
                f"{backend} {dtype} Nq={nq} Nk={nk} causal={causal}")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sdpa_agrees_where_it_follows_the_rule(dtype, causal):
    """SDPA's own answer has the rule's NaN rows, except where a NaN of v is hidden by the causal mask
    (batch entries 2-4 of a causal case): SDPA spreads it to every row, flashlib does not."""
    nq = nk = 24                                          # SDPA's is_causal is top-left: Nq = Nk only
    q, k, v = attention_case(nq, nk, causal, dtype)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    o_nan, _, _ = rule_rows(q, k, v, seen_keys(nq, nk, causal, batch=5))
    keep = [0, 1] if causal else [0, 1, 2, 3, 4]
    assert (torch.isnan(o).any(-1).numpy()[keep] == o_nan[keep]).all()
    if causal:                                            # the documented difference, still there
        assert torch.isnan(o[2]).any(-1).all()


def test_the_oracle_follows_the_rule():
    """flashlib.testing.reference: a NaN in v behind the causal mask stays there; one a row sees
    reaches that row's element (column) only; q and k NaN make the row's o and lse NaN."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((6, 8)), rng.standard_normal((6, 8))
    v[3, 2] = np.nan                                      # Nk - Nq = 2: rows 1.. see key 3
    o, lse = reference(q, k, v, causal=True)
    assert np.isnan(o).tolist() == [[c == 2 and i >= 1 for c in range(8)] for i in range(4)]
    assert np.isfinite(lse).all()
    k[4, 0] = np.nan                                      # rows 2.. see key 4
    q[0, 5] = np.nan
    o, lse = reference(q, k, v, causal=True)
    assert np.isnan(lse).tolist() == [True, False, True, True]
    assert np.isnan(o).any(-1).tolist() == [True, True, True, True]


# ---- decode: sequences of LENGTHS (nan_cases.decode_case) -------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("nq", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_follows_the_nan_rule(backend, dtype, nq, num_splits):
    need(backend)
    q, k, v = decode_case(dtype, nq)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    o, lse = flashlib.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend=backend)
    o_ref, lse_ref = decode_oracle(q, k, v, LENGTHS)
    assert_rule(o, lse, q, k, v, seen_keys(nq, k.shape[2], False, LENGTHS, batch=4), o_ref, lse_ref,
                f"decode {backend} {dtype} Nq={nq} splits={num_splits}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_without_lengths_sees_a_nan_in_its_last_key(backend):
    """cache_seqlens=None: every key is valid, so a NaN in the last key's k (kv head 1) makes query
    heads 2 and 3 NaN, in every split count."""
    need(backend)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 33, 16, generator=g), \
        torch.randn(1, 2, 33, 16, generator=g)
    k[0, 1, 32, 0] = NAN
    for splits in (1, 4):
        o, lse = flashlib.decode(q, k, v, num_splits=splits, return_lse=True, backend=backend)
        assert torch.isnan(lse[0, :, 0]).tolist() == [False, False, True, True], (splits, lse)
        assert torch.isnan(o[0, :, 0]).any(-1).tolist() == [False, False, True, True]


# ---- flashlib.auto: SDPA calls routed to each backend ---------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_routes_follow_the_nan_rule(backend, monkeypatch):
    """flashlib.auto on CPU tensors, its CPU choice set to each backend: an attention-shaped call
    (Nq = Nk, causal and not) and a decode-shaped one (one query, 40 keys) follow the rule."""
    need(backend)
    import flashlib.auto
    from flashlib import backends
    monkeypatch.setitem(backends.AUTO, "cpu", backend)
    for causal in (True, False):
        q, k, v = attention_case(24, 24, causal, torch.float32)
        before = dict(flashlib.auto.stats)
        with flashlib.auto.enabled():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert flashlib.auto.stats["routed"] == before["routed"] + 1
        o_nan, _, _ = rule_rows(q, k, v, seen_keys(24, 24, causal, batch=5))
        assert (torch.isnan(o).any(-1).numpy() == o_nan).all(), (backend, causal)
        o_ref, _ = oracle(q, k, v, causal)
        np.testing.assert_allclose(o.double().numpy()[~o_nan], o_ref[~o_nan], atol=2e-5, rtol=2e-5)
    q, k, v = decode_case(torch.float32, 1)
    with flashlib.auto.enabled():
        before = dict(flashlib.auto.stats)
        o = F.scaled_dot_product_attention(q[:2], k[:2], v[:2], enable_gqa=True)
    assert flashlib.auto.stats["decode"] == before["decode"] + 1
    o_nan, _, _ = rule_rows(q[:2], k[:2], v[:2], seen_keys(1, 40, False, batch=2))
    assert (torch.isnan(o).any(-1).numpy() == o_nan).all(), backend
