"""Tests of flashlib/triton/ (fa2_fwd, fa2_bwd, decode, configs) in Triton's interpreter on CPU tensors.

Every kernel is checked against the float64 oracle (flashlib.testing): fp32 tightly; fp16/bf16 under
FlashAttention's rule — max error <= 2x that of a plain PyTorch implementation in the same dtype
(3x for gradients). Shapes are small (the interpreter is slow) but adversarial: lengths that are
multiples of no block, Nq != Nk both ways, odd head dims up to 256, GQA/MQA, rows that see nothing.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashlib
from flashlib.testing import assert_close, max_error, plain_torch_attention, reference, reference_gqa

import flashlib.triton as ft  # noqa: E402  (sets TRITON_INTERPRET=1 here: no GPU)
from flashlib.triton import configs, fa2_bwd, fa2_fwd  # noqa: E402
from flashlib.triton.configs import Config  # noqa: E402


def make_qkv(B, H, HKV, NQ, NK, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, NQ, D, generator=g).to(dtype)
    k = torch.randn(B, HKV, NK, D, generator=g).to(dtype)
    v = torch.randn(B, HKV, NK, D, generator=g).to(dtype)
    do = torch.randn(B, H, NQ, D, generator=g).to(dtype)
    return q, k, v, do


def f64(x):
    return x.detach().to(torch.float64).numpy()


def oracle(q, k, v, do, causal):
    """Float64 (o, lse, dq, dk, dv) from flashlib.testing's oracle (GQA groups summed)."""
    o, lse, (dq, dk, dv) = reference_gqa(q, k, v, causal=causal, do=do)
    return o, lse, dq, dk, dv


def plain_torch(q, k, v, do, causal):
    """flashlib.testing's plain same-dtype attention, with its gradients: the fp16 rule's baseline."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o = plain_torch_attention(q, k, v, causal=causal)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def run_triton(q, k, v, do, causal):
    qq, kk, vv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o, lse = flashlib.attention(qq, kk, vv, causal=causal, return_lse=True, backend="triton")
    o.backward(do)
    return o.detach(), lse, qq.grad, kk.grad, vv.grad


def test_interpreter_mode_on_this_machine():
    assert ft.INTERPRET == (not torch.cuda.is_available())


# (B, H, Hkv, Nq, Nk, d, causal): multiples of no block (interpreter blocks: 32 x 16), both ways
# of Nq != Nk, head dims 1, 40, 59, 111, 256, GQA and MQA, causal rows that see nothing (Nq > Nk).
FP32_CASES = [
    (1, 1, 1, 1, 1, 1, False), (1, 2, 2, 1, 37, 40, True), (2, 4, 2, 17, 45, 40, False),
    (1, 4, 1, 45, 17, 59, True), (1, 2, 1, 33, 33, 111, True), (1, 1, 1, 5, 40, 256, True),
    (1, 4, 2, 70, 30, 16, True), (1, 2, 2, 30, 70, 24, False), (1, 3, 1, 50, 50, 64, True),
]


@pytest.mark.parametrize("case", FP32_CASES, ids=lambda c: "B{}H{}kv{}-{}x{}-d{}-{}".format(
    *c[:6], "causal" if c[6] else "full"))
def test_fp32_forward_backward_match_oracle(case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape)
    o, lse, dq, dk, dv = run_triton(q, k, v, do, causal)
    r = oracle(q, k, v, do, causal)
    for name, got, want in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv), r):
        assert_close(f64(got), want, atol=2e-5, rtol=2e-5, name=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [(1, 4, 2, 45, 70, 59, True), (1, 2, 1, 37, 20, 40, False),
                                  (1, 1, 1, 20, 33, 111, True)], ids=str)
def test_half_precision_within_flashattention_rule(dtype, case):
    *shape, causal = case
    q, k, v, do = make_qkv(*shape, dtype=dtype, seed=1)
    got = run_triton(q, k, v, do, causal)
    base = plain_torch(q, k, v, do, causal)
    r = oracle(q, k, v, do, causal)
    got = (got[0], *got[2:])
    r = (r[0], *r[2:])
    for i, name in enumerate(("o", "dq", "dk", "dv")):
        factor = 2 if name == "o" else 3
        err, base_err = max_error(f64(got[i]), r[i]), max_error(f64(base[i]), r[i])
        assert np.isfinite(err), name
        assert err <= factor * base_err, f"{name}: {err:.3e} > {factor} x plain {dtype} {base_err:.3e}"


def test_rows_that_see_nothing_are_zero_with_lse_minus_inf_and_zero_grads():
    q, k, v, do = make_qkv(1, 2, 1, 40, 9, 32, seed=2)       # causal, Nq > Nk: rows 0..30 see nothing
    o, lse, dq, dk, dv = run_triton(q, k, v, do, True)
    hidden = 40 - 9
    assert torch.all(o[:, :, :hidden] == 0) and torch.all(torch.isneginf(lse[:, :, :hidden]))
    assert torch.isfinite(lse[:, :, hidden:]).all()
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.all(dq[:, :, :hidden] == 0)


def test_block_sizes_do_not_change_the_result():
    q, k, v, do = make_qkv(1, 2, 1, 41, 53, 48, seed=3)
    outs = [fa2_fwd.forward(q, k, v, causal=True, scale=0.3, config=Config(bm, bn))
            for bm, bn in ((16, 16), (32, 64), (64, 16))]
    o0, l0 = outs[0]
    grads = [fa2_bwd.backward(q, k, v, o0, l0, do, causal=True, scale=0.3, config_dkdv=Config(bm, bn),
                              config_dq=Config(bn, bm)) for bm, bn in ((16, 16), (32, 64), (16, 32))]
    for o, lse in outs[1:]:
        assert_close(o.numpy(), o0.numpy(), atol=1e-5, rtol=1e-5, name="o")
        assert_close(lse.numpy(), l0.numpy(), atol=1e-5, rtol=1e-5, name="lse")
    for g in grads[1:]:
        for a, b in zip(g, grads[0]):
            assert_close(a.numpy(), b.numpy(), atol=1e-5, rtol=1e-5, name="grad")


def test_backward_is_deterministic():
    q, k, v, do = make_qkv(1, 4, 2, 33, 47, 40, seed=4)
    o, lse = fa2_fwd.forward(q, k, v, causal=False, scale=0.2)
    g1 = fa2_bwd.backward(q, k, v, o, lse, do, causal=False, scale=0.2)
    g2 = fa2_bwd.backward(q, k, v, o, lse, do, causal=False, scale=0.2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_strided_inputs_are_read_in_place():
    """(B, N, H, d) memory viewed as (B, H, N, d): the kernels take strides, no layout copy needed."""
    q, k, v, do = make_qkv(1, 2, 2, 19, 23, 40, seed=5)
    qs, ks, vs = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qs.is_contiguous()
    o1 = flashlib.attention(qs, ks, vs, causal=True, backend="triton")
    o2 = flashlib.attention(q, k, v, causal=True, backend="triton")
    assert torch.allclose(o1, o2, atol=1e-6)


def test_allow_tf32_runs_and_stays_close():
    q, k, v, _ = make_qkv(1, 1, 1, 20, 20, 32, seed=6)
    o = flashlib.attention(q, k, v, allow_tf32=True, backend="triton")
    assert_close(f64(o), oracle(q, k, v, torch.zeros_like(q), False)[0], atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------- decode

def decode_oracle(q, kc, vc, lens):
    G = q.shape[1] // kc.shape[1]
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, n in enumerate(lens.tolist()):
        if n:
            o[b], lse[b] = reference(f64(q[b]), np.repeat(f64(kc[b, :, :n]), G, 0),
                                     np.repeat(f64(vc[b, :, :n]), G, 0))
    return o, lse


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("shape", [(3, 4, 2, 1, 70, 40), (2, 8, 1, 2, 37, 111)], ids=str)
def test_decode_ragged_matches_oracle(shape, num_splits):
    B, H, HKV, NQ, NMAX, D = shape
    q, kc, vc, _ = make_qkv(B, H, HKV, NQ, NMAX, D, seed=7)
    lens = torch.tensor([0, NMAX, 5][:B], dtype=torch.int32)         # empty, full, short
    o, lse = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend="triton")
    ro, rl = decode_oracle(q, kc, vc, lens)
    assert_close(f64(o), ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(f64(lse), rl, atol=2e-5, rtol=2e-5, name="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_half_precision_rule(dtype):
    q, kc, vc, _ = make_qkv(2, 4, 1, 1, 90, 64, dtype=dtype, seed=8)
    lens = torch.tensor([90, 33])
    o = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=4, backend="triton")
    ro, _ = decode_oracle(q, kc, vc, lens)
    base = torch.cat([plain_torch(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n],
                                  torch.zeros_like(q[b:b + 1]), False)[0] for b, n in enumerate([90, 33])])
    assert max_error(f64(o), ro) <= 2 * max_error(f64(base), ro)


# ------------------------------------------------------------------------------------------ property

@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nq=st.integers(1, 40), nk=st.integers(1, 40), d=st.integers(1, 72), causal=st.booleans(),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), seed=st.integers(0, 2**16))
def test_property_forward_backward_match_oracle(nq, nk, d, causal, heads, seed):
    q, k, v, do = make_qkv(1, heads[0], heads[1], nq, nk, d, seed=seed)
    got = run_triton(q, k, v, do, causal)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), got, oracle(q, k, v, do, causal)):
        assert_close(f64(a), b, atol=5e-5, rtol=5e-5, name=name)
