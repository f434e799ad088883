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
