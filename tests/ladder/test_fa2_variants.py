"""flashlib.ladder.fa2 with the variants real models use (sliding window, softcap, ALiBi, sinks,
dropout) against the float64 oracle, alone and combined, on the adversarial shapes; the tiles it visits
are exactly those tile_class does not call empty; rows that see nothing; dropout's statistics and
determinism; Hypothesis over every combination; bad arguments refused naming them."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import need_module  # noqa: E402

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlib.ladder import fa2  # noqa: E402
from flashlib.ladder.dropout import keep_mask  # noqa: E402
from flashlib.ladder.iomodel import IOCounter  # noqa: E402
from flashlib.ladder.masks import tile_class  # noqa: E402
from flashlib.testing import (ADVERSARIAL_SHAPES, assert_close, random_qkv, reference,  # noqa: E402
                              reference_backward)

LEAD = (2, 3)
SLOPES = np.array([0.05, 0.3, 1.0])                        # (H,): broadcast over the batch
SINKS = np.array([[0.5, -1.0, 2.0], [3.0, 0.0, -0.5]])    # (B, H)
VARIANTS = {
    "window": dict(window_size=(4, 3)),
    "window_left": dict(window_size=(5, -1)),
    "window_right": dict(window_size=(-1, 2)),
    "window_causal": dict(window_size=(6, 0), causal=True),
    "causal": dict(causal=True),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=SLOPES),
    "sinks": dict(sinks=SINKS),
    "dropout": dict(dropout_p=0.25),
    "all": dict(window_size=(7, 2), causal=True, softcap=3.0, alibi_slopes=SLOPES, sinks=SINKS,
                dropout_p=0.4),
    "all_but_dropout": dict(window_size=(3, 5), softcap=0.7, alibi_slopes=SLOPES[None].repeat(2, 0),
                            sinks=SINKS),
}
SEED = (1234, 5678)
TOL = dict(atol=1e-11, rtol=1e-10)


def _ladder_kw(kw):
    return dict(kw, dropout_seed=SEED) if kw.get("dropout_p") else kw


def _oracle_kw(kw, shape):
    """The oracle's arguments: dropout through the keep mask Z of the same seed and offset."""
    if not kw.get("dropout_p"):
        return kw
    return dict(kw, dropout_mask=keep_mask(*SEED, shape, kw["dropout_p"]))


def _check(q, k, v, do, kw, br, bc):
    shape = (*q.shape[:-1], k.shape[-2])
    o, lse = fa2.forward(q, k, v, block_q=br, block_k=bc, **_ladder_kw(kw))
    o_ref, lse_ref = reference(q, k, v, **_oracle_kw(kw, shape))
    assert_close(o, o_ref, name="o", **TOL)
    assert_close(lse, lse_ref, name="lse", **TOL)
    grads = fa2.backward(q, k, v, o, lse, do, block_q=br, block_k=bc, **_ladder_kw(kw))
    want = reference_backward(q, k, v, do, **_oracle_kw(kw, shape))
    assert len(grads) == len(want) == (4 if "sinks" in kw else 3)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert g.shape == w.shape, name
        assert_close(g, w, name=name, **TOL)
    return o, lse, grads


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", ADVERSARIAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_each_variant_against_the_oracle_on_adversarial_shapes(variant, shape):
    nq, nk, d = shape
    q, k, v = random_qkv(nq, nk, d, lead=LEAD, dv=d + 3, seed=nq + 7 * nk)
    do = np.random.default_rng(nq).standard_normal((*LEAD, nq, d + 3))
    _check(q, k, v, do, VARIANTS[variant], 7, 5)


@pytest.mark.parametrize("br,bc", [(1, 1), (4, 16), (16, 3), (64, 64)])
def test_variants_with_blocks_that_divide_nothing_or_everything(br, bc):
    q, k, v = random_qkv(19, 23, 6, lead=LEAD, seed=3)
    do = np.ones((*LEAD, 19, 6))
    for kw in VARIANTS.values():
        _check(q, k, v, do, kw, br, bc)


@pytest.mark.parametrize("nq,nk", [(9, 9), (5, 17), (17, 5), (1, 12), (12, 1)])
@pytest.mark.parametrize("br,bc", [(2, 3), (4, 4), (5, 2)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (2, 1)),
                                           (True, (3, 0)), (False, (0, -1)), (False, (-1, 0)),
                                           (False, (1, 1)), (True, (30, 30))])
def test_forward_and_backward_visit_exactly_the_tiles_that_are_not_empty(nq, nk, br, bc, causal,
                                                                         window):
    q, k, v = random_qkv(nq, nk, 4)
    want = sorted((i, j) for i in range(0, nq, br) for j in range(0, nk, bc)
                  if tile_class(i, min(i + br, nq), j, min(j + bc, nk), nq, nk, causal,
                                window) != "empty")
    fwd, bwd = IOCounter(), IOCounter()
    o, lse = fa2.forward(q, k, v, causal=causal, window_size=window, block_q=br, block_k=bc,
                         io=fwd)
    fa2.backward(q, k, v, o, lse, np.ones_like(o), causal=causal, window_size=window, block_q=br,
                 block_k=bc, io=bwd)
    assert sorted(fwd.tiles) == sorted(bwd.tiles) == want
    assert len(set(fwd.tiles)) == len(fwd.tiles)                   # each tile once
    # the forward reads K/V once per visited tile, nothing for a skipped one
    kv_rows = sum(min(j + bc, nk) - j for _, j in want)
    q_reads = nq * 4
    assert fwd.hbm_read_bytes == 2 * (q_reads + 2 * 4 * kv_rows)


def test_a_window_visits_about_n_w_tiles_not_n_squared():
    n, w, b = 256, 16, 16
    q, k, v = random_qkv(n, n, 4)
    io = IOCounter()
    fa2.forward(q, k, v, causal=True, window_size=(w, 0), block_q=b, block_k=b, io=io)
    tiles = (n // b) ** 2
    assert len(io.tiles) == (n // b) * 2 - 1                      # the diagonal tile and one before
    assert len(io.tiles) < tiles / 7


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(0, 0)), dict(window_size=(-1, 0)),
                                dict(window_size=(2, 0), softcap=2.0, alibi_slopes=SLOPES)])
@pytest.mark.parametrize("sinks", [None, SINKS])
def test_rows_that_see_nothing_output_zero_and_lse_minus_inf_or_the_sink(kw, sinks):
    nq, nk = 9, 3                                  # off = -6: the first rows see no key
    q, k, v = random_qkv(nq, nk, 5, lead=LEAD, seed=2)
    kw = dict(kw, **({} if sinks is None else {"sinks": sinks}))
    o, lse = fa2.forward(q, k, v, block_q=2, block_k=2, **kw)
    nothing = np.isneginf(reference(q, k, v, **dict(kw, sinks=None))[1][0, 0])
    assert nothing[:5].all() and not nothing[-1]
    assert (o[..., nothing, :] == 0).all()
    empty_lse = -np.inf if sinks is None else np.broadcast_to(sinks[..., None], lse.shape)
    np.testing.assert_array_equal(lse[..., nothing], np.broadcast_to(empty_lse, lse.shape)[..., nothing])
    grads = fa2.backward(q, k, v, o, lse, np.ones_like(o), block_q=2, block_k=2, **kw)
    assert all(np.isfinite(g).all() for g in grads)
    assert (grads[0][..., nothing, :] == 0).all()
    _check(q, k, v, np.ones_like(o), kw, 2, 2)


def test_a_window_past_the_whole_sequence_sees_nothing_anywhere():
    q, k, v = random_qkv(4, 6, 3, lead=LEAD, seed=4)
    kw = dict(window_size=(0, -1), causal=True)           # j >= i + 2 and j <= i + 2: the diagonal
    _check(q, k, v, np.ones((*LEAD, 4, 3)), kw, 3, 4)
    # Nq > Nk and a window that ends before key 0 for every row: all rows see nothing
    q, k, v = random_qkv(6, 2, 3, seed=5)
    io = IOCounter()
    o, lse = fa2.forward(q, k, v, window_size=(0, 0), block_q=2, block_k=1, io=io)
    assert io.tiles == [(4, 0), (4, 1)] and (o[:4] == 0).all() and np.isneginf(lse[:4]).all()
    _check(q, k, v, np.ones((6, 3)), dict(window_size=(1, 0)), 2, 1)


def test_nan_behind_the_window_changes_nothing():
    q, k, v = random_qkv(8, 8, 4, seed=6)
    k[0, :], v[0, :] = np.nan, np.nan                       # key 0: outside row 7's window
    o, lse = fa2.forward(q, k, v, window_size=(2, 0), block_q=3, block_k=3)
    o_ref, lse_ref = reference(q, k, v, window_size=(2, 0))
    assert np.isnan(o[:3]).all() and np.isfinite(o[3:]).all()
    assert_close(o[3:], o_ref[3:], **TOL)
    assert_close(lse[3:], lse_ref[3:], **TOL)


def test_lower_precision_inputs_keep_their_dtype_and_accuracy():
    q, k, v = random_qkv(21, 30, 8, lead=LEAD, seed=8, dtype=np.float32)
    kw = VARIANTS["all"]
    o, lse = fa2.forward(q, k, v, block_q=8, block_k=8, **_ladder_kw(kw))
    assert o.dtype == np.float32 and lse.dtype == np.float32
    o_ref, lse_ref = reference(q, k, v, **_oracle_kw(kw, (*LEAD, 21, 30)))
    assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    assert_close(lse, lse_ref, atol=2e-5, rtol=1e-4)
    grads = fa2.backward(q, k, v, o, lse, np.ones_like(o), block_q=8, block_k=8, **_ladder_kw(kw))
    assert [g.dtype for g in grads[:3]] == [np.float32] * 3
    o16, _ = fa2.forward(*(x.astype(np.float16) for x in (q, k, v)), softcap=2.0, window_size=(3, 3))
    assert o16.dtype == np.float16 and np.isfinite(o16).all()


def test_softcap_caps_the_scores_and_alibi_prefers_near_keys():
    q, k, v = random_qkv(1, 6, 4, seed=9)
    q, k = 100 * q, 100 * k                             # huge scores
    _, lse = fa2.forward(q, k, v, softcap=1.0)
    assert lse[0] <= 1.0 + np.log(6) + 1e-12          # every capped score <= 1
    o, _ = fa2.forward(np.zeros((1, 4)), np.zeros((6, 4)), np.arange(6.0)[:, None], alibi_slopes=5.0)
    assert o[0, 0] > 4.9                               # the last key (distance 0) dominates


# ---- dropout: the mask is flashlib.ladder.dropout's; statistics; determinism ----

def test_dropout_uses_the_keep_mask_of_its_seed_and_offset_bit_for_bit():
    q, k, v = random_qkv(7, 9, 4, lead=LEAD, seed=10)
    a = fa2.forward(q, k, v, dropout_p=0.5, dropout_seed=(3, 100), block_q=3, block_k=4)
    b = fa2.forward(q, k, v, dropout_p=0.5, dropout_seed=(3, 100), block_q=5, block_k=2)
    c = fa2.forward(q, k, v, dropout_p=0.5, dropout_seed=(3, 100))
    np.testing.assert_array_equal(a[0], fa2.forward(q, k, v, dropout_p=0.5, dropout_seed=(3, 100),
                                                    block_q=3, block_k=4)[0])   # bitwise
    assert_close(a[0], b[0], **TOL)                                      # the blocks do not matter
    assert_close(a[0], c[0], **TOL)
    np.testing.assert_array_equal(a[1], fa2.forward(q, k, v, block_q=3, block_k=4)[1])  # undropped
    d = fa2.forward(q, k, v, dropout_p=0.5, dropout_seed=(3, 101))[0]
    e = fa2.forward(q, k, v, dropout_p=0.5, dropout_seed=(4, 100))[0]
    assert not np.allclose(a[0], d) and not np.allclose(a[0], e)


def test_dropout_statistics_kept_fraction_and_expected_output():
    q, k, v = random_qkv(16, 16, 8, seed=11)
    p = 0.3
    z = keep_mask(5, 0, (400, 16, 16), p)
    assert abs(z.mean() - (1 - p)) < 4 * np.sqrt(p * (1 - p) / z.size)
    # E[o] over seeds is the undropped output (P Z / (1 - p) has mean P)
    outs = np.stack([fa2.forward(q, k, v, dropout_p=p, dropout_seed=(5, 256 * s))[0]
                     for s in range(400)])
    o, _ = fa2.forward(q, k, v)
    stderr = outs.std(axis=0) / np.sqrt(len(outs))
    assert (np.abs(outs.mean(axis=0) - o) < 5 * stderr + 1e-12).all()


# ---- Hypothesis over every combination ----

CASES = st.fixed_dictionaries({
    "nq": st.integers(1, 12), "nk": st.integers(1, 12), "d": st.sampled_from([1, 3, 8]),
    "br": st.integers(1, 7), "bc": st.integers(1, 7), "causal": st.booleans(),
    "left": st.integers(-1, 12), "right": st.integers(-1, 12),
    "softcap": st.sampled_from([0.0, 0.5, 5.0]), "alibi": st.sampled_from([None, "h", "bh"]),
    "sinks": st.booleans(), "dropout_p": st.sampled_from([0.0, 0.3, 0.9]),
    "seed": st.integers(0, 2 ** 16)})


@settings(max_examples=120, deadline=None)
@given(c=CASES)
def test_every_combination_of_variants_matches_the_oracle(c):
    rng = np.random.default_rng(c["seed"])
    q, k, v = (2 * rng.standard_normal((*LEAD, n, c["d"])) for n in (c["nq"], c["nk"], c["nk"]))
    kw = dict(causal=c["causal"], window_size=(c["left"], c["right"]), softcap=c["softcap"])
    if c["alibi"]:
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, LEAD if c["alibi"] == "bh" else LEAD[1:])
    if c["sinks"]:
        kw["sinks"] = rng.standard_normal(LEAD[1:])
    if c["dropout_p"]:
        kw["dropout_p"] = c["dropout_p"]
    do = rng.standard_normal((*LEAD, c["nq"], c["d"]))
    _check(q, k, v, do, kw, c["br"], c["bc"])


# ---- bad arguments ----

Q, K, V = random_qkv(4, 6, 3, lead=(2,))


@pytest.mark.parametrize("kw,exc,match", [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=(1,)), TypeError, "window_size"),
    (dict(window_size=(1.0, 2)), TypeError, "window_size"),
    (dict(window_size=(True, 2)), TypeError, "window_size"),
    (dict(window_size="(1, 2)"), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.array([np.nan])), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.array([1j])), TypeError, "alibi_slopes"),
    (dict(alibi_slopes="slopes"), TypeError, "alibi_slopes"),
    (dict(sinks=np.ones((2, 2))), ValueError, "sinks"),
    (dict(sinks=np.array([True, False])), TypeError, "sinks"),
    (dict(sinks=np.array([np.inf, 0])), ValueError, "sinks"),
    (dict(dropout_p=1.0, dropout_seed=(1, 2)), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(dropout_p="0.1"), TypeError, "dropout_p"),
    (dict(dropout_p=0.1), ValueError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=5), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=(1.0, 2)), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=(-1, 2)), ValueError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=(1, 2 ** 62)), ValueError, "dropout_seed"),
])
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_bad_variant_arguments_are_refused_naming_them(kw, exc, match, which):
    with pytest.raises(exc, match=match):
        if which == "forward":
            fa2.forward(Q, K, V, **kw)
        else:
            fa2.backward(Q, K, V, np.zeros_like(Q), np.zeros(Q.shape[:-1]), np.zeros_like(Q), **kw)


def test_torch_tensors_as_per_head_arguments_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="sinks"):
        fa2.forward(Q, K, V, sinks=torch.zeros(2))


def test_defaults_compute_exactly_what_they_did_without_variants():
    q, k, v = random_qkv(13, 17, 8, lead=LEAD, seed=12)
    for causal, (br, bc) in itertools.product([False, True], [(4, 5), (64, 64)]):
        a = fa2.forward(q, k, v, causal=causal, block_q=br, block_k=bc)
        b = fa2.forward(q, k, v, causal=causal, block_q=br, block_k=bc, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                        dropout_seed=(1, 1))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
