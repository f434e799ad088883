"""Tests of flashlib/kernels/triton/fa2_fwd_v1.py (the FA2 forward kernel) on conftest's DEVICE.

On a CPU machine the kernel runs in Triton's interpreter on CPU tensors; on a GPU machine the same tests
run the compiled kernel on CUDA tensors (flashlib.kernels.triton fixes the mode; conftest.DEVICE follows it).
Outputs are checked against the float64 oracle (flashlib.testing): fp32 tightly (true fp32 on a GPU too:
input_precision="ieee"), fp16/bf16 under FlashAttention's rule (assert_attention_right). Shapes are small
(the interpreter is slow) but adversarial: lengths that are multiples of no block (interpreter blocks:
32 x 16), Nq != Nk both ways, odd head dims up to 256, GQA/MQA, causal rows that see nothing, and
batch·head counts that are multiples of nothing (the flat grid).
"""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from triton_cases import FP32_CASES, HALF_CASES, case_id, make_qkv

import flashlib
import flashlib.kernels.triton as ft
from flashlib.kernels.triton import fa2_fwd_v1
from flashlib.kernels.triton.configs import Config
from flashlib.testing import assert_attention_right, assert_close, reference_gqa

def forward(q, k, v, causal, **kw):
    return flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="triton", **kw)


def assert_forward_matches_oracle(q, k, v, causal):
    """fp32 o and lse within 2e-5 of the float64 oracle."""
    o, lse = forward(q, k, v, causal)
    o_ref, lse_ref = reference_gqa(q, k, v, causal=causal)
    assert_close(o, o_ref, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, name="lse")


def test_interpreter_mode_on_this_machine():
    assert ft.INTERPRET == (not torch.cuda.is_available())
    assert torch.device(DEVICE).type == ("cpu" if ft.INTERPRET else "cuda")


@pytest.mark.parametrize("case", FP32_CASES, ids=case_id)
def test_fp32_forward_matches_oracle(case):
    *shape, causal = case
    q, k, v, _ = make_qkv(*shape, device=DEVICE)
    assert_forward_matches_oracle(q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", HALF_CASES, ids=case_id)
def test_half_precision_forward_within_flashattention_rule(dtype, case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=1, device=DEVICE)
    o, lse = forward(q, k, v, causal)
    assert_attention_right(q, k, v, do, causal=causal, o=o, lse=lse)


def test_rows_that_see_nothing_are_zero_with_lse_minus_inf():
    q, k, v, _ = make_qkv(1, 2, 1, 40, 9, 32, seed=2, device=DEVICE)  # causal, Nq > Nk: rows 0..30 see nothing
    o, lse = forward(q, k, v, True)
    hidden = 40 - 9
    assert torch.all(o[:, :, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(lse[:, :, hidden:]).all()


def test_block_sizes_do_not_change_the_result():
    """Several query and key blocks, both loop stages (FULL, MASKED) and the skipped causal blocks."""
    q, k, v, _ = make_qkv(1, 2, 1, 41, 53, 48, seed=3, device=DEVICE)
    outs = [fa2_fwd_v1.forward(q, k, v, causal=True, scale=0.3, config=Config(bm, bn))
            for bm, bn in ((16, 16), (32, 64), (64, 16))]
    o0, l0 = outs[0]
    assert_close(o0, reference_gqa(q, k, v, causal=True, scale=0.3)[0], atol=2e-5, rtol=2e-5, name="o")
    for o, lse in outs[1:]:
        assert_close(o, o0, atol=1e-5, rtol=1e-5, name="o")
        assert_close(lse, l0, atol=1e-5, rtol=1e-5, name="lse")


def test_strided_inputs_are_read_in_place():
    """(B, N, H, d) memory viewed as (B, H, N, d): the kernel takes strides, no layout copy needed."""
    q, k, v, _ = make_qkv(1, 2, 2, 19, 23, 40, seed=5, device=DEVICE)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qs.is_contiguous()
    o1 = flashlib.attention(qs, ks, vs, causal=True, backend="triton")
    o2 = flashlib.attention(q, k, v, causal=True, backend="triton")
    assert torch.allclose(o1, o2, atol=1e-6)


def test_allow_tf32_runs_and_stays_close():
    q, k, v, _ = make_qkv(1, 1, 1, 20, 20, 32, seed=6, device=DEVICE)
    o = flashlib.attention(q, k, v, allow_tf32=True, backend="triton")
    assert_close(o, reference_gqa(q, k, v)[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_awkward_batch_heads_match_oracle(causal):
    """B·H = 15 (B = 3, H = 5, Hkv = 1) with several query blocks per head: every program must decode
    its own (query block, batch, head) from the flat grid."""
    q, k, v, _ = make_qkv(3, 5, 1, 45, 37, 24, seed=9, device=DEVICE)
    assert_forward_matches_oracle(q, k, v, causal)
