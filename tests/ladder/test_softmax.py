"""Softmax three ways, the merge operator's algebra, and the log-sum-exp helpers."""
import numpy as np
import pytest
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from flashlib.ladder import softmax as sm

finite = st.floats(-50, 50, allow_nan=False, width=64)
rows = hnp.arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(1, 30)), elements=finite)


def oracle(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@settings(max_examples=80, deadline=None)
@given(x=rows)
def test_safe_and_online_match_the_definition(x):
    np.testing.assert_allclose(sm.safe_softmax(x), oracle(x), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(sm.online_softmax(x), oracle(x), rtol=1e-12, atol=1e-15)
    m, l = sm.online_state(x)
    np.testing.assert_allclose(sm.lse_from_state(m, l), np.log(np.exp(x).sum(-1)), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sm.logsumexp(x), np.log(np.exp(x).sum(-1)), rtol=1e-12, atol=1e-12)


def test_naive_softmax_overflows_in_fp16_and_safe_does_not():
    x = np.array([[1.0, 12.0, 3.0]], dtype=np.float16)     # exp(12) > 65504, fp16's largest
    assert np.isnan(sm.naive_softmax(x)).any()
    y = sm.safe_softmax(x)
    assert np.isfinite(y).all() and abs(float(y.sum()) - 1) < 1e-3
    assert np.isfinite(sm.online_softmax(x)).all()


def test_all_minus_inf_row_is_zero_and_lse_minus_inf():
    x = np.array([[-np.inf, -np.inf], [0.0, -np.inf]])
    for f in (sm.safe_softmax, sm.online_softmax):
        np.testing.assert_array_equal(f(x), [[0.0, 0.0], [1.0, 0.0]])
    assert sm.logsumexp(x)[0] == -np.inf and sm.logsumexp(x)[1] == 0.0


states = st.tuples(st.one_of(st.just(-np.inf), finite), st.floats(0, 1e3))


def _state(a):
    m, l = a
    return (m, 0.0) if m == -np.inf else (m, l)


@settings(max_examples=100, deadline=None)
@given(a=states, b=states, c=states)
def test_merge_is_associative_commutative_with_identity(a, b, c):
    a, b, c = _state(a), _state(b), _state(c)
    ab_c = sm.merge(*sm.merge(*a, *b), *c)
    a_bc = sm.merge(*a, *sm.merge(*b, *c))
    assert ab_c[0] == a_bc[0]
    np.testing.assert_allclose(ab_c[1], a_bc[1], rtol=1e-12)
    ba = sm.merge(*b, *a)
    assert sm.merge(*a, *b)[0] == ba[0]
    np.testing.assert_allclose(sm.merge(*a, *b)[1], ba[1], rtol=1e-12)
    ident = sm.merge(*a, -np.inf, 0.0)
    assert ident[0] == a[0] and np.isclose(ident[1], a[1], rtol=1e-12)


@settings(max_examples=50, deadline=None)
@given(x=rows, cut=st.integers(1, 29))
def test_merge_of_two_halves_equals_the_whole(x, cut):
    cut = min(cut, x.shape[-1] - 1) if x.shape[-1] > 1 else 1
    whole = sm.online_state(x)
    left, right = sm.online_state(x[:, :cut]), sm.online_state(x[:, cut:]) if cut < x.shape[-1] \
        else (np.full(x.shape[0], -np.inf), np.zeros(x.shape[0]))
    m, l = sm.merge(*left, *right)
    np.testing.assert_array_equal(m, whole[0])
    np.testing.assert_allclose(l, whole[1], rtol=1e-12)


@pytest.mark.parametrize("f", [sm.safe_softmax, sm.online_softmax, sm.naive_softmax, sm.logsumexp])
def test_bad_input(f):
    with pytest.raises(TypeError, match="x must be floating-point"):
        f(np.arange(4))
    with pytest.raises(ValueError, match="non-empty last axis"):
        f(np.zeros((2, 0)))


def test_safe_exp_diff_is_zero_not_nan_for_empty_states():
    ninf = -np.inf
    got = sm.safe_exp_diff(np.array([ninf, ninf, 0.0, 1.0]), np.array([ninf, 0.0, ninf, 1.0]))
    # exp(-inf - -inf) would be NaN: both states empty gives 0; a finite a over b = -inf cannot happen
    # in a running max (b >= a) and is not used; exp(1 - 1) = 1
    assert got[0] == 0.0 and got[1] == 0.0 and got[3] == 1.0 and not np.isnan(got).any()


def test_divide_rows_gives_zero_for_rows_that_saw_nothing_and_keeps_nan():
    num = np.array([[2.0, 4.0], [0.0, 0.0], [np.nan, 1.0]])
    got = sm.divide_rows(num, np.array([[2.0], [0.0], [1.0]]))
    assert got[0].tolist() == [1.0, 2.0] and got[1].tolist() == [0.0, 0.0]
    assert np.isnan(got[2, 0]) and got[2, 1] == 1.0
