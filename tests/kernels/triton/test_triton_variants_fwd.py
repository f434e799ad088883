"""Tests of the attention variants (issue 24) in the Triton forward, flashlib/kernels/triton/fa2_fwd_v1.py,
on conftest's DEVICE: sliding windows, softcap, ALiBi (one slope per batch and query head), sinks and
dropout, each alone and all combined, against the float64 oracle (flashlib.testing.reference_gqa; dropout
through its dropout_mask=, flashlib.ladder.dropout.keep_mask): float32 within 2e-5, float16/bfloat16 by
FlashAttention's rule (assert_attention_right).

Shapes are tiny (Triton's interpreter) but adversarial: lengths no block divides with forced small blocks
(Config(16, 16): a window skips tiles, visits full ones unmasked and masks both edges), Nq != Nk both ways,
GQA, d = 40, windows past the sequence, rows that see no key (o = 0, lse = -inf, or the sink with one).
Also: the kernel's dropout mask is keep_mask's bit for bit (read back through V = I), calls are bitwise
deterministic, the block sizes do not change the answer, the NaN rule holds under a window, and the TMA
forward (version 4) refuses every variant, saying which.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, require_module
from triton_cases import VARIANT_SEED as SEED, make_qkv, make_variants

from flashlib.kernels.triton import fa2_fwd_v1, fa2_fwd_v4_tma, kit
from flashlib.kernels.triton.configs import Config
from flashlib.ladder.dropout import keep_mask
from flashlib.testing import assert_attention_right, assert_close, reference_gqa

SMALL = Config(16, 16)             # several key and query blocks on short sequences


def run(q, k, v, causal, kern, config=SMALL, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fa2_fwd_v1.forward(q, k, v, causal=causal, scale=scale, config=config, **kern)


def assert_fp32_right(q, k, v, causal, kern, ref, config=SMALL):
    o, lse = run(q, k, v, causal, kern, config)
    o_ref, lse_ref = reference_gqa(q, k, v, causal=causal, **ref)
    assert_close(o, o_ref, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, name="lse")
    return o, lse


VARIANTS = {
    "window": dict(window=(5, 3)),
    "window-left": dict(window=(6, -1)),
    "window-right": dict(window=(-1, 2)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "dropout": dict(dropout_p=0.25),
    "all": dict(window=(9, 4), softcap=2.0, alibi=True, sinks=True, dropout_p=0.2),
}
# (B, H, Hkv, Nq, Nk, d): no block of 16 divides a length, Nq != Nk both ways, GQA, d = 40
SHAPES = [(1, 2, 1, 19, 37, 16), (2, 2, 2, 37, 21, 40), (1, 4, 2, 1, 29, 16)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_and_all_combined_match_the_oracle_fp32(name, shape, causal):
    q, k, v, _ = make_qkv(*shape, seed=3, device=DEVICE)
    kern, ref = make_variants(q, k, **VARIANTS[name])
    assert_fp32_right(q, k, v, causal, kern, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["window", "softcap", "alibi", "sinks", "dropout", "all"])
def test_half_precision_within_flashattention_rule(name, dtype):
    q, k, v, do = make_qkv(1, 4, 2, 33, 45, 40, dtype=dtype, seed=4, device=DEVICE)
    kern, ref = make_variants(q, k, **VARIANTS[name])
    o, lse = run(q, k, v, True, kern)
    assert_attention_right(q, k, v, do, causal=True, o=o, lse=lse, **ref)


@pytest.mark.parametrize("window", [(100, 100), (0, 0), (40, -1), (-1, 40), (0, -1)], ids=str)
def test_windows_wider_than_the_sequence_or_one_key(window):
    """(100, 100) and one-sided windows past the ends are dense attention; (0, 0) is one key a row."""
    q, k, v, _ = make_qkv(1, 2, 1, 23, 31, 16, seed=5, device=DEVICE)
    kern, ref = make_variants(q, k, window=window)
    o, lse = assert_fp32_right(q, k, v, False, kern, ref)
    if window == (100, 100):
        o_dense, lse_dense = run(q, k, v, False, {})
        assert_close(o, o_dense, atol=1e-6, rtol=1e-6, name="o")


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sink", "sink"])
def test_rows_that_see_no_key_are_zero_with_lse_minus_inf_or_the_sink(sinks):
    """Nq > Nk with window (0, 0): rows i < Nq - Nk would see key i + Nk - Nq < 0, none (whole query
    blocks of them: their key range is empty, nothing is loaded)."""
    q, k, v, _ = make_qkv(1, 2, 1, 40, 9, 16, seed=6, device=DEVICE)
    kern, ref = make_variants(q, k, window=(0, 0), sinks=sinks)
    o, lse = assert_fp32_right(q, k, v, False, kern, ref)
    hidden = 40 - 9
    assert torch.all(o[:, :, :hidden] == 0) and not torch.isnan(o).any()
    want = kern["sinks"].view(1, 2, 1).expand(1, 2, hidden) if sinks else torch.full((1, 2, hidden),
                                                                                       float("-inf"))
    assert torch.equal(lse[:, :, :hidden].cpu(), want.cpu().float())


def test_block_sizes_do_not_change_the_banded_result():
    q, k, v, _ = make_qkv(1, 2, 1, 41, 53, 16, seed=7, device=DEVICE)
    kern, ref = make_variants(q, k, window=(7, 5), alibi=True, softcap=3.0)
    outs = [run(q, k, v, True, kern, Config(bm, bn)) for bm, bn in ((16, 16), (32, 16), (16, 32))]
    o_ref, _ = reference_gqa(q, k, v, causal=True, **ref)
    assert_close(outs[0][0], o_ref, atol=2e-5, rtol=2e-5, name="o")
    for o, lse in outs[1:]:
        assert_close(o, outs[0][0], atol=1e-5, rtol=1e-5, name="o")
        assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5, name="lse")


@pytest.mark.parametrize("seed", [SEED, (3, 2**32 - 300)], ids=["seed", "carry"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_mask_is_keep_mask_bit_for_bit(causal, seed):
    """With V = I (one value column per key) o[i, j] = P_ij Z_ij / (1 - p): the kernel's keep mask Z
    reads back exactly, and equals flashlib.ladder.dropout.keep_mask on every element a row sees
    ("carry": counters cross 2^32 inside a row). The kept fraction is near 1 - p."""
    B, H, NQ, NK, p = 2, 3, 21, 30, 0.4
    q, k, _, _ = make_qkv(B, H, H, NQ, NK, 32, seed=8, device=DEVICE)
    v = torch.eye(NK, 32, device=DEVICE).expand(B, H, NK, 32).contiguous()
    o, _ = run(q, k, v, causal, dict(dropout_p=p, dropout_seed=seed, window_size=(12, -1)))
    z = keep_mask(*seed, (B, H, NQ, NK), p)
    i = np.arange(NQ)[:, None] + NK - NQ
    j = np.arange(NK)[None, :]
    seen = (j >= i - 12) & ((j <= i) if causal else True)
    got = (o[..., :NK] != 0).cpu().numpy()
    assert np.array_equal(got, z & seen)
    assert abs(z.mean() - (1 - p)) < 0.05


def test_calls_are_bitwise_deterministic():
    q, k, v, _ = make_qkv(1, 4, 2, 19, 37, 16, seed=9, device=DEVICE)
    kern, _ = make_variants(q, k, **VARIANTS["all"])
    o1, l1 = run(q, k, v, True, kern)
    o2, l2 = run(q, k, v, True, kern)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    other = dict(kern, dropout_seed=(SEED[0] + 1, SEED[1]))
    assert not torch.equal(run(q, k, v, True, other)[0], o1)       # another seed, another mask


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_nan_rule_under_a_window(where):
    """A NaN in V at a key a row's window hides leaves the row alone; one it sees makes it NaN."""
    q, k, v, _ = make_qkv(1, 1, 1, 20, 20, 16, seed=10, device=DEVICE)
    v = v.clone()
    v[0, 0, 3, 5] = float("nan")                 # key 3: rows 3..6 see it under window (3, 0)
    kern, ref = make_variants(q, k, window=(3, 0))
    o, lse = run(q, k, v, False, kern)
    o_ref, _ = reference_gqa(q, k, v, causal=False, **ref)
    if where == "inside":         # kit's rule: the row's O is NaN (the oracle: its column 5)
        for r in (3, 4, 6):
            assert torch.isnan(o[0, 0, r]).any() and np.isnan(o_ref[0, 0, r]).any()
    else:
        for r in (0, 2, 7, 15):
            assert_close(o[0, 0, r], o_ref[0, 0, r], atol=2e-5, rtol=2e-5, name="o")
    assert torch.isfinite(lse).all()


def test_softcap_keeps_large_scores_finite_and_capped():
    """Scores far beyond the cap (q, k scaled by 30): tanh saturates without overflow."""
    q, k, v, _ = make_qkv(1, 2, 1, 17, 19, 16, seed=11, device=DEVICE)
    q, k = q * 30, k * 30
    kern, ref = make_variants(q, k, softcap=5.0)
    o, lse = assert_fp32_right(q, k, v, False, kern, ref)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()


def test_variant_args_fold_causal_into_the_band_and_split_the_seed():
    q = torch.zeros(1, 2, 10, 16)
    args = fa2_fwd_v1.variant_args(10, 25, q, causal=True, window_size=(4, 7), softcap=2.0,
                                   dropout_p=0.5, dropout_seed=(2**40 + 3, 2**35))
    assert (args["win_l"], args["win_r"]) == (4, 0) and args["WINDOW"] and args["DROPOUT"]
    assert args["softcap2"] == pytest.approx(2.0 * kit.LOG2E.value)
    assert (args["seed_lo"], args["seed_hi"]) == (3, 256) and (args["drop_lo"], args["drop_hi"]) == (0, 8)
    dense = fa2_fwd_v1.variant_args(10, 25, q, causal=False)
    assert not any(dense[f] for f in ("WINDOW", "SOFTCAP", "ALIBI", "SINK", "DROPOUT"))
    with pytest.raises(ValueError, match="dropout_seed"):
        fa2_fwd_v1.variant_args(10, 25, q, causal=False, dropout_p=0.1)


def test_tma_forward_refuses_every_variant():
    q = torch.zeros(1, 2, 16, 64, dtype=torch.float16)
    for variants in (dict(window_size=(4, 0)), dict(softcap=1.0), dict(alibi_slopes=torch.ones(1, 2)),
                     dict(sinks=torch.zeros(2)), dict(dropout_p=0.1, dropout_seed=(1, 0))):
        why = fa2_fwd_v4_tma.supported(q, q, q, **variants)
        assert why is not None and next(iter(variants)) in why
    assert "variant" not in (fa2_fwd_v4_tma.supported(q, q, q, window_size=(-1, -1), softcap=0.0) or "")
    with pytest.raises(ValueError, match="variant"):
        fa2_fwd_v1.forward(q, q, q, causal=False, scale=0.1, spec=fa2_fwd_v4_tma.SPEC, softcap=1.0)


def test_hypothesis_over_variant_combinations():
    """Every combination of the variants (and causal), random small shapes and windows, fp32."""
    require_module("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    side = st.one_of(st.just(-1), st.integers(0, 20))

    @settings(max_examples=50, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(nq=st.integers(1, 24), nk=st.integers(1, 24), group=st.sampled_from([1, 2]),
           causal=st.booleans(), window=st.tuples(side, side), softcap=st.sampled_from([0.0, 0.7, 4.0]),
           alibi=st.booleans(), sinks=st.booleans(), dropout_p=st.sampled_from([0.0, 0.3]))
    def check(nq, nk, group, causal, window, softcap, alibi, sinks, dropout_p):
        q, k, v, _ = make_qkv(1, 2 * group, 2, nq, nk, 16, seed=nq * 31 + nk, device=DEVICE)
        kern, ref = make_variants(q, k, window=window, softcap=softcap, alibi=alibi, sinks=sinks,
                                  dropout_p=dropout_p)
        assert_fp32_right(q, k, v, causal, kern, ref)

    check()
