"""flashlib.merge_states / merge_states_many (flashlib/states.py): the one merge of attention states.
Attention over a key set equals the merge of attention over any partition of it, in any order; the
empty state is the identity; nothing is ever NaN; and the merges the book met before (ring's
merge_partials, the ladder's decoding.combine) are this one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_module

import flashlib
from flashlib import testing
from flashlib.ladder import decoding
from flashlib.parallel import ring

hypothesis = need_module("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

NEG = float("-inf")


def _state(q, k, v):
    """(o, lse) of attention of q over the keys k, v, float64, from the oracle."""
    o, lse = testing.reference(q.numpy(), k.numpy(), v.numpy())
    return torch.from_numpy(o), torch.from_numpy(lse)


def _empty(o_like):
    return torch.zeros_like(o_like), torch.full(o_like.shape[:-1], NEG, dtype=torch.float64)


@pytest.mark.parametrize("cut", [1, 4, 9])
def test_merging_the_states_of_two_key_sets_gives_attention_over_both(cut):
    g = torch.Generator().manual_seed(cut)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (5, 10, 10))
    whole = _state(q, k, v)
    a, b = _state(q, k[..., :cut, :], v[..., :cut, :]), _state(q, k[..., cut:, :], v[..., cut:, :])
    o, lse = flashlib.merge_states(*a, *b)
    torch.testing.assert_close(o, whole[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, whole[1], atol=1e-12, rtol=1e-12)


def test_the_empty_state_is_the_identity_and_two_empty_states_merge_to_empty_without_nan():
    g = torch.Generator().manual_seed(0)
    o, lse = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    e = _empty(o)
    for got in (flashlib.merge_states(o, lse, *e), flashlib.merge_states(*e, o, lse)):
        torch.testing.assert_close(got[0], o, atol=0, rtol=0)
        torch.testing.assert_close(got[1], lse, atol=0, rtol=0)
    o2, lse2 = flashlib.merge_states(*e, *e)
    assert torch.equal(o2, torch.zeros_like(o)) and torch.isneginf(lse2).all()
    o3, lse3 = flashlib.merge_states_many(torch.stack([e[0], e[0]]), torch.stack([e[1], e[1]]))
    assert torch.equal(o3, torch.zeros_like(o)) and torch.isneginf(lse3).all()


def test_half_precision_states_merge_in_float32_and_keep_their_dtype():
    g = torch.Generator().manual_seed(1)
    o = torch.randn(2, 3, 5, 8, generator=g).half()
    lse = torch.randn(2, 3, 5, generator=g)
    om, lm = flashlib.merge_states(o, lse, o, lse)
    assert om.dtype == torch.float16 and lm.dtype == torch.float32
    torch.testing.assert_close(om, o, atol=1e-3, rtol=1e-3)                  # a state merged with itself
    torch.testing.assert_close(lm, lse + np.log(2.0), atol=1e-6, rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(0, 3), st.integers(0, 2 ** 16))
def test_merge_is_associative_and_commutative_and_merge_many_is_any_fold(n_states, n_empty, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 4)
    states = [(torch.randn(*shape, 5, generator=g, dtype=torch.float64),
               torch.randn(*shape, generator=g, dtype=torch.float64) * 4) for _ in range(n_states)]
    states += [_empty(states[0][0]) for _ in range(n_empty)]
    order = torch.randperm(len(states), generator=g).tolist()
    folded = states[order[0]]
    for i in order[1:]:
        folded = flashlib.merge_states(*folded, *states[i])
    right = states[-1]
    for s in reversed(states[:-1]):                     # the other association: s · (rest)
        right = flashlib.merge_states(*s, *right)
    many = flashlib.merge_states_many(torch.stack([s[0] for s in states]), torch.stack([s[1] for s in states]))
    for other in (right, many):
        torch.testing.assert_close(other[0], folded[0], atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(other[1], folded[1], atol=1e-12, rtol=1e-10)
    assert not torch.isnan(folded[0]).any()


def test_ring_merge_partials_and_the_ladders_decode_combine_are_this_merge():
    g = torch.Generator().manual_seed(2)
    o = torch.randn(2, 3, 4, 7, 8, generator=g, dtype=torch.float64)        # (S, B, H, N, d)
    lse = torch.randn(2, 3, 4, 7, generator=g, dtype=torch.float64)
    lse[0, 0, 0, 0] = NEG
    want = flashlib.merge_states(o[0], lse[0], o[1], lse[1])
    got = ring.merge_partials(o[0], lse[0], o[1], lse[1])
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    o_c, lse_c = decoding.combine(o.numpy(), lse.numpy())
    np.testing.assert_allclose(o_c, want[0].numpy(), atol=1e-12)
    np.testing.assert_allclose(lse_c, want[1].numpy(), atol=1e-12)


@pytest.mark.parametrize("args, error, words", [
    ((np.zeros((2, 3)), torch.zeros(2), torch.zeros(2, 3), torch.zeros(2)), TypeError, "o_a must be a torch.Tensor"),
    ((torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3), torch.zeros(2)), ValueError, "lse_a must have shape (2,)"),
    ((torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 4), torch.zeros(2)), ValueError, "o_b must have the shape"),
    ((torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2), torch.zeros(2, 3), torch.zeros(2)), TypeError,
     "o_a must be a floating-point"),
])
def test_bad_states_are_refused_by_name(args, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        flashlib.merge_states(*args)
    with pytest.raises(ValueError, match="at least 2 dims"):
        flashlib.merge_states_many(torch.zeros(3), torch.zeros(()))
