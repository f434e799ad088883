"""Flash-Decoding: combine is exact, any split count works, the heuristic behaves."""
import numpy as np
import pytest
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings, strategies as st

from flashlib.ladder import decoding
from flashlib.testing import assert_close, random_qkv, reference
from ladder_cases import B, counted


def test_combine_of_disjoint_parts_equals_whole_attention():
    q, k, v = random_qkv(3, 40, 8, seed=1)
    parts = [reference(q, k[a:b], v[a:b]) for a, b in [(0, 11), (11, 12), (12, 40)]]
    o, lse = decoding.combine(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    o_ref, lse_ref = reference(q, k, v)
    assert_close(o, o_ref, atol=1e-13, rtol=1e-12)
    assert_close(lse, lse_ref, atol=1e-13, rtol=1e-12)


def test_combine_with_all_empty_parts():
    o, lse = decoding.combine(np.zeros((3, 2, 4)), np.full((3, 2), -np.inf))
    np.testing.assert_array_equal(o, 0.0)
    assert np.isneginf(lse).all()


@pytest.mark.parametrize("nk,splits", [(10, 3), (3, 10), (1, 1), (7, 7)])
def test_split_bounds_cover_every_key_once(nk, splits):
    bounds = decoding.split_bounds(nk, splits)
    assert len(bounds) == splits
    covered = [j for a, b in bounds for j in range(a, b)]
    assert covered == list(range(nk))


@settings(max_examples=50, deadline=None)
@given(nq=st.integers(1, 4), nk=st.integers(1, 300), splits=st.integers(1, 64),
       causal=st.booleans(), seed=st.integers(0, 999))
def test_decoding_any_split_count(nq, nk, splits, causal, seed):
    q, k, v = random_qkv(nq, nk, 16, lead=(2, 3), seed=seed)
    o, lse = decoding.forward(q, k, v, num_splits=splits, causal=causal)
    o_ref, lse_ref = reference(q, k, v, causal=causal)
    assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
    assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10)


def test_choose_num_splits():
    # 1 sequence x 16 heads on a 108-SM A100: split until the SMs are covered, >= 1 key block each
    assert decoding.choose_num_splits(16, 1, 65536, 108) == 7
    assert decoding.choose_num_splits(16, 1, 512, 108) == 2       # only 2 key blocks of 256
    assert decoding.choose_num_splits(256, 1, 65536, 108) == 1    # batch already fills the GPU
    with pytest.raises(ValueError, match="num_sms must be a positive int"):
        decoding.choose_num_splits(1, 1, 10, 0)


@pytest.mark.parametrize("n,m,d,splits", [(1, 100, 8, 4), (3, 50, 5, 7), (2, 5, 4, 9)])
def test_decoding_closed_form(n, m, d, splits):
    q, k, v = random_qkv(n, m, d)
    splits = min(splits, m)                                     # more splits than keys act as Nk
    reads = splits * n * d + 2 * m * d + splits * (n * d + n)   # Q per split, K/V once; combine
    writes = splits * (n * d + n) + n * d + n                   # partials; final O, LSE
    assert counted(decoding.forward, q, k, v, num_splits=splits) == (B * reads, B * writes)


# ---- the variants (notebooks/09_real_models): window, softcap, ALiBi, sinks; splits over the band ----
from flashlib.ladder.iomodel import IOCounter  # noqa: E402
from flashlib.ladder.masks import band_mask  # noqa: E402

SLOPES, SINKS = np.array([0.1, 0.5, 1.0]), np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -0.5]])
DECODE_VARIANTS = [dict(window_size=(4, 0)), dict(window_size=(3, 2), causal=True),
                   dict(window_size=(-1, 1)), dict(softcap=1.5), dict(alibi_slopes=SLOPES),
                   dict(sinks=SINKS), dict(window_size=(100, -1)),
                   dict(window_size=(6, 0), causal=True, softcap=2.0, alibi_slopes=SLOPES, sinks=SINKS)]


@pytest.mark.parametrize("kw", DECODE_VARIANTS, ids=lambda kw: "-".join(kw))
@pytest.mark.parametrize("nq,nk", [(1, 1), (1, 37), (3, 40), (13, 5), (5, 13)])
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_decoding_variants_against_the_oracle(kw, nq, nk, splits):
    q, k, v = random_qkv(nq, nk, 8, lead=(2, 3), seed=nq * nk)
    o, lse = decoding.forward(q, k, v, num_splits=splits, **kw)
    o_ref, lse_ref = reference(q, k, v, **kw)
    assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
    assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("nq,nk,causal,window", [(1, 100, False, (10, 0)), (1, 100, True, (-1, -1)),
                                                 (4, 50, True, (7, 0)), (3, 9, False, (2, 2)),
                                                 (6, 2, False, (0, 0)), (1, 9, False, (-1, -1)),
                                                 (5, 3, True, (-1, -1))])
def test_band_keys_are_the_keys_some_query_sees(nq, nk, causal, window):
    seen = band_mask(0, nq, 0, nk, nq, nk, causal, window).any(axis=0)
    lo, hi = decoding.band_keys(nq, nk, causal, window)
    if not seen.any():
        assert (lo, hi) == (0, 0)
    else:
        assert (lo, hi) == (seen.argmax(), nk - seen[::-1].argmax())
        assert seen[lo:hi].all()


def test_decoding_splits_only_the_band_and_reads_only_its_keys():
    n, w, d = 1000, 64, 8
    q, k, v = random_qkv(1, n, d, seed=3)
    io = IOCounter(bytes_per_element=1)
    o, lse = decoding.forward(q, k, v, num_splits=4, window_size=(w - 1, 0), io=io)
    assert_close(o, reference(q, k, v, window_size=(w - 1, 0))[0], atol=1e-12, rtol=1e-10)
    kv_reads = 2 * w * d                                          # the band's K and V, once
    assert io.hbm_read_bytes == kv_reads + 4 * d + 4 * (d + 1)    # + Q per split, combine
    # the split count counts the band: 100 splits of a 64-key band act as 64
    io = IOCounter(bytes_per_element=1)
    decoding.forward(q, k, v, num_splits=100, window_size=(w - 1, 0), io=io)
    assert io.hbm_read_bytes == kv_reads + 64 * d + 64 * (d + 1)


def test_decoding_where_no_query_sees_a_key():
    q, k, v = random_qkv(6, 2, 4, lead=(2, 3), seed=4)
    kw = dict(window_size=(0, 0))                   # off = -4: rows 0..3 see nothing; 4, 5 one key
    for extra in ({}, {"sinks": SINKS}):
        o, lse = decoding.forward(q, k, v, num_splits=3, **kw, **extra)
        o_ref, lse_ref = reference(q, k, v, **kw, **extra)
        assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
        assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10)
    q, k, v = random_qkv(1, 5, 4, seed=5)           # 5 queries, 1 key: 4 windows end before it
    o, lse = decoding.forward(np.ones((5, 4)), k[:1], v[:1], num_splits=2, window_size=(0, 0))
    assert (o[:4] == 0).all() and np.isneginf(lse[:4]).all() and np.isfinite(lse[4])
    o, lse = decoding.forward(np.ones((5, 4)), k[:1], v[:1], num_splits=2, window_size=(0, 0),
                              sinks=np.array(1.5))
    assert (o[:4] == 0).all() and (lse[:4] == 1.5).all()


@settings(max_examples=60, deadline=None)
@given(nq=st.integers(1, 5), nk=st.integers(1, 60), splits=st.integers(1, 20), causal=st.booleans(),
       left=st.integers(-1, 20), right=st.integers(-1, 5), softcap=st.sampled_from([0.0, 1.0]),
       alibi=st.booleans(), sinks=st.booleans(), seed=st.integers(0, 999))
def test_decoding_any_combination(nq, nk, splits, causal, left, right, softcap, alibi, sinks, seed):
    q, k, v = random_qkv(nq, nk, 8, lead=(2, 3), seed=seed)
    kw = dict(causal=causal, window_size=(left, right), softcap=softcap,
              alibi_slopes=SLOPES if alibi else None, sinks=SINKS if sinks else None)
    o, lse = decoding.forward(q, k, v, num_splits=splits, **kw)
    o_ref, lse_ref = reference(q, k, v, **kw)
    assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
    assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(window_size=(-3, 0)), ValueError, "window_size"), (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi_slopes=np.ones(4)), ValueError, "alibi_slopes"), (dict(sinks="x"), TypeError, "sinks"),
    (dict(dropout_p=0.1), TypeError, "dropout_p"),                 # decode is inference: no dropout
])
def test_decoding_variant_arguments_are_checked(kw, exc, match):
    q, k, v = random_qkv(1, 5, 4, lead=(3,))
    with pytest.raises(exc, match=match):
        decoding.forward(q, k, v, num_splits=2, **kw)
