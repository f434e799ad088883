"""Every forward algorithm of the ladder against the float64 oracle, on adversarial shapes."""
import numpy as np
import pytest
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings, strategies as st

from flashlib.testing import ADVERSARIAL_SHAPES, assert_close, random_qkv, reference
from ladder_cases import FORWARDS, ODD_BLOCKS


@pytest.mark.parametrize("name", sorted(FORWARDS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ADVERSARIAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_oracle(name, causal, shape):
    nq, nk, d = shape
    q, k, v = random_qkv(nq, nk, d, lead=(2, 1), seed=nq * 1000 + nk)
    o_ref, lse_ref = reference(q, k, v, causal=causal)
    o, lse = FORWARDS[name](q, k, v, causal, None, ODD_BLOCKS)
    assert o.shape == o_ref.shape and o.dtype == np.float64
    assert_close(o, o_ref, atol=1e-12, rtol=1e-10, name=f"{name} o")
    if lse is not None:
        assert_close(lse, lse_ref, atol=1e-12, rtol=1e-10, name=f"{name} lse")


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_fully_masked_rows_are_zero_with_lse_minus_inf(name):
    # Nq > Nk, causal: the first Nq - Nk queries see no key at all (bottom-right alignment).
    q, k, v = random_qkv(9, 4, 6, seed=3)
    o, lse = FORWARDS[name](q, k, v, True, None, (2, 3, 2))
    assert not np.isnan(o).any()
    np.testing.assert_array_equal(o[:5], 0.0)
    assert np.abs(o[5:]).sum() > 0
    if lse is not None:
        assert np.isneginf(lse[:5]).all() and np.isfinite(lse[5:]).all()


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_bottom_right_alignment_when_nq_less_than_nk(name):
    # One query against 6 keys, causal: bottom-right alignment lets it see every key (= non-causal).
    q, k, v = random_qkv(1, 6, 4, seed=4)
    o_causal, _ = FORWARDS[name](q, k, v, True, None, (1, 4, 3))
    o_full, _ = FORWARDS[name](q, k, v, False, None, (1, 4, 3))
    assert_close(o_causal, o_full, atol=1e-14, rtol=1e-12)


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_scale_argument(name):
    q, k, v = random_qkv(5, 7, 3, seed=5)
    o_ref, _ = reference(q, k, v, scale=0.3)
    o, _ = FORWARDS[name](q, k, v, False, 0.3, ODD_BLOCKS)
    assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
    o_default, _ = FORWARDS[name](q, k, v, False, None, ODD_BLOCKS)
    assert not np.allclose(o, o_default)  # the default is d ** -0.5, not 0.3


@pytest.mark.parametrize("name", sorted(FORWARDS))
@pytest.mark.parametrize("dtype,atol", [(np.float32, 2e-5), (np.float16, 4e-3)])
def test_low_precision_inputs(name, dtype, atol):
    q, k, v = random_qkv(19, 23, 40, dtype=dtype, seed=6)
    o_ref, _ = reference(q, k, v, causal=True)
    o, _ = FORWARDS[name](q, k, v, True, None, ODD_BLOCKS)
    assert o.dtype == dtype
    assert_close(o, o_ref, atol=atol, rtol=0, name=name)


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_value_head_dim_may_differ(name):
    q, k, v = random_qkv(6, 9, 5, dv=11, seed=7)
    o_ref, _ = reference(q, k, v, causal=True)
    o, _ = FORWARDS[name](q, k, v, True, None, ODD_BLOCKS)
    assert_close(o, o_ref, atol=1e-12, rtol=1e-10)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(FORWARDS)), nq=st.integers(1, 40), nk=st.integers(1, 40),
       d=st.integers(1, 20), causal=st.booleans(), bq=st.integers(1, 48), bk=st.integers(1, 48),
       splits=st.integers(1, 50), lead=st.sampled_from([(), (3,), (2, 2)]),
       seed=st.integers(0, 2**16))
def test_property_any_shape_any_blocks(name, nq, nk, d, causal, bq, bk, splits, lead, seed):
    q, k, v = random_qkv(nq, nk, d, lead=lead, seed=seed)
    o_ref, lse_ref = reference(q, k, v, causal=causal)
    o, lse = FORWARDS[name](q, k, v, causal, None, (bq, bk, splits))
    assert_close(o, o_ref, atol=1e-11, rtol=1e-9, name=name)
    if lse is not None:
        assert_close(lse, lse_ref, atol=1e-11, rtol=1e-9, name=name + " lse")


@pytest.mark.parametrize("name", sorted(FORWARDS))
def test_nan_input_propagates_instead_of_vanishing(name):
    # The guard for rows that see no key must not turn a NaN row into a quiet 0.
    q, k, v = random_qkv(2, 6, 4, seed=8)
    k[0, 0] = np.nan
    o, lse = FORWARDS[name](q, k, v, False, None, (1, 2, 3))
    assert np.isnan(o).all(axis=-1).all()
    if lse is not None:
        assert np.isnan(lse).all()
    o_ref, lse_ref = reference(q, k, v)
    assert np.isnan(o_ref).all() and np.isnan(lse_ref).all()


