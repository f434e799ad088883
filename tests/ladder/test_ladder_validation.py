"""One validation layer for the ladder, the torch API's rules: every flag goes through
flashlib.validation.check_flag (a bool or np.bool_, nothing merely truthy), and every helper refuses
bad input with a TypeError/ValueError naming the argument instead of failing deep inside NumPy."""
import time

import numpy as np
import pytest

from flashlib.ladder import decoding, fa1, fa2, masks, memeff, naive, softmax
from flashlib.ladder.iomodel import IOCounter
from flashlib.testing import random_qkv
from ladder_cases import FORWARDS, counted

Q, K, V = random_qkv(4, 6, 3, seed=1)
O, LSE = fa2.forward(Q, K, V)

# every ladder function that takes a flag: name -> f(causal)
FLAGGED = {name: (lambda c, f=f: f(Q, K, V, c, None, (2, 3, 2))) for name, f in FORWARDS.items()}
FLAGGED["fa2.backward"] = lambda c: fa2.backward(Q, K, V, O, LSE, np.ones_like(O), causal=c)
FLAGGED["naive.backward"] = lambda c: naive.backward(Q, K, V, O, np.ones_like(O), causal=c)


@pytest.mark.parametrize("name", sorted(FLAGGED))
@pytest.mark.parametrize("bad", ["False", "True", 2, 1, 0, None, 1.0, np.array(True), [True]],
                         ids=repr)
def test_causal_must_be_a_bool(name, bad):
    with pytest.raises(TypeError, match=r"causal must be a bool, got "):
        FLAGGED[name](bad)


@pytest.mark.parametrize("name", sorted(FLAGGED))
def test_numpy_bools_are_accepted_as_the_bools_they_are(name):
    for flag in (True, False):
        want, got = FLAGGED[name](flag), FLAGGED[name](np.bool_(flag))
        for w, g in zip(want, got):
            if w is not None:
                np.testing.assert_array_equal(g, w)


def test_the_issue_case_string_false_no_longer_runs_causal():
    with pytest.raises(TypeError, match="causal must be a bool, got str 'False'"):
        fa2.forward(Q, K, V, causal="False")


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: decoding.split_bounds(10, 0), ValueError, "num_splits must be an int >= 1, got 0"),
    (lambda: decoding.split_bounds(-5, 2), ValueError, "nk must be an int >= 0, got -5"),
    (lambda: decoding.split_bounds(10.0, 2), TypeError, "nk must be an int >= 0, got float"),
    (lambda: decoding.split_bounds(True, 2), TypeError, "nk must be an int >= 0, got bool"),
    (lambda: decoding.split_bounds(10, 2.0), TypeError, "num_splits must be an int >= 1"),
    (lambda: decoding.split_bounds("10", 2), TypeError, "nk must be an int >= 0, got str"),
    (lambda: fa1.paper_block_sizes(48 * 1024, 64, 0), ValueError, "bytes_per_element must be a pos"),
    (lambda: fa1.paper_block_sizes(48 * 1024, 0), ValueError, "d must be a positive int, got 0"),
    (lambda: fa1.paper_block_sizes(48 * 1024, -3), ValueError, "d must be a positive int, got -3"),
    (lambda: fa1.paper_block_sizes(0, 64), ValueError, "sram_bytes must be a positive int"),
    (lambda: fa1.paper_block_sizes("49152", 64), TypeError, "sram_bytes must be a positive int"),
    (lambda: fa1.paper_block_sizes(49152.0, 64), TypeError, "sram_bytes must be a positive int"),
    (lambda: fa1.paper_block_sizes(49152, True), TypeError, "d must be a positive int, got bool"),
    (lambda: decoding.choose_num_splits(1.5, 1, 10, 4), TypeError, "batch_heads must be a positive"),
    (lambda: decoding.choose_num_splits(1, True, 10, 4), TypeError, "n_query_blocks must be a pos"),
    (lambda: decoding.choose_num_splits(1, 1, -10, 4), ValueError, "nk must be a positive int"),
    (lambda: decoding.choose_num_splits(1, 1, 10, 4, block_k=0), ValueError, "block_k must be a"),
    (lambda: decoding.choose_num_splits(1, 1, 10, 4, max_splits="8"), TypeError, "max_splits must"),
    (lambda: decoding.forward(Q, K, V, num_splits=True), TypeError, "num_splits must be an int >= 1"),
    (lambda: decoding.forward(Q, K, V, num_splits=np.float64(2)), TypeError, "num_splits must be"),
    (lambda: decoding.combine([[[0.0]]], [[0]]), TypeError, "lse_parts must be floating-point"),
    (lambda: decoding.combine("o", [[0.0]]), TypeError, "o_parts must be a real number or array"),
    (lambda: decoding.combine(np.zeros((0, 2, 3)), np.zeros((0, 2))), ValueError, "S >= 1"),
    (lambda: decoding.combine(np.zeros((1, 2, 3)), np.zeros((1, 2)), io=1), TypeError, "io must be"),
])
def test_decoding_and_fa1_helpers(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: softmax.merge(np.zeros(3), np.ones(3), np.zeros(4), np.ones(4)), ValueError,
     r"m_a, l_a, m_b, l_b must have broadcastable shapes, got m_a \(3,\), l_a \(3,\), m_b \(4,\)"),
    (lambda: softmax.merge(np.zeros(3), np.ones(4), 0.0, 1.0), ValueError, "broadcastable shapes"),
    (lambda: softmax.merge(0.0, -1.0, 0.0, 1.0), ValueError, "l_a must be >= 0"),
    (lambda: softmax.merge(0.0, 1.0, 0.0, np.array([1.0, -2.0])), ValueError, "l_b must be >= 0"),
    (lambda: softmax.merge("0", 1.0, 0.0, 1.0), TypeError, "m_a must be a real number or array"),
    (lambda: softmax.merge(0.0, 1.0, None, 1.0), TypeError, "m_b must be a real number.*NoneType"),
    (lambda: softmax.merge(0.0, True, 0.0, 1.0), TypeError, "l_a must be a real number.*bool"),
    (lambda: softmax.merge(0.0, 1.0, 1j, 1.0), TypeError, "m_b must be a real.*complex"),
    (lambda: softmax.lse_from_state(np.zeros(3), np.ones(4)), ValueError, "m, l must have broad"),
    (lambda: softmax.lse_from_state(0.0, -1.0), ValueError, "l must be >= 0"),
    (lambda: softmax.safe_exp_diff(np.zeros(3), np.zeros(4)), ValueError, "a, b must have broad"),
    (lambda: softmax.safe_exp_diff(0.0, "b"), TypeError, "b must be a real number or array"),
    (lambda: softmax.divide_rows(np.zeros((3, 2)), np.ones((4, 1))), ValueError, "num, l must"),
    (lambda: softmax.divide_rows("n", 1.0), TypeError, "num must be a real number or array"),
    (lambda: softmax.logsumexp(np.zeros((2, 3)), axis=5), ValueError, "non-empty axis 5"),
    (lambda: softmax.logsumexp(np.zeros((0, 3)), axis=0), ValueError, "non-empty axis 0"),
    (lambda: softmax.logsumexp(np.zeros((2, 3)), axis=1.5), TypeError, "axis must be an int"),
    (lambda: softmax.logsumexp(np.zeros((2, 3)), axis=None), TypeError, "axis must be an int"),
    (lambda: softmax.logsumexp(np.zeros((2, 3)), axis=True), TypeError, "axis must be an int"),
    (lambda: softmax.safe_softmax([True, False]), TypeError, "x must be a real number.*bool"),
    (lambda: softmax.online_state(None), TypeError, "x must be a real number.*NoneType"),
    (lambda: softmax.naive_softmax([1, 2]), TypeError, "x must be floating-point.*int"),
    (lambda: softmax.online_softmax(np.float64(1.0)), ValueError, "non-empty last axis"),
])
def test_softmax_helpers(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_softmax_helpers_still_take_scalars_lists_and_the_identity():
    m, l = softmax.merge(-np.inf, 0.0, 1.5, 2.0)         # the identity (-inf, 0)
    assert (m, l) == (1.5, 2.0)
    assert softmax.merge(0, 1, 0, 1) == (0, 2.0)          # ints are real numbers
    np.testing.assert_allclose(softmax.divide_rows([2.0, 4.0], [2.0]), [1.0, 2.0])
    np.testing.assert_allclose(softmax.logsumexp(np.zeros((2, 3)), axis=0), np.log(2) * np.ones(3))


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: masks.causal_mask(0, 2.5, 0, 3, 3, 3), TypeError, "q1 must be an int >= 0, got float"),
    (lambda: masks.causal_mask(-1, 2, 0, 3, 3, 3), ValueError, "q0 must be an int >= 0, got -1"),
    (lambda: masks.causal_mask(True, 2, 0, 3, 3, 3), TypeError, "q0 must be an int >= 0, got bool"),
    (lambda: masks.causal_mask(2, 1, 0, 3, 3, 3), ValueError, "need q0 <= q1 <= nq.*q0=2, q1=1"),
    (lambda: masks.causal_mask(0, 5, 0, 3, 3, 3), ValueError, "need q0 <= q1 <= nq.*q1=5.*nq=3"),
    (lambda: masks.causal_mask(0, 3, 0, 4, 3, 3), ValueError, "k0 <= k1 <= nk.*k1=4.*nk=3"),
    (lambda: masks.block_hidden(0, 0, 0, 3, 3), ValueError, "need q0 < q1 <= nq"),
    (lambda: masks.block_hidden(0, 2, 4, 3, 3), ValueError, "k0 <= nk.*k0=4"),
    (lambda: masks.block_hidden(0, 2.0, 0, 3, 3), TypeError, "q1 must be an int >= 0"),
    (lambda: masks.block_hidden(0, 2, 0, "3", 3), TypeError, "nq must be an int >= 0, got str"),
])
def test_mask_helpers(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_mask_helpers_take_numpy_ints():
    assert masks.causal_mask(np.int64(0), 2, 0, np.int32(3), 3, 3).shape == (2, 3)
    assert masks.block_hidden(np.int64(0), 1, 2, 3, 3) is True


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: IOCounter(sram_bytes=1.5), TypeError, "sram_bytes must be a positive int, got float"),
    (lambda: IOCounter(sram_bytes="4096"), TypeError, "sram_bytes must be a positive int, got str"),
    (lambda: IOCounter(bytes_per_element=0), ValueError, "bytes_per_element must be a positive"),
    (lambda: IOCounter().load(None), TypeError, "tile must be a NumPy array of numbers"),
    (lambda: IOCounter().load(["a"]), TypeError, "tile must be a NumPy array of numbers"),
    (lambda: IOCounter().store([0.0], 0, 1.0), TypeError, "dst must be a NumPy array"),
    (lambda: IOCounter().flops(matmul=-1), ValueError, "matmul must be an int >= 0, got -1"),
    (lambda: IOCounter().flops(other="3"), TypeError, "other must be an int >= 0, got str"),
    (lambda: IOCounter().flops(other=2.5), TypeError, "other must be an int >= 0, got float"),
    (lambda: IOCounter().sram(np.zeros((2, 2)), limit=0), ValueError, "limit must be a positive"),
    (lambda: IOCounter().sram(np.zeros((2, 2)), limit=1.5), TypeError, "limit must be a positive"),
    (lambda: IOCounter().sram(None), TypeError, "tiles must be a NumPy array of numbers"),
])
def test_io_counter(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("call,exc,msg", [
    (lambda: fa2.backward(Q, K, V, O, np.zeros(4, dtype=int), O), TypeError,
     "lse must be floating-point"),
    (lambda: fa2.backward(Q, K, V, O, np.array(["a"] * 4), O), TypeError, "lse must be floating"),
    (lambda: fa1.forward(Q, K, V, sram_bytes="4096"), TypeError, "sram_bytes must be a positive int"),
    (lambda: fa1.forward(Q, K, V, sram_bytes=True), TypeError, "sram_bytes must be a positive int"),
    (lambda: memeff.lse_first(Q, K, V, block_k=None), ValueError, "block_k is required"),
    (lambda: memeff.chunked(Q, K, V, key_chunk="4"), TypeError, "key_chunk must be a positive int"),
    (lambda: fa2.forward(Q, K, V, scale=np.array(0.5)), TypeError, "scale must be a real number"),
    (lambda: fa2.forward(Q, K, V, io=IOCounter), TypeError, "io must be a flashlib.ladder.iomodel"),
])
def test_algorithm_arguments(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def test_num_splits_beyond_the_keys_acts_as_the_number_of_keys():
    q, k, v = random_qkv(2, 5, 4, seed=3)
    for causal in (False, True):
        want = decoding.forward(q, k, v, num_splits=5, causal=causal)
        for splits in (6, 10**9):
            start = time.perf_counter()
            got = decoding.forward(q, k, v, num_splits=splits, causal=causal)
            assert time.perf_counter() - start < 5.0    # 10**9 splits are never allocated
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w)
    # the traffic counted is that of Nk splits: no empty split is written or read
    assert counted(decoding.forward, q, k, v, num_splits=10**9) == counted(
        decoding.forward, q, k, v, num_splits=5)


def test_split_bounds_keeps_its_exact_count():
    assert decoding.split_bounds(3, 5) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 3)]
    assert decoding.split_bounds(0, 2) == [(0, 0), (0, 0)]
    assert decoding.split_bounds(np.int64(10), np.int32(3)) == [(0, 3), (3, 6), (6, 10)]
