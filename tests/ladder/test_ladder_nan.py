"""The NaN rule, SDPA's, on every forward algorithm of the ladder (the "reference" backend runs fa2
and decoding): a NaN in q[i] makes row i's o and lse NaN; a NaN in k[j] or v[j] makes NaN the rows
that see key j (k: o and lse; v: o only); a NaN behind the causal mask changes nothing for the rows
it is hidden from. A row that sees no key gives o = 0 and lse = -inf."""
import numpy as np
import pytest

from flashlib.ladder import decoding, fa1, fa2, memeff, naive
from flashlib.ladder.masks import causal_mask, masked_matmul
from flashlib.testing import random_qkv
from ladder_cases import FORWARDS

# (block_q, block_k, num_splits) that cut the diagonal of the mask inside tiles and splits
BLOCKS = (2, 3, 3)
SHAPES = [(5, 7), (7, 4), (6, 6)]           # Nq < Nk; Nq > Nk (rows that see no key); square
D = 4


def _run(name, q, k, v, causal=True, blocks=BLOCKS):
    o, lse = FORWARDS[name](q, k, v, causal, None, blocks)
    return o, lse


def _seen(nq, nk, causal=True):
    """visible[i, j]: row i sees key j."""
    return causal_mask(0, nq, 0, nk, nq, nk) if causal else np.ones((nq, nk), bool)


def _assert_rows(name, o, lse, clean, nan_rows, lse_nan_rows):
    """Rows in nan_rows are NaN in o, lse_nan_rows in lse; every other row is bit for bit the clean
    run's (the NaN changes nothing there)."""
    o0, lse0 = clean
    for i in range(o.shape[-2]):
        if nan_rows[i]:
            assert np.isnan(o[..., i, :]).all(), f"{name}: row {i} sees the NaN, o must be NaN"
        else:
            np.testing.assert_array_equal(o[..., i, :], o0[..., i, :],     # bit for bit
                                          err_msg=f"{name}: row {i} does not see the NaN")
        if lse is None:
            continue
        if lse_nan_rows[i]:
            assert np.isnan(lse[..., i]).all(), f"{name}: row {i} lse must be NaN"
        else:
            np.testing.assert_array_equal(lse[..., i], lse0[..., i],
                                          err_msg=f"{name}: row {i} lse does not see the NaN")


@pytest.mark.parametrize("name", sorted(FORWARDS))
@pytest.mark.parametrize("nq,nk", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_nan_in_v_reaches_exactly_the_rows_that_see_it(name, nq, nk, causal):
    q, k, v = random_qkv(nq, nk, D, lead=(2,), seed=nq * 10 + nk)
    seen = _seen(nq, nk, causal)
    clean = _run(name, q, k, v, causal)
    for j in range(nk):
        bad = v.copy()
        bad[:, j] = np.nan
        o, lse = _run(name, q, k, bad, causal)
        _assert_rows(f"{name} v[{j}]", o, lse, clean, seen[:, j], np.zeros(nq, bool))


@pytest.mark.parametrize("name", sorted(FORWARDS))
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_nan_in_k_reaches_exactly_the_rows_that_see_it(name, nq, nk):
    q, k, v = random_qkv(nq, nk, D, lead=(2,), seed=nq * 10 + nk + 1)
    seen = _seen(nq, nk)
    clean = _run(name, q, k, v)
    for j in range(nk):
        bad = k.copy()
        bad[:, j, 1] = np.nan
        o, lse = _run(name, q, bad, v)
        _assert_rows(f"{name} k[{j}]", o, lse, clean, seen[:, j], seen[:, j])


@pytest.mark.parametrize("name", sorted(FORWARDS))
@pytest.mark.parametrize("nq,nk", SHAPES)
def test_nan_in_q_makes_its_own_row_nan_and_no_other(name, nq, nk):
    q, k, v = random_qkv(nq, nk, D, lead=(2,), seed=nq * 10 + nk + 2)
    sees_any = _seen(nq, nk).any(axis=1)
    clean = _run(name, q, k, v)
    for i in range(nq):
        bad = q.copy()
        bad[:, i, 0] = np.nan
        o, lse = _run(name, bad, k, v)
        row = np.arange(nq) == i
        # a row that sees no key gives o = 0 and lse = -inf whatever its query holds
        _assert_rows(f"{name} q[{i}]", o, lse, clean, row & sees_any, row & sees_any)
        if not sees_any[i]:
            assert (o[..., i, :] == 0).all()
            assert lse is None or np.isneginf(lse[..., i]).all()


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 100])
def test_decoding_nan_rule_for_every_split_count(splits):
    q, k, v = random_qkv(3, 8, D, seed=4)
    clean = decoding.forward(q, k, v, num_splits=splits, causal=True)
    bad = v.copy()
    bad[7] = np.nan                                     # the last key: only the last row sees it
    o, lse = decoding.forward(q, k, bad, num_splits=splits, causal=True)
    _assert_rows("decoding", o, lse, clean, np.array([False, False, True]), np.zeros(3, bool))


@pytest.mark.parametrize("fn", [fa2.forward, fa1.forward, naive.attention, memeff.lse_first])
def test_nan_behind_the_mask_with_one_tile(fn):
    # the default blocks (64) hold the whole problem: the diagonal lies inside one tile
    q, k, v = random_qkv(4, 6, D, seed=5)
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[5], bad_v[5] = np.nan, np.nan                 # key 5: seen by row 3 only
    out = fn(q, bad_k, bad_v, causal=True)
    o = out[0] if isinstance(out, tuple) else out
    ref = fn(q, k, v, causal=True)
    ref = ref[0] if isinstance(ref, tuple) else ref
    np.testing.assert_array_equal(o[:3], ref[:3])
    assert np.isnan(o[3]).all()


def test_masked_matmul():
    rng = np.random.default_rng(0)
    p, v = rng.random((2, 3, 4)), rng.standard_normal((2, 4, 5))
    visible = np.tril(np.ones((3, 4), bool))
    np.testing.assert_allclose(masked_matmul(p, v, None), p @ v, rtol=1e-15)
    np.testing.assert_allclose(masked_matmul(p * visible, v, visible), (p * visible) @ v, rtol=1e-14)
    v[:, 3, 2] = np.nan                                 # key 3: seen by no row of the tril (3 x 4)
    v[:, 1, 0] = np.inf                                 # key 1: seen by rows 1, 2
    got = masked_matmul(p * visible, v, visible)
    assert not np.isnan(got).any()
    assert np.isinf(got[:, 1:, 0]).all() and np.isfinite(got[:, 0, 0]).all()
