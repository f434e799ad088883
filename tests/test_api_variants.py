"""The attention variants through flashlib's public API (flashlib.attention, attention_qkvpacked, decode,
dropout_mask): the arguments travel from the API through the ops (eager, autograd Function, custom op,
torch.compile) to the backend, are refused by name where wrong or where a backend lacks them, and give
the float64 oracle's answer on the "reference" backend (the Triton kernels' own tests are in
tests/kernels/triton/test_triton_variants_*.py). Gradients: torch.autograd.gradcheck in float64, sinks
and dropout included (a fixed seed makes dropout a function)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from api_cases import make_qkv
from conftest import need_module

import flashlib
from flashlib import backends, testing
from flashlib.backends import Backend

VARIANTS = [
    dict(window_size=(3, 0)),
    dict(window_size=(2, 5)),
    dict(window_size=(0, 0)),                          # the diagonal only
    dict(window_size=(40, 40)),                        # wider than the sequence: dense
    dict(softcap=2.0),
    dict(alibi_slopes="H"),
    dict(alibi_slopes="BH"),
    dict(sinks=True),
    dict(window_size=(4, 1), softcap=1.5, alibi_slopes="H", sinks=True),
]


def _materialise(variants, B, H, seed=0):
    """Replace the placeholders of VARIANTS with float32 tensors."""
    g = torch.Generator().manual_seed(seed)
    out = dict(variants)
    if out.get("alibi_slopes") == "H":
        out["alibi_slopes"] = torch.rand(H, generator=g, dtype=torch.float32)
    elif out.get("alibi_slopes") == "BH":
        out["alibi_slopes"] = torch.rand(B, H, generator=g, dtype=torch.float32)
    if out.get("sinks") is True:
        out["sinks"] = torch.randn(H, generator=g, dtype=torch.float32)
    return out


def _oracle_kw(variants):
    """The oracle's keywords: NumPy float64 slopes and sinks."""
    out = dict(variants)
    for name in ("alibi_slopes", "sinks"):
        if out.get(name) is not None:
            out[name] = out[name].detach().double().numpy()
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variants", VARIANTS, ids=str)
@pytest.mark.parametrize("nq, nk", [(13, 21), (21, 13), (1, 9)])
def test_reference_backend_gives_the_oracle(variants, causal, nq, nk):
    q, k, v = make_qkv(B=2, H=4, HKV=2, NQ=nq, NK=nk, D=24)
    kw = _materialise(variants, 2, 4)
    o, lse = flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="reference",
                                block_q=8, block_k=8, **kw)
    o_ref, lse_ref = testing.reference_gqa(q, k, v, causal=causal, **_oracle_kw(kw))
    testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12, name="o")
    testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12, name="lse")
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()


def test_a_row_outside_every_window_outputs_zero_and_lse_minus_inf_or_the_sink():
    q, k, v = make_qkv(B=1, H=2, HKV=1, NQ=6, NK=4, D=8)
    # window (0, 0) with Nq > Nk: the first Nq - Nk queries sit before key 0 and see nothing
    o, lse = flashlib.attention(q, k, v, window_size=(0, 0), return_lse=True, backend="reference")
    assert (o[:, :, :2] == 0).all() and torch.isneginf(lse[:, :, :2]).all()
    sinks = torch.tensor([0.5, -1.0])
    o, lse = flashlib.attention(q, k, v, window_size=(0, 0), sinks=sinks, return_lse=True,
                                backend="reference")
    assert (o[:, :, :2] == 0).all()
    torch.testing.assert_close(lse[0, :, :2], sinks.double()[:, None].expand(2, 2))


@pytest.mark.parametrize("variants", [dict(window_size=(3, 1), softcap=1.5, alibi_slopes="BH"),
                                      dict(sinks=True, window_size=(2, -1)), dict(dropout_p=0.3)], ids=str)
def test_gradcheck_float64_through_every_way(variants):
    """torch.autograd.gradcheck of flashlib.attention on the reference backend, with every variant, in
    float64 (the eager autograd Function; the custom op's way is checked under torch.compile below).
    Dropout with a fixed seed is a function."""
    q, k, v = make_qkv(B=1, H=2, HKV=1, NQ=5, NK=7, D=4, grad=True)
    kw = _materialise(variants, 1, 2)
    if "dropout_p" in kw:
        kw["dropout_seed"] = (1234, 77)
    inputs = [q, k, v]
    if kw.get("sinks") is not None:
        inputs.append(kw.pop("sinks").double().requires_grad_())     # float64 inputs: float64 sinks

        def f(q, k, v, s):
            return flashlib.attention(q, k, v, causal=True, sinks=s, backend="reference", **kw)
    else:
        def f(q, k, v):
            return flashlib.attention(q, k, v, causal=True, backend="reference", **kw)
    assert torch.autograd.gradcheck(f, tuple(inputs), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_sinks_gradient_is_the_oracle_on_the_function_and_the_op():
    q, k, v = make_qkv(B=2, H=4, HKV=2, NQ=7, NK=9, D=8, grad=True)
    sinks = torch.randn(4, dtype=torch.float32, requires_grad=True)
    do = torch.randn_like(q)
    o = flashlib.attention(q, k, v, causal=True, sinks=sinks, backend="reference")
    o.backward(do)
    *_, grads = testing.reference_gqa(q, k, v, causal=True, do=do, sinks=sinks.detach().double().numpy())
    testing.assert_close(sinks.grad, grads[3], atol=1e-5, rtol=1e-5, name="dsinks")
    testing.assert_close(q.grad, grads[0], atol=1e-12, rtol=1e-12, name="dq")
    got = sinks.grad.clone()
    sinks.grad = None
    f = torch.compile(lambda q, k, v, s: flashlib.attention(q, k, v, causal=True, sinks=s,
                                                            backend="reference"), backend="eager")
    f(q, k, v, sinks).backward(do)
    torch.testing.assert_close(sinks.grad, got)


def test_sinks_alone_require_grad_and_get_it():
    """Only the sinks need a gradient: the call must still go through autograd."""
    q, k, v = make_qkv(B=1, H=2, HKV=2, NQ=4, NK=4, D=8)
    sinks = torch.zeros(2, requires_grad=True)
    flashlib.attention(q, k, v, sinks=sinks, backend="reference").sum().backward()
    assert sinks.grad is not None and (sinks.grad != 0).all()


def test_dropout_is_reproducible_and_its_mask_is_the_one_applied():
    q, k, v = make_qkv(B=2, H=2, HKV=1, NQ=9, NK=11, D=8)
    torch.manual_seed(5)
    a = flashlib.attention(q, k, v, dropout_p=0.25, backend="reference")
    torch.manual_seed(5)
    b = flashlib.attention(q, k, v, dropout_p=0.25, backend="reference")
    assert torch.equal(a, b)                                # torch.manual_seed reproduces a call
    c = flashlib.attention(q, k, v, dropout_p=0.25, backend="reference")
    assert not torch.equal(a, c)                            # a new call, new numbers
    seed = (2 ** 62 + 3, 12345)
    o = flashlib.attention(q, k, v, dropout_p=0.25, dropout_seed=seed, backend="reference")
    z = flashlib.dropout_mask(q, k, 0.25, seed)
    assert z.shape == (2, 2, 9, 11) and z.dtype == torch.bool
    o_ref, _ = testing.reference_gqa(q, k, v, dropout_p=0.25, dropout_mask=z.numpy())
    testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12, name="o")


def test_dropout_keeps_one_minus_p_and_is_unbiased():
    """The kept fraction within 5 standard deviations of 1 - p over 4.6e5 draws, and the mean of o
    over many seeds within 5 standard errors of the undropped o."""
    q, k, v = make_qkv(B=1, H=1, HKV=1, NQ=24, NK=40, D=8)
    p = 0.3
    z = flashlib.dropout_mask(q.expand(2, 8, 24, 8), k.expand(2, 8, 40, 8), p, (7, 0)).double()
    n = z.numel() * 6
    kept = torch.cat([z.flatten()] + [flashlib.dropout_mask(q.expand(2, 8, 24, 8), k.expand(2, 8, 40, 8), p,
                                                             (7 + s, s * 10 ** 6)).double().flatten()
                                      for s in range(1, 6)]).mean()
    assert abs(kept - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n), float(kept)
    exact = flashlib.attention(q, k, v, backend="reference")
    runs = torch.stack([flashlib.attention(q, k, v, dropout_p=p, dropout_seed=(s, 0), backend="reference")
                        for s in range(300)])
    err = (runs.mean(0) - exact).abs()
    assert (err <= 5 * runs.std(0) / np.sqrt(300) + 1e-12).all(), float(err.max())


@pytest.mark.parametrize("bad, kind, words", [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size=3), TypeError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap="50"), TypeError, "softcap"),
    (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.float16)), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes"),
    (dict(sinks=torch.ones(2, 4)), ValueError, "sinks"),
    (dict(sinks=torch.ones(4, dtype=torch.float16)), TypeError, "sinks"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p"),
    (dict(dropout_p=0.1, dropout_seed=(1, 2, 3)), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=(-1, 0)), ValueError, "dropout_seed"),
])
def test_bad_variants_are_refused_by_name(bad, kind, words):
    q, k, v = make_qkv(B=2, H=4, HKV=2, NQ=3, NK=3, D=8)
    with pytest.raises(kind, match=words):
        flashlib.attention(q, k, v, backend="reference", **bad)


def test_meta_device_slopes_are_refused_naming_the_device():
    q, k, v = make_qkv(B=1, H=2, HKV=2, NQ=3, NK=3, D=8)
    with pytest.raises(ValueError, match="alibi_slopes must be on the device"):
        flashlib.attention(q, k, v, alibi_slopes=torch.ones(2, device="meta"))


def test_decode_refuses_dropout():
    q, k, v = make_qkv(B=1, H=2, HKV=2, NQ=1, NK=5, D=8)
    with pytest.raises(ValueError, match="dropout_p"):
        flashlib.decode(q, k, v, dropout_p=0.1)


def test_a_backend_without_the_variant_is_refused_by_name_and_auto_passes_it_over():
    q, k, v = make_qkv(B=1, H=2, HKV=2, NQ=3, NK=3, D=8)
    with pytest.raises(ValueError, match=r"backend='cuda' does not compute softcap"):
        flashlib.attention(q, k, v, softcap=5.0, backend="cuda")
    with pytest.raises(ValueError, match=r"backend='cuda' does not compute window_size"):
        flashlib.decode(q, k, v, window_size=(2, 0), backend="cuda")
    ref = backends.BACKENDS["reference"]
    plain = Backend("plain", ref.forward, ref.backward, ref.decode, ref.check)     # no variants declared
    with backends.registered(plain):
        before = dict(backends.AUTO)
        backends.AUTO["cpu"] = "plain"
        try:
            with pytest.warns(RuntimeWarning, match="does not compute sinks"):
                o = flashlib.attention(q, k, v, sinks=torch.zeros(2))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                flashlib.attention(q, k, v)                   # no variant: the plain backend, silently
        finally:
            backends.AUTO.clear()
            backends.AUTO.update(before)
    o_ref, _ = testing.reference_gqa(q, k, v, sinks=np.zeros(2))
    testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12, name="o")


def test_a_backend_is_passed_only_the_variants_in_use():
    seen = []
    ref = backends.BACKENDS["reference"]

    def forward(q, k, v, **kw):
        seen.append(sorted(kw))
        return ref.forward(q, k, v, **kw)
    spy = Backend("spy", forward, ref.backward, ref.decode, ref.check,
                  variants={"attention": frozenset({"softcap", "dropout_p"})})
    q, k, v = make_qkv(B=1, H=2, HKV=2, NQ=3, NK=3, D=8)
    with backends.registered(spy):
        flashlib.attention(q, k, v, backend="spy")
        flashlib.attention(q, k, v, backend="spy", softcap=3.0, dropout_p=0.5)
    assert seen[0] == ["allow_tf32", "blocks", "causal", "scale"]
    assert seen[1] == ["allow_tf32", "blocks", "causal", "dropout_p", "dropout_seed", "scale", "softcap"]


@pytest.mark.parametrize("variants", [dict(window_size=(3, -1)), dict(softcap=1.0, alibi_slopes="H"),
                                      dict(sinks=True), dict(window_size=(0, 2), sinks=True,
                                                             alibi_slopes="BH")], ids=str)
def test_decode_variants_are_the_oracle_per_sequence(variants):
    B, H, HKV, NQ, NMAX = 3, 4, 2, 2, 11
    q, k, v = make_qkv(B=B, H=H, HKV=HKV, NQ=NQ, NK=NMAX, D=8)
    lens = torch.tensor([11, 0, 5])
    kw = _materialise(variants, B, H)
    o, lse = flashlib.decode(q, k, v, cache_seqlens=lens, num_splits=3, return_lse=True,
                             backend="reference", **kw)
    for b, n in enumerate(lens.tolist()):
        ob = _oracle_kw(kw)
        if ob.get("alibi_slopes") is not None and ob["alibi_slopes"].ndim == 2:
            ob["alibi_slopes"] = ob["alibi_slopes"][b]
        if n == 0:
            assert (o[b] == 0).all()
            want = (torch.from_numpy(ob["sinks"])[:, None].expand(H, NQ) if "sinks" in ob
                    else torch.full((H, NQ), -np.inf, dtype=torch.float64))
            torch.testing.assert_close(lse[b], want)
            continue
        o_ref, lse_ref = testing.reference_gqa(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], **ob)
        testing.assert_close(o[b:b + 1], o_ref, atol=1e-12, rtol=1e-12, name="o")
        testing.assert_close(lse[b:b + 1], lse_ref, atol=1e-12, rtol=1e-12, name="lse")


def test_decode_splits_count_the_band_not_the_cache():
    q, k, _ = make_qkv(B=1, H=2, HKV=2, NQ=1, NK=4096, D=8, dtype=torch.float32)
    dense = flashlib.default_num_splits(q, k)
    from flashlib.api import _default_num_splits
    hkv, nmax = k.shape[1], k.shape[2]
    assert _default_num_splits(q, hkv, nmax, (63, 0)) < dense
    assert _default_num_splits(q, hkv, nmax, (63, 0)) == _default_num_splits(q, hkv, 64)


def test_qkvpacked_takes_the_variants():
    qkv = torch.randn(2, 9, 3, 2, 8, dtype=torch.float64)
    kw = dict(window_size=(2, 0), softcap=1.0, sinks=torch.tensor([0.1, -0.2]))
    o = flashlib.attention_qkvpacked(qkv, backend="reference", **kw)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o_ref, _ = testing.reference_gqa(q, k, v, **_oracle_kw(kw))
    testing.assert_close(o.transpose(1, 2), o_ref, atol=1e-12, rtol=1e-12, name="o")


def test_torch_compile_carries_the_variants_through_the_op():
    q, k, v = make_qkv(B=1, H=2, HKV=1, NQ=6, NK=8, D=8)
    kw = dict(window_size=(2, 1), softcap=2.0, alibi_slopes=torch.rand(2), sinks=torch.randn(2))
    eager = flashlib.attention(q, k, v, backend="reference", **kw)
    compiled = torch.compile(lambda q, k, v: flashlib.attention(q, k, v, backend="reference", **kw),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager, rtol=0, atol=0)


def test_hypothesis_every_combination_on_the_reference_backend():
    need_module("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    window = st.tuples(st.integers(-1, 6), st.integers(-1, 6))

    @settings(max_examples=40, deadline=None)
    @given(nq=st.integers(1, 9), nk=st.integers(1, 9), causal=st.booleans(), window=window,
           softcap=st.sampled_from([0.0, 0.5, 3.0]), alibi=st.booleans(), sinks=st.booleans(),
           dropout=st.sampled_from([0.0, 0.5]), seed=st.integers(0, 2 ** 40))
    def check(nq, nk, causal, window, softcap, alibi, sinks, dropout, seed):
        q, k, v = make_qkv(B=1, H=2, HKV=1, NQ=nq, NK=nk, D=4, seed=seed % 97)
        kw = dict(window_size=window, softcap=softcap)
        if alibi:
            kw["alibi_slopes"] = torch.rand(2)
        if sinks:
            kw["sinks"] = torch.randn(2)
        ref_kw = _oracle_kw(kw)
        if dropout:
            kw.update(dropout_p=dropout, dropout_seed=(seed, 0))
            ref_kw.update(dropout_p=dropout,
                          dropout_mask=flashlib.dropout_mask(q, k, dropout, (seed, 0)).numpy())
        o, lse = flashlib.attention(q, k, v, causal=causal, return_lse=True, backend="reference",
                                    block_q=4, block_k=4, **kw)
        o_ref, lse_ref = testing.reference_gqa(q, k, v, causal=causal, **ref_kw)
        testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-12, name="o")
        testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12, name="lse")
    check()


def test_triton_backend_through_the_api_every_variant_and_gradient():
    """flashlib.attention(backend="triton") with every variant at once, forward and backward (dsinks
    included), and decode with the variants: the Triton kernels' answers through the public API, the
    dropout mask the reference backend's (the kernels' own tests: tests/kernels/triton/)."""
    from conftest import DEVICE
    q, k, v = make_qkv(B=2, H=4, HKV=2, NQ=11, NK=19, D=40, dtype=torch.float32, grad=True, device=DEVICE)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    slopes = torch.rand(2, 4, device=DEVICE)
    kw = dict(window_size=(5, 2), softcap=3.0, alibi_slopes=slopes, dropout_p=0.25, dropout_seed=(3, 2 ** 33))
    do = torch.randn_like(q)
    o, lse = flashlib.attention(q, k, v, causal=True, sinks=sinks, return_lse=True, backend="triton",
                                block_q=16, block_k=16, **kw)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do)
    z = flashlib.dropout_mask(q, k, 0.25, (3, 2 ** 33)).cpu().numpy()
    testing.assert_attention_right(q, k, v, do, causal=True, o=o, lse=lse, grads=grads, window_size=(5, 2),
                                   softcap=3.0, alibi_slopes=slopes.cpu().double().numpy(),
                                   sinks=sinks.detach().cpu().double().numpy(), dropout_p=0.25, dropout_mask=z)
    with torch.no_grad():
        qd = q[:, :, :2].detach()
        lens = torch.tensor([19, 7], device=DEVICE)
        od = flashlib.decode(qd, k.detach(), v.detach(), cache_seqlens=lens, num_splits=2, backend="triton",
                             window_size=(4, -1), softcap=3.0, alibi_slopes=slopes, sinks=sinks.detach())
        ref = flashlib.decode(qd.cpu().double(), k.detach().cpu().double(), v.detach().cpu().double(),
                              cache_seqlens=lens.cpu(), backend="reference", window_size=(4, -1), softcap=3.0,
                              alibi_slopes=slopes.cpu().double(), sinks=sinks.detach().cpu().double())
    testing.assert_close(od, ref, atol=2e-5, rtol=2e-5, name="decode o")
