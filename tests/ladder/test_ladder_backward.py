"""naive.backward and fa2.backward against the analytic float64 gradient and torch autograd."""
import numpy as np
import pytest
import torch
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings, strategies as st

from flashlib.ladder import fa2, naive
from flashlib.testing import (ADVERSARIAL_SHAPES, assert_close, random_qkv, reference,
                              reference_backward)


def _grads(name, q, k, v, o, lse, do, causal, bq=6, bk=9):
    if name == "naive":
        return naive.backward(q, k, v, o, do, causal=causal)
    return fa2.backward(q, k, v, o, lse, do, causal=causal, block_q=bq, block_k=bk)


def _torch_grads(q, k, v, do, causal, scale=None):
    """torch autograd through a plain masked-softmax attention in float64 (an independent spec)."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * tq @ tk.transpose(-1, -2)
    if causal:
        nq, nk = q.shape[-2], k.shape[-2]
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        s = s.masked_fill(j > i + nk - nq, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)       # all -inf rows: softmax gives NaN; define 0
    (p @ tv).backward(torch.tensor(do))
    return tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.parametrize("name", ["naive", "fa2"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", ADVERSARIAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_against_analytic_and_autograd(name, causal, shape):
    nq, nk, d = shape
    q, k, v = random_qkv(nq, nk, d, lead=(2,), seed=nq + 7 * nk)
    o, lse = reference(q, k, v, causal=causal)
    do = np.random.default_rng(1).standard_normal(o.shape)
    got = _grads(name, q, k, v, o, lse, do, causal)
    want = reference_backward(q, k, v, do, causal=causal)
    auto = _torch_grads(q, k, v, do, causal)
    for g, w, a, n in zip(got, want, auto, ("dq", "dk", "dv")):
        assert g.shape == w.shape
        assert_close(g, w, atol=1e-11, rtol=1e-9, name=f"{name} {n} vs analytic")
        assert_close(g, a, atol=1e-11, rtol=1e-9, name=f"{name} {n} vs autograd")


@pytest.mark.parametrize("name", ["naive", "fa2"])
def test_fully_masked_rows_give_zero_gradients_not_nan(name):
    q, k, v = random_qkv(8, 3, 5, seed=2)                # causal: the first 5 queries see nothing
    o, lse = reference(q, k, v, causal=True)
    do = np.ones_like(o)
    dq, dk, dv = _grads(name, q, k, v, o, lse, do, True, bq=3, bk=2)
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()
    np.testing.assert_array_equal(dq[:5], 0.0)


def test_fa2_backward_uses_its_arguments():
    # A different lse must change the result: the backward really recomputes P from the saved LSE.
    q, k, v = random_qkv(7, 9, 4, seed=3)
    o, lse = reference(q, k, v)
    do = np.ones_like(o)
    dq1, _, _ = fa2.backward(q, k, v, o, lse, do)
    dq2, _, _ = fa2.backward(q, k, v, o, lse + 0.5, do)
    assert not np.allclose(dq1, dq2)


def test_scale_in_backward():
    q, k, v = random_qkv(6, 10, 3, seed=4)
    o, lse = reference(q, k, v, scale=0.7)
    do = np.random.default_rng(0).standard_normal(o.shape)
    want = reference_backward(q, k, v, do, scale=0.7)
    auto = _torch_grads(q, k, v, do, False, scale=0.7)
    for name in ("naive", "fa2"):
        got = (naive.backward(q, k, v, o, do, scale=0.7) if name == "naive"
               else fa2.backward(q, k, v, o, lse, do, scale=0.7, block_q=4, block_k=3))
        for g, w, a in zip(got, want, auto):
            assert_close(g, w, atol=1e-12, rtol=1e-10)
            assert_close(g, a, atol=1e-12, rtol=1e-10)


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 30), nk=st.integers(1, 30), d=st.integers(1, 16), causal=st.booleans(),
       bq=st.integers(1, 40), bk=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_property_fa2_backward(nq, nk, d, causal, bq, bk, seed):
    q, k, v = random_qkv(nq, nk, d, lead=(2,), seed=seed)
    o, lse = reference(q, k, v, causal=causal)
    do = np.random.default_rng(seed).standard_normal(o.shape)
    got = fa2.backward(q, k, v, o, lse, do, causal=causal, block_q=bq, block_k=bk)
    for g, w in zip(got, reference_backward(q, k, v, do, causal=causal)):
        assert_close(g, w, atol=1e-10, rtol=1e-8)
