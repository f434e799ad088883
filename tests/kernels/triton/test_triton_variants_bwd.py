"""Tests of the attention variants (issue 24) in the Triton backward, flashlib/kernels/triton/fa2_bwd_v2.py
(and version 5's TMA dK/dV, flashlib/kernels/triton/fa2_bwd_v5_tma.py, which shares kit.dkdv_step), on
conftest's DEVICE: sliding windows, softcap, ALiBi, sinks (with their gradient dsinks) and dropout (its
keep mask Z regenerated from the forward's counters, flashlib.ladder.dropout), each alone and combined,
against the float64 oracle (flashlib.testing.reference_gqa): float32 within 1e-4, float16/bfloat16 by
FlashAttention's rule (3x a plain same-dtype implementation for gradients, assert_attention_right).

The o and lse the backward reads are the oracle's (rounded to the inputs' dtype / float32), so that these
tests check the backward alone; test_triton_forward_then_backward runs the Triton forward too. Shapes are
tiny (Triton's interpreter): lengths no block divides, Nq != Nk both ways, GQA, d = 40, small forced
blocks (Config(16, 16)) so that a window skips, fully visits and masks tiles, windows past the sequence
and rows that see no key. Determinism (bitwise) is checked here in the interpreter and belongs in the
GPU tier too (tests/gpu/test_triton_gpu.py).
"""
from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, need_module
from triton_cases import VARIANT_SEED as SEED, make_qkv, make_variants

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flashlib.kernels.triton as ft  # noqa: E402
from flashlib.kernels.triton import fa2_bwd_v2, fa2_bwd_v5_tma, fa2_fwd_v1  # noqa: E402
from flashlib.kernels.triton.configs import Config  # noqa: E402
from flashlib.testing import assert_attention_right, assert_close, reference_gqa  # noqa: E402

SMALL = Config(16, 16)            # forced small blocks: several tiles per row and column of the grid


def oracle_forward(q, k, v, causal, **ref_kw):
    """The oracle's o (in q's dtype) and lse (float32, with the sink), as the forward saves them."""
    o, lse = reference_gqa(q, k, v, causal=causal, **ref_kw)
    return (torch.from_numpy(o).to(q.device, q.dtype), torch.from_numpy(lse).to(q.device, torch.float32))


def backward(q, k, v, do, causal, kern, ref, *, cfg=None, scale=None, spec=fa2_bwd_v2.DKDV_SPEC, o_lse=None):
    """fa2_bwd_v2.backward with the variants, on the oracle's o and lse: its gradients (a tuple)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, lse = oracle_forward(q, k, v, causal, scale=scale, **ref) if o_lse is None else o_lse
    return tuple(fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=causal, scale=scale, config_dkdv=cfg,
                                     config_dq=cfg, dkdv_spec=spec, **kern))


def check(q, k, v, do, causal, *, cfg=None, **variants):
    """The backward's gradients with ``variants`` (make_variants' keywords) against the oracle."""
    kern, ref = make_variants(q, k, **variants)
    grads = backward(q, k, v, do, causal, kern, ref, cfg=cfg)
    assert len(grads) == (4 if variants.get("sinks") else 3)
    if variants.get("sinks"):
        assert grads[3].shape == (q.shape[1],) and grads[3].dtype == torch.float32
    for g in grads:
        assert torch.isfinite(g).all()
    assert_attention_right(q, k, v, do, causal=causal, grads=grads, **ref)
    return grads


ALONE = {
    "window": dict(window=(5, 3)),
    "window-left": dict(window=(4, -1)),
    "window-right": dict(window=(-1, 2)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "dropout": dict(dropout_p=0.3),
}
# (B, H, Hkv, Nq, Nk, d): Nq < Nk, Nq > Nk (causal rows that see nothing), GQA, d = 40
SHAPES = [(1, 2, 1, 19, 37, 16), (2, 2, 2, 37, 21, 40)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", list(ALONE), ids=str)
def test_each_variant_alone_fp32(variant, shape, causal):
    q, k, v, do = make_qkv(*shape, seed=1, device=DEVICE)
    check(q, k, v, do, causal, **ALONE[variant])


COMBINED = dict(window=(6, 2), softcap=2.0, alibi=True, sinks=True, dropout_p=0.25)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 23, 40, 40), (2, 3, 1, 40, 17, 24)], ids=str)
def test_all_variants_combined_fp32(shape, causal):
    q, k, v, do = make_qkv(*shape, seed=2, device=DEVICE)
    check(q, k, v, do, causal, **COMBINED)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variants", [COMBINED, dict(softcap=1.0, sinks=True), dict(window=(3, 0), dropout_p=0.4)],
                         ids=["combined", "softcap-sinks", "window-dropout"])
def test_half_precision_within_flashattention_rule(variants, dtype):
    q, k, v, do = make_qkv(1, 4, 2, 33, 29, 40, dtype=dtype, seed=3, device=DEVICE)
    check(q, k, v, do, True, **variants)


@pytest.mark.parametrize("shape", [(1, 4, 2, 1, 1, 8), (1, 4, 2, 1, 30, 16), (2, 4, 2, 30, 1, 16)], ids=str)
def test_one_query_or_one_key(shape):
    """Nq = 1 or Nk = 1 (lengths Triton's JIT may specialise as the constant 1) with every variant, GQA
    (the dK/dV kernel walks the group's heads, their slopes and dropout counters) and two batches."""
    q, k, v, do = make_qkv(*shape, seed=13, device=DEVICE)
    for causal in (False, True):
        check(q, k, v, do, causal, cfg=SMALL, **COMBINED)


# Windows against 16 x 16 tiles: skipped, fully visible and partial tiles in both kernels' loops, a
# window wider than the sequence, a zero-width band, and windows that leave rows with no key.
WINDOWS = [(0, 0), (3, 0), (7, 4), (20, 1), (0, 9), (100, 100), (40, 0), (2, -1), (-1, 0)]


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", [(41, 53), (53, 23)], ids=str)
def test_windows_with_small_blocks(nq, nk, window):
    q, k, v, do = make_qkv(1, 2, 1, nq, nk, 16, seed=4, device=DEVICE)
    for causal in (False, True):
        check(q, k, v, do, causal, cfg=SMALL, window=window)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sink", "sink"])
def test_rows_that_see_nothing_get_zero_gradients(sinks):
    """Nq > Nk with a window past the sequence's start: rows 0..33 see no key (o = 0, lse = -inf, or
    the sink's logit with a sink): their dQ is 0, nothing is NaN, and with a sink their D = 0 adds
    nothing to dsinks."""
    q, k, v, do = make_qkv(1, 2, 1, 40, 9, 16, seed=5, device=DEVICE)   # off = -31
    grads = check(q, k, v, do, False, cfg=SMALL, window=(1, 2), sinks=sinks, softcap=3.0)
    assert torch.all(grads[0][:, :, :40 - 9 - 2] == 0)


def test_tiles_outside_the_band_are_never_read():
    """Nq = 16 < Nk = 64 with a window (8, 0): no query row sees keys 0..39, so the key tiles [0, 16)
    and [16, 32) lie outside the band. Their keys and values hold NaN: the dQ kernel never loads them
    (its key range starts at the band), the dK/dV programs of those tiles visit no query block (their
    query range is empty) and write dK = dV = 0; every gradient is the oracle's."""
    q, k, v, do = make_qkv(1, 2, 1, 16, 64, 16, seed=6, device=DEVICE)
    kern, ref = make_variants(q, k, window=(8, 0))
    o_lse = oracle_forward(q, k, v, False, **ref)
    want = reference_gqa(q, k, v, causal=False, do=do, **ref)[2]
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :32], v_nan[:, :, :32] = float("nan"), float("nan")
    for causal in (False, True):
        dq, dk, dv = backward(q, k_nan, v_nan, do, causal, kern, ref, cfg=SMALL, o_lse=o_lse)
        assert torch.all(dk[:, :, :32] == 0) and torch.all(dv[:, :, :32] == 0)
        for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
            assert_close(a, b, atol=1e-4, rtol=1e-4, name=name)


def test_dropout_mask_follows_the_counters():
    """The mask the backward regenerates is the forward's definition (flashlib.ladder.dropout): the
    oracle with keep_mask(seed, offset) agrees, at small and 64-bit seeds and offsets, with GQA (the
    query head h enters the counter, not the kv head) and two batches; another seed or offset gives
    other gradients."""
    q, k, v, do = make_qkv(2, 4, 2, 21, 26, 16, seed=7, device=DEVICE)
    got = {}
    for dropout_seed in ((0, 0), (5, 3), SEED):
        kern, ref = make_variants(q, k, dropout_p=0.5, dropout_seed=dropout_seed)
        got[dropout_seed] = backward(q, k, v, do, False, kern, ref, cfg=SMALL)
        assert_attention_right(q, k, v, do, grads=got[dropout_seed], **ref)
    assert not torch.equal(got[(0, 0)][2], got[(5, 3)][2])
    assert not torch.equal(got[(5, 3)][2], got[SEED][2])


def test_dsinks_sum_over_batches_and_rows():
    """dsinks (H,) sums -exp(sink - lse) D over both batches and every row of each head; the
    gradients with a very negative sink (exp(sink) ~ 0) are those without one."""
    q, k, v, do = make_qkv(2, 3, 3, 12, 18, 16, seed=8, device=DEVICE)
    check(q, k, v, do, True, sinks=True)
    kern, ref = make_variants(q, k)
    plain = backward(q, k, v, do, True, kern, ref)
    ref["sinks"] = torch.full((3,), -200.0)
    kern["sinks"] = ref["sinks"].to(DEVICE)
    sunk = backward(q, k, v, do, True, kern, ref)
    for a, b in zip(plain, sunk[:3]):
        assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.all(sunk[3] == 0)


@pytest.mark.parametrize("variants", [COMBINED, dict(dropout_p=0.3, window=(4, 4))], ids=["combined", "dropout"])
def test_deterministic_bit_for_bit(variants):
    """Same inputs and seed: the same gradients, bit for bit (no atomics; Z regenerated, never stored)."""
    q, k, v, do = make_qkv(1, 4, 2, 27, 35, 24, dtype=torch.float16, seed=9, device=DEVICE)
    kern, ref = make_variants(q, k, **variants)
    o_lse = oracle_forward(q, k, v, True, **ref)
    first = backward(q, k, v, do, True, kern, ref, cfg=SMALL, o_lse=o_lse)
    again = backward(q, k, v, do, True, kern, ref, cfg=SMALL, o_lse=o_lse)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_defaults_are_the_dense_backward():
    """Every variant keyword at its default (window (-1, -1), softcap 0, no slopes, no sinks, p = 0)
    computes the dense backward, bit for bit."""
    q, k, v, do = make_qkv(1, 2, 1, 21, 30, 24, seed=10, device=DEVICE)
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=True, scale=0.25)
    dense = fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=True, scale=0.25)
    same = fa2_bwd_v2.backward(q, k, v, o, lse, do, causal=True, scale=0.25, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None)
    assert len(same) == 3
    for a, b in zip(dense, same):
        assert torch.equal(a, b)


@pytest.mark.skipif(not ft.INTERPRET, reason="bit equality of two kernels holds in the interpreter only")
def test_tma_dkdv_matches_version_2_bit_for_bit():
    """Version 5's TMA dK/dV takes the same variants through the same kit.dkdv_step: in the interpreter
    it agrees with version 2's bit for bit."""
    q, k, v, do = make_qkv(1, 4, 2, 29, 37, 48, dtype=torch.float16, seed=11, device=DEVICE)
    kern, ref = make_variants(q, k, **COMBINED)
    o_lse = oracle_forward(q, k, v, True, **ref)
    a = backward(q, k, v, do, True, kern, ref, cfg=SMALL, o_lse=o_lse)
    b = backward(q, k, v, do, True, kern, ref, cfg=SMALL, o_lse=o_lse, spec=fa2_bwd_v5_tma.DKDV_SPEC)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_triton_forward_then_backward():
    """The Triton forward's o and lse (with the sink, the dropped output) feed the backward: the
    gradients are the oracle's."""
    q, k, v, do = make_qkv(1, 4, 2, 30, 22, 40, seed=12, device=DEVICE)
    kern, ref = make_variants(q, k, **COMBINED)
    scale = 40 ** -0.5
    o, lse = fa2_fwd_v1.forward(q, k, v, causal=True, scale=scale, **kern)
    grads = backward(q, k, v, do, True, kern, ref, o_lse=(o, lse))
    assert_attention_right(q, k, v, do, causal=True, o=o, lse=lse, grads=grads, **ref)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nq=st.integers(1, 33), nk=st.integers(1, 33), d=st.sampled_from([8, 16, 40]), causal=st.booleans(),
       heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]), left=st.integers(-1, 12), right=st.integers(-1, 12),
       softcap=st.sampled_from([0.0, 0.7, 5.0]), alibi=st.booleans(), sinks=st.booleans(),
       dropout_p=st.sampled_from([0.0, 0.2, 0.6]), seed=st.integers(0, 2**16))
def test_property_any_combination_matches_oracle(nq, nk, d, causal, heads, left, right, softcap, alibi, sinks,
                                                 dropout_p, seed):
    q, k, v, do = make_qkv(1, heads[0], heads[1], nq, nk, d, seed=seed, device=DEVICE)
    check(q, k, v, do, causal, cfg=SMALL, window=(left, right), softcap=softcap, alibi=alibi, sinks=sinks,
          dropout_p=dropout_p, dropout_seed=(seed, 3 * seed), gen_seed=seed)
