"""Tests of flashlib/kernels/triton/fa2_bwd_v2.py (D preprocess, dK/dV and dQ kernels) on conftest's DEVICE.

Interpreted on a CPU machine, compiled on a GPU one (see test_triton_fa2_fwd_v1.py). Gradients are checked
against the float64 oracle (flashlib.testing): fp32 tightly, fp16/bf16 under FlashAttention's rule — at
most 3x the error of a plain same-dtype PyTorch implementation (assert_attention_right). The shapes are
the forward's adversarial ones; the causal mask, the ragged last key block and GQA's sum over a group
are what the dK/dV kernel must get right. Determinism is tested on a GPU (tests/gpu): the interpreter
runs one program at a time.
"""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, need_module
from triton_cases import FP32_CASES, HALF_CASES, case_id, make_qkv, run_triton

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlib.kernels.triton import fa2_bwd_v2, fa2_fwd_v1# noqa: E402
from flashlib.kernels.triton.configs import Config  # noqa: E402
from flashlib.testing import assert_attention_right, assert_close, reference_gqa  # noqa: E402


def assert_matches_oracle(q, k, v, do, causal, got, tol=2e-5):
    """o, lse and the three gradients within ``tol`` of the float64 oracle (fp32 inputs)."""
    o, lse, grads = got
    o_ref, lse_ref, grads_ref = reference_gqa(q, k, v, causal=causal, do=do)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads), (o_ref, lse_ref, *grads_ref)):
        assert_close(a, b, atol=tol, rtol=tol, name=name)


@pytest.mark.parametrize("case", FP32_CASES, ids=case_id)
def test_fp32_backward_matches_oracle(case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, device=DEVICE)
    assert_matches_oracle(q, k, v, do, causal, run_triton(q, k, v, do, causal))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", HALF_CASES, ids=case_id)
def test_half_precision_backward_within_flashattention_rule(dtype, case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=1, device=DEVICE)
    _, _, grads = run_triton(q, k, v, do, causal)
    assert_attention_right(q, k, v, do, causal=causal, grads=grads)


def test_rows_that_see_nothing_get_zero_gradients_not_nan():
    q, k, v, do = make_qkv(1, 2, 1, 40, 9, 32, seed=2, device=DEVICE)  # causal, Nq > Nk: rows 0..30 see nothing
    _, _, (dq, dk, dv) = run_triton(q, k, v, do, True)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.all(dq[:, :, :40 - 9] == 0)


def test_block_sizes_do_not_change_the_result():
    """Several key blocks per dK/dV program's query loop and query blocks per dQ program's key loop,
    with the diagonal, the ragged last blocks and the skipped causal blocks."""
    q, k, v, do = make_qkv(1, 2, 1, 41, 53, 48, seed=3, device=DEVICE)
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=True, scale=0.3, config=Config(16, 16))
    grads = [fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=True, scale=0.3, config_dkdv=Config(bm, bn),
                              config_dq=Config(bn, bm)) for bm, bn in ((16, 16), (32, 64), (16, 32))]
    want = reference_gqa(q, k, v, causal=True, scale=0.3, do=do)[2]
    for name, a, b in zip(("dq", "dk", "dv"), grads[0], want):
        assert_close(a, b, atol=2e-5, rtol=2e-5, name=name)
    for g in grads[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), g, grads[0]):
            assert_close(a, b, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("causal", [False, True])
def test_awkward_batch_heads_match_oracle(causal):
    """B·H = 15 (B = 3, H = 5, Hkv = 1) with several query and key blocks per head: each of the three
    kernels must decode its own (block, batch, head) — (key block, batch, kv head) for dK/dV — from its
    flat grid."""
    q, k, v, do = make_qkv(3, 5, 1, 45, 37, 24, seed=9, device=DEVICE)
    assert_matches_oracle(q, k, v, do, causal, run_triton(q, k, v, do, causal))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 72), causal=st.booleans(),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**16))
def test_property_forward_backward_match_oracle(nq, nk, d, causal, heads, seed):
    q, k, v, do = make_qkv(1, heads[0], heads[1], nq, nk, d, seed=seed, device=DEVICE)
    assert_matches_oracle(q, k, v, do, causal, run_triton(q, k, v, do, causal), tol=5e-5)
