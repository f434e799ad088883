"""The float64 oracle's variants (flashlib.testing.reference): sliding windows, softcap, ALiBi, sinks and
dropout, each as flash-attn (sinks: FlashInfer, gpt-oss) defines it, checked against an independent
torch float64 implementation written from those definitions, gradients through torch's autograd."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import need_module

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlib import testing  # noqa: E402


def from_definitions(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0, slopes=None,
                     sinks=None, dropout_p=0.0, z=None):
    """Attention of torch float64 tensors (..., N, d), written from the issue's definitions."""
    nq, nk = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(nq)[:, None] + nk - nq                      # the query's diagonal key
    j = torch.arange(nk)[None, :]
    if slopes is not None:
        s = s - slopes[..., None, None] * (i - j).abs()
    left, right = window
    seen = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    s = s.masked_fill(~seen, float("-inf"))
    columns = [s] if sinks is None else [s, sinks[..., None, None].expand(*s.shape[:-1], 1)]
    lse = torch.logsumexp(torch.cat(columns, -1), -1)             # the sink joins the denominator only
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    if dropout_p:
        p = p * z / (1 - dropout_p)
    return p @ v, lse


CASES = st.fixed_dictionaries({
    "nq": st.integers(1, 9), "nk": st.integers(1, 9), "d": st.sampled_from([1, 3, 8]),
    "causal": st.booleans(), "left": st.integers(-1, 10), "right": st.integers(-1, 10),
    "softcap": st.sampled_from([0.0, 0.5, 5.0]), "alibi": st.booleans(), "sinks": st.booleans(),
    "dropout_p": st.sampled_from([0.0, 0.3]), "seed": st.integers(0, 2**16)})


def _inputs(c):
    rng = np.random.default_rng(c["seed"])
    q, k, v = (rng.standard_normal((2, 3, n, c["d"])) * 2 for n in (c["nq"], c["nk"], c["nk"]))
    kw = dict(causal=c["causal"], window_size=(c["left"], c["right"]), softcap=c["softcap"])
    if c["alibi"]:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, (2, 3))
    if c["sinks"]:
        kw["sinks"] = rng.standard_normal(3)
    if c["dropout_p"]:
        kw.update(dropout_p=c["dropout_p"], dropout_mask=rng.random((2, 3, c["nq"], c["nk"])) > c["dropout_p"])
    return q, k, v, kw


def _torch_kw(kw):
    t = {n: torch.tensor(kw[m]) for n, m in (("slopes", "alibi_slopes"), ("sinks", "sinks"), ("z", "dropout_mask"))
         if m in kw}
    return dict(causal=kw["causal"], window=kw["window_size"], softcap=kw["softcap"],
                dropout_p=kw.get("dropout_p", 0.0), **t)


@settings(max_examples=150, deadline=None)
@given(CASES)
def test_every_combination_matches_the_definitions_with_its_gradients(c):
    q, k, v, kw = _inputs(c)
    o, lse = testing.reference(q, k, v, **kw)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    tkw = _torch_kw(kw)
    if "sinks" in tkw:
        tkw["sinks"].requires_grad_(True)
    want_o, want_lse = from_definitions(*leaves, **tkw)
    testing.assert_close(o, want_o.detach(), atol=1e-12, rtol=1e-10, name="o")
    testing.assert_close(lse, want_lse.detach(), atol=1e-12, rtol=1e-10, name="lse")
    do = np.random.default_rng(c["seed"] + 1).standard_normal(o.shape)
    got = testing.reference_backward(q, k, v, do, **kw)
    want = torch.autograd.grad(want_o, leaves + ([tkw["sinks"]] if "sinks" in tkw else []),
                               torch.tensor(do), allow_unused=True)
    assert len(got) == len(want)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        g = g.sum(0) if name == "dsinks" else g                    # the oracle's is per batch
        testing.assert_close(g, w, atol=1e-10, rtol=1e-8, name=name)


def test_a_window_is_causal_when_its_right_edge_is_the_diagonal():
    q, k, v = testing.random_qkv(7, 11, 5, lead=(2,))
    for window in ((-1, 0), (100, 0)):
        for a, b in zip(testing.reference(q, k, v, window_size=window), testing.reference(q, k, v, causal=True)):
            np.testing.assert_array_equal(a, b)


def test_rows_outside_the_band_output_zero_and_minus_infinity():
    """A window that keeps row i away from every key: o = 0, lse = -inf, gradients 0, no NaN; with a
    sink the row still outputs 0 but its lse is the sink."""
    q, k, v = testing.random_qkv(6, 3, 4)
    o, lse = testing.reference(q, k, v, window_size=(0, 0))      # query i sees key i - 3 only: rows 0-2 none
    assert (o[:3] == 0).all() and np.isneginf(lse[:3]).all() and np.isfinite(lse[3:]).all()
    dq, dk, dv = testing.reference_backward(q, k, v, np.ones_like(o), window_size=(0, 0))
    assert (dq[:3] == 0).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    o, lse = testing.reference(q, k, v, window_size=(0, 0), sinks=np.array(0.7))
    assert (o[:3] == 0).all() and (lse[:3] == 0.7).all()


def test_gqa_oracle_takes_per_query_head_variants_and_sums_dsinks_over_the_batch():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 5, 8))
    k, v = rng.standard_normal((2, 2, 7, 8)), rng.standard_normal((2, 2, 7, 8))
    slopes, sinks, do = rng.uniform(0.1, 1, 4), rng.standard_normal(4), rng.standard_normal((2, 4, 5, 8))
    o, lse, grads = testing.reference_gqa(q, k, v, causal=True, do=do, alibi_slopes=slopes, sinks=sinks,
                                          window_size=(3, -1), softcap=2.0)
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    want = testing.reference(q, kk, vv, causal=True, alibi_slopes=slopes, sinks=sinks, window_size=(3, -1),
                             softcap=2.0)
    np.testing.assert_array_equal(o, want[0])
    assert len(grads) == 4 and grads[1].shape == k.shape and grads[3].shape == (4,)


@pytest.mark.parametrize("kw, error, match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size entries must be >= 0, or -1"),
    (dict(window_size=(1,)), TypeError, "window_size must be a pair of ints"),
    (dict(window_size=(1.0, 2)), TypeError, "window_size must be a pair of ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=True), TypeError, "softcap must be a float"),
    (dict(alibi_slopes=np.ones(5)), ValueError, r"alibi_slopes must broadcast to q's leading dims \(2, 3\)"),
    (dict(sinks=np.ones((4, 3))), ValueError, r"sinks must broadcast to q's leading dims \(2, 3\)"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=0.5), ValueError, "dropout_p > 0 needs dropout_mask"),
])
def test_bad_variants_are_named(kw, error, match):
    q, k, v = testing.random_qkv(4, 4, 8, lead=(2, 3))
    with pytest.raises(error, match=match):
        testing.reference(q, k, v, **kw)


@settings(max_examples=40, deadline=None)
@given(CASES)
def test_the_plain_torch_baseline_takes_the_same_variants(c):
    """plain_torch_attention (the FA rule's same-dtype baseline) in float64 is the oracle, gradients
    (dsinks included) too; per-head arguments as (H,) with GQA."""
    rng = np.random.default_rng(c["seed"])
    q = torch.tensor(rng.standard_normal((2, 4, c["nq"], c["d"])), requires_grad=True)
    k, v = (torch.tensor(rng.standard_normal((2, 2, c["nk"], c["d"])), requires_grad=True) for _ in range(2))
    kw = dict(causal=c["causal"], window_size=(c["left"], c["right"]), softcap=c["softcap"])
    if c["alibi"]:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, 4)
    if c["dropout_p"]:
        kw.update(dropout_p=c["dropout_p"], dropout_mask=rng.random((2, 4, c["nq"], c["nk"])) > c["dropout_p"])
    sinks = torch.tensor(rng.standard_normal(4), requires_grad=True) if c["sinks"] else None
    o = testing.plain_torch_attention(q, k, v, sinks=sinks, **kw)
    do = torch.tensor(rng.standard_normal(o.shape))
    want_o, _, want_g = testing.reference_gqa(q, k, v, do=do, sinks=None if sinks is None else sinks.detach(), **kw)
    testing.assert_close(o, want_o, atol=1e-12, rtol=1e-10, name="o")
    got_g = torch.autograd.grad(o, [q, k, v] + ([sinks] if sinks is not None else []), do)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g):
        testing.assert_close(g, w, atol=1e-10, rtol=1e-8, name=name)


def test_the_accuracy_standard_takes_the_variants():
    """assert_attention_right with variants: a half-precision result from the baseline itself passes (its
    error is the baseline's), one computed without the window fails, naming o."""
    rng = np.random.default_rng(1)
    q, k, v, do = (torch.tensor(rng.standard_normal((1, 2, 12, 16))).half() for _ in range(4))
    kw = dict(causal=True, window_size=(3, -1), softcap=5.0, alibi_slopes=np.array([0.2, 0.7]),
              sinks=np.array([0.1, -0.5]))
    sinks = torch.tensor(kw["sinks"]).half().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = testing.plain_torch_attention(*leaves, **{**kw, "sinks": sinks})
    grads = torch.autograd.grad(o, leaves + [sinks], do)
    testing.assert_attention_right(q, k, v, do, o=o, grads=grads, **kw)
    wrong = testing.plain_torch_attention(q, k, v, **{**kw, "window_size": (-1, -1), "sinks": sinks.detach()})
    with pytest.raises(AssertionError, match="^o"):
        testing.assert_attention_right(q, k, v, do, o=wrong, **kw)
