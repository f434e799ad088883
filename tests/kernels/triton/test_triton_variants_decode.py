"""Tests of the attention variants (issue 24) in Flash-Decoding, flashlib/kernels/triton/decode_v3.py, on
conftest's DEVICE: sliding windows, softcap, ALiBi and sinks, each alone and combined, against the float64
oracle run on each sequence's valid keys (query i of sequence b sits at position i + len_b - Nq, so the
window and ALiBi use the offset len_b - Nq).

Ragged cache lengths side by side (empty, shorter than Nq, short, full), GQA groups stacked into one
program's rows with per-head ALiBi slopes (B, H) and per-head sinks, one split (the sink in the split
kernel) and several (the sink in the combine; empty splits), windows past the sequence, lengths no block
divides with forced small blocks. Also: the splits divide the band, not Nmax (a window's answer does not
depend on the split count), and float16 within FlashAttention's rule.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, require_module
from triton_cases import make_qkv

from flashlib.kernels.triton import decode_v3
from flashlib.kernels.triton.configs import Config
from flashlib.testing import assert_attention_right, assert_close, reference_gqa

SMALL = Config(16, 16)


def make_variants(B, H, *, window=(-1, -1), softcap=0.0, alibi=False, sinks=False, seed=0):
    """The variants as decode takes them (alibi_slopes float32 (B, H) contiguous, sinks float32 (H,))."""
    g = torch.Generator().manual_seed(2000 + seed)
    kw = {}
    if tuple(window) != (-1, -1):
        kw["window_size"] = tuple(window)
    if softcap:
        kw["softcap"] = float(softcap)
    if alibi:
        kw["alibi_slopes"] = (torch.rand(B, H, generator=g) * 0.5 + 0.05).to(DEVICE)
    if sinks:
        kw["sinks"] = torch.randn(H, generator=g).to(DEVICE)
    return kw


def oracle_kw(kw, b):
    """Sequence b's oracle keywords: its row of the slopes, the sinks as arrays."""
    ref = {n: x for n, x in kw.items() if n in ("window_size", "softcap")}
    if "alibi_slopes" in kw:
        ref["alibi_slopes"] = kw["alibi_slopes"][b:b + 1].cpu().numpy()
    if "sinks" in kw:
        ref["sinks"] = kw["sinks"].cpu().numpy()
    return ref


def decode_oracle(q, kc, vc, lens, kw):
    """Float64 ``(o, lse)``: sequence b attends its first lens[b] keys; none: o = 0, lse = the sink
    (or -inf)."""
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, n in enumerate(lens.tolist()):
        ref = oracle_kw(kw, b)
        if n:
            o[b:b + 1], lse[b:b + 1] = reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], **ref)
        elif "sinks" in ref:
            lse[b] = ref["sinks"][:, None]
    return o, lse


def run(q, kc, vc, lens, num_splits, kw, config=SMALL):
    return decode_v3.decode(q, kc, vc, lens, num_splits=num_splits, scale=q.shape[-1] ** -0.5,
                            config=config, **kw)


def assert_decode_right(q, kc, vc, lens, num_splits, kw, config=SMALL):
    o, lse = run(q, kc, vc, lens, num_splits, kw, config)
    ro, rl = decode_oracle(q, kc, vc, lens, kw)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")
    return o, lse


VARIANTS = {
    "window": dict(window=(6, 0)),
    "window-both": dict(window=(4, 2)),
    "window-left": dict(window=(9, -1)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(window=(11, 1), softcap=2.0, alibi=True, sinks=True),
}


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_and_all_combined_match_the_oracle(name, num_splits):
    """B = 4 ragged (empty, 2 < Nq, short, full), H = 4 over Hkv = 2 (two query heads stacked per
    program, each with its own slope and sink), Nq = 3, Nmax = 45."""
    q, kc, vc, _ = make_qkv(4, 4, 2, 3, 45, 16, seed=1, device=DEVICE)
    lens = torch.tensor([0, 2, 19, 45], dtype=torch.int32, device=DEVICE)
    assert_decode_right(q, kc, vc, lens, num_splits, make_variants(4, 4, **VARIANTS[name]))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_gqa_group_of_four_per_row_slopes_and_sinks_odd_head_dim(num_splits):
    """Hkv = 1, H = 4, Nq = 2: eight stacked rows of four query heads in one program, d = 40."""
    q, kc, vc, _ = make_qkv(2, 4, 1, 2, 37, 40, seed=2, device=DEVICE)
    lens = torch.tensor([37, 23], dtype=torch.int32, device=DEVICE)
    kw = make_variants(2, 4, window=(13, -1), alibi=True, sinks=True, seed=2)
    assert_decode_right(q, kc, vc, lens, num_splits, kw)


@pytest.mark.parametrize("window", [(100, 100), (0, 0), (0, -1), (-1, 0)], ids=str)
def test_windows_past_the_sequence_and_one_key(window):
    q, kc, vc, _ = make_qkv(3, 2, 1, 2, 33, 16, seed=3, device=DEVICE)
    lens = torch.tensor([33, 1, 10], dtype=torch.int32, device=DEVICE)
    kw = make_variants(3, 2, window=window, sinks=True)
    o, _ = assert_decode_right(q, kc, vc, lens, 3, kw)
    if window == (100, 100):
        o_dense, _ = run(q, kc, vc, lens, 3, dict(sinks=kw["sinks"]))
        assert_close(o, o_dense, atol=1e-6, rtol=1e-6, name="o")


def test_window_answer_does_not_depend_on_the_split_count():
    """The splits divide the band (here 8 keys of a 60-key sequence): 1, 2 and 7 splits agree."""
    q, kc, vc, _ = make_qkv(1, 2, 2, 1, 60, 16, seed=4, device=DEVICE)
    lens = torch.tensor([60], dtype=torch.int32, device=DEVICE)
    kw = make_variants(1, 2, window=(7, 0), sinks=True)
    outs = [assert_decode_right(q, kc, vc, lens, s, kw) for s in (1, 2, 7)]
    for o, lse in outs[1:]:
        assert_close(o, outs[0][0], atol=1e-5, rtol=1e-5, name="o")
        assert_close(lse, outs[0][1], atol=1e-5, rtol=1e-5, name="lse")


def test_keys_outside_the_band_are_never_read():
    """NaN in every key and value outside sequence 0's band (window (5, 0), length 40, Nq = 1: keys 34..39)
    changes nothing: those blocks are not loaded, and the band's first block hides them."""
    q, kc, vc, _ = make_qkv(1, 2, 1, 1, 40, 16, seed=5, device=DEVICE)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    kw = make_variants(1, 2, window=(5, 0))
    o, lse = run(q, kc, vc, lens, 2, kw)
    kn, vn = kc.clone(), vc.clone()
    vn[:, :, :34] = float("nan")
    kn[:, :, :34] = float("nan")
    o2, lse2 = run(q, kn, vn, lens, 2, kw)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_no_lengths_uses_the_whole_cache_with_variants():
    q, kc, vc, _ = make_qkv(2, 2, 1, 2, 29, 16, seed=6, device=DEVICE)
    kw = make_variants(2, 2, **VARIANTS["all"], seed=6)
    o, lse = run(q, kc, vc, None, 2, kw)
    lens = torch.tensor([29, 29], dtype=torch.int32, device=DEVICE)
    ro, rl = decode_oracle(q, kc, vc, lens, kw)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_within_flashattention_rule(dtype):
    q, kc, vc, do = make_qkv(2, 4, 2, 2, 50, 40, dtype=dtype, seed=7, device=DEVICE)
    lens = [50, 21]
    kw = make_variants(2, 4, window=(12, 0), softcap=3.0, alibi=True, sinks=True, seed=7)
    o, lse = run(q, kc, vc, torch.tensor(lens, dtype=torch.int32, device=DEVICE), 3, kw)
    for b, n in enumerate(lens):
        one = slice(b, b + 1)
        assert_attention_right(q[one], kc[one, :, :n], vc[one, :, :n], do[one], o=o[one], lse=lse[one],
                               **oracle_kw(kw, b))


def test_hypothesis_over_variant_combinations():
    """Every combination of the variants, random lengths (empty ones too), GQA groups, query counts,
    windows and split counts, fp32 against the oracle."""
    require_module("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    side = st.one_of(st.just(-1), st.integers(0, 30))

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(b=st.integers(1, 3), heads=st.sampled_from([(1, 1), (4, 2), (4, 1)]), nq=st.integers(1, 3),
           nmax=st.integers(1, 60), num_splits=st.integers(1, 5), lengths=st.lists(st.integers(0, 60),
                                                                                    min_size=3, max_size=3),
           window=st.tuples(side, side), softcap=st.sampled_from([0.0, 0.8, 5.0]), alibi=st.booleans(),
           sinks=st.booleans())
    def check(b, heads, nq, nmax, num_splits, lengths, window, softcap, alibi, sinks):
        q, kc, vc, _ = make_qkv(b, heads[0], heads[1], nq, nmax, 16, seed=nmax * 7 + nq, device=DEVICE)
        lens = torch.tensor([min(n, nmax) for n in lengths[:b]], dtype=torch.int32, device=DEVICE)
        kw = make_variants(b, heads[0], window=window, softcap=softcap, alibi=alibi, sinks=sinks)
        assert_decode_right(q, kc, vc, lens, num_splits, kw)

    check()
