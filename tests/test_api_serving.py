"""Serving through flashlib's public API (chapter 10): flashlib.attention_varlen (ragged batches),
flashlib.decode with appended tokens, causal new tokens and paged caches (block_table), and
flashlib.append_kv — against the float64 oracle (flashlib.testing.reference_varlen / reference_gqa)
on the "reference" backend and on "triton" (Triton's interpreter), with every bad argument refused by
name. The kernels' own tests: tests/kernels/triton/test_triton_varlen_*.py and
test_triton_paged_decode.py; the ladder's: tests/ladder/test_serving.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import flashlib
from flashlib import testing

BACKENDS = ["reference", "triton"]
# lengths (nq_b, nk_b): an empty sequence, a sequence of queries and no key, length 1, lengths no
# block divides, nq > nk (rows that see nothing when causal) and nq < nk
LENGTHS = [(3, 5), (0, 4), (2, 0), (1, 1), (17, 17), (9, 4), (5, 23)]


def _cu(ns):
    return torch.tensor(np.concatenate([[0], np.cumsum(ns)]), dtype=torch.int32)


def _varlen(lengths=LENGTHS, H=4, HKV=2, D=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    nq, nk = [a for a, _ in lengths], [b for _, b in lengths]
    q = torch.randn(sum(nq), H, D, generator=g, dtype=dtype)
    k, v = (torch.randn(sum(nk), HKV, D, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, _cu(nq), _cu(nk), max(nq), max(nk)


def _tol(backend, dtype):
    return 1e-12 if dtype == torch.float64 else 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_matches_the_oracle_sequence_by_sequence(backend, causal):
    dtype = torch.float64 if backend == "reference" else torch.float32
    q, k, v, cq, ck, mq, mk = _varlen(dtype=dtype)
    o, lse = flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, causal=causal, return_lse=True, backend=backend)
    want_o, want_lse = testing.reference_varlen(q, k, v, cq, ck, causal=causal)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.promote_types(dtype, torch.float32)
    np.testing.assert_allclose(o.double().numpy(), want_o, atol=_tol(backend, dtype))
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=_tol(backend, dtype))
    assert not torch.isnan(o).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", [dict(window_size=(3, 1)), dict(softcap=2.0), dict(alibi_slopes="BH"),
                                     dict(sinks=True), dict(window_size=(2, 0), softcap=1.5, sinks=True)])
def test_attention_varlen_computes_the_variants_per_sequence(backend, variant):
    dtype = torch.float64 if backend == "reference" else torch.float32
    q, k, v, cq, ck, mq, mk = _varlen(dtype=dtype, seed=1)
    B, H = cq.numel() - 1, q.shape[1]
    g = torch.Generator().manual_seed(3)
    var = dict(variant)
    if var.get("alibi_slopes") == "BH":
        var["alibi_slopes"] = torch.rand(B, H, generator=g)
    if var.get("sinks"):
        var["sinks"] = torch.randn(H, generator=g)
    o, lse = flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, return_lse=True, backend=backend, **var)
    oracle = {n: (x.numpy() if torch.is_tensor(x) else x) for n, x in var.items()}
    want_o, want_lse = testing.reference_varlen(q, k, v, cq, ck, causal=True, **oracle)
    np.testing.assert_allclose(o.double().numpy(), want_o, atol=_tol(backend, dtype))
    np.testing.assert_allclose(lse.double().numpy(), want_lse, atol=_tol(backend, dtype))


def test_attention_varlen_gradients_pass_gradcheck_in_float64_sinks_included():
    q, k, v, cq, ck, mq, mk = _varlen(lengths=[(3, 4), (0, 2), (2, 0), (4, 3)], H=2, HKV=1, D=4, seed=2)
    sinks = torch.randn(2, dtype=torch.float64)
    for x in (q, k, v, sinks):
        x.requires_grad_(True)

    def f(q, k, v, sinks):
        return flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, sinks=sinks, backend="reference")

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_varlen_gradients_match_the_oracle(backend):
    dtype = torch.float64 if backend == "reference" else torch.float32
    q, k, v, cq, ck, mq, mk = _varlen(dtype=dtype, seed=4)
    do = torch.randn(q.shape, dtype=dtype, generator=torch.Generator().manual_seed(5))
    for x in (q, k, v):
        x.requires_grad_(True)
    o = flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, backend=backend)
    o.backward(do)
    *_, grads = testing.reference_varlen(q.detach(), k.detach(), v.detach(), cq, ck, causal=True, do=do)
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        np.testing.assert_allclose(got.double().numpy(), want, atol=_tol(backend, dtype) * 10)


def test_attention_varlen_through_the_custom_op_gives_the_same_answer():
    q, k, v, cq, ck, mq, mk = _varlen(seed=6)
    want = flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True, backend="reference")
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq, fck = (mode.from_tensor(x) for x in (q, k, v, cq, ck))
        fo, flse = flashlib.attention_varlen(fq, fk, fv, fcq, fck, mq, mk, causal=True, return_lse=True,
                                             backend="reference")
        assert fo.shape == q.shape and flse.shape == (q.shape[1], q.shape[0])
    compiled = torch.compile(lambda q, k, v: flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, causal=True,
                                                                       backend="reference"),
                             backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), want, atol=0, rtol=0)


# --- decode: appended tokens, causal, paged caches -------------------------------------------------

def _decode_case(B=3, H=4, HKV=2, NMAX=40, D=16, nq=3, lens=(0, 7, 30), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc = (torch.randn(B, HKV, NMAX, D, generator=g, dtype=dtype) for _ in range(2))
    q = torch.randn(B, H, nq, D, generator=g, dtype=dtype)
    k, v = (torch.randn(B, HKV, nq, D, generator=g, dtype=dtype) for _ in range(2))
    return q, kc, vc, k, v, torch.tensor(lens, dtype=torch.int32)


def _oracle_decode(q, kc, vc, lens, causal, **variants):
    """Dense caches (B, Hkv, Nmax, d) and final lengths: the oracle, sequence by sequence."""
    outs = []
    for b, n in enumerate(lens.tolist()):
        o, _ = testing.reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n], causal=causal, **variants)
        outs.append(o[0])
    return np.stack(outs)


def _paged(kc, vc, page_size, seed=0, shared=False):
    """The dense caches (B, Hkv, Nmax, d) as pages (num_pages, page_size, Hkv, d) in shuffled order,
    plus spare pages full of NaN, and the block table (B, max_pages)."""
    B, HKV, NMAX, D = kc.shape
    per = -(-NMAX // page_size)
    g = torch.Generator().manual_seed(seed)
    num_pages = B * per + 3
    order = torch.randperm(num_pages, generator=g)[:B * per].reshape(B, per).to(torch.int32)
    pages = [torch.full((num_pages, page_size, HKV, D), float("nan"), dtype=kc.dtype) for _ in range(2)]
    for cache, paged in zip((kc, vc), pages):
        padded = torch.nn.functional.pad(cache, (0, 0, 0, per * page_size - NMAX))   # (B, Hkv, per·ps, d)
        tokens = padded.transpose(1, 2).reshape(B, per, page_size, HKV, D)
        paged[order.long()] = tokens
    return pages[0], pages[1], order


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [None, 1, 3, 16, 256])
def test_decode_appends_in_place_and_attends_causally_dense_or_paged(backend, page_size):
    dtype = torch.float64 if backend == "reference" else torch.float32
    q, kc, vc, k, v, lens = _decode_case(dtype=dtype, seed=page_size or 0)
    # the oracle's caches: the new tokens written at [len_b, len_b + Nnew)
    kd, vd = kc.clone(), vc.clone()
    for b, n in enumerate(lens.tolist()):
        kd[b, :, n:n + k.shape[2]], vd[b, :, n:n + k.shape[2]] = k[b], v[b]
    final = lens + k.shape[2]
    want = _oracle_decode(q, kd, vd, final, causal=True)
    if page_size is None:
        o = flashlib.decode(q, kc, vc, k=k, v=v, cache_seqlens=lens, causal=True, backend=backend)
        torch.testing.assert_close(kc, kd, atol=0, rtol=0)               # appended in place, nothing else
    else:
        kp, vp, table = _paged(kc, vc, page_size, seed=page_size)
        o = flashlib.decode(q, kp, vp, k=k.transpose(1, 2), v=v.transpose(1, 2), cache_seqlens=lens,
                            block_table=table, causal=True, backend=backend)
        kp2, _, _ = _paged(kd, vd, page_size, seed=page_size)
        used = ~torch.isnan(kp2)
        torch.testing.assert_close(kp[used], kp2[used], atol=0, rtol=0)
    np.testing.assert_allclose(o.double().numpy(), want, atol=_tol(backend, dtype))
    assert not torch.isnan(o).any()                                      # NaN pages past the lengths unread


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_decode_equals_dense_decode_bit_for_bit_with_shared_pages(backend):
    dtype = torch.float64 if backend == "reference" else torch.float32
    q, kc, vc, _, _, lens = _decode_case(B=2, lens=(13, 13), dtype=dtype, seed=9)
    kc[1], vc[1] = kc[0], vc[0]                                          # two sequences, one prompt
    kp, vp, table = _paged(kc, vc, 4, seed=1)
    table[1] = table[0]                                                  # so they share its pages
    dense = flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=2, return_lse=True, backend=backend)
    paged = flashlib.decode(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=2, return_lse=True,
                            backend=backend)
    for a, b in zip(dense, paged):
        assert torch.equal(a, b)


def test_append_kv_writes_only_the_new_positions():
    q, kc, vc, k, v, lens = _decode_case(seed=3)
    before = kc.clone()
    flashlib.append_kv(kc, vc, k, v, lens)
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(kc[b, :, n:n + 3], k[b], atol=0, rtol=0)
        kc[b, :, n:n + 3] = before[b, :, n:n + 3]
    assert torch.equal(kc, before)
    kp, vp, table = _paged(before, vc, 5)
    kp0 = kp.clone()
    flashlib.append_kv(kp, vp, k.transpose(1, 2), v.transpose(1, 2), lens, block_table=table)
    for b, n in enumerate(lens.tolist()):
        for i in range(3):
            page, row = int(table[b, (n + i) // 5]), (n + i) % 5
            torch.testing.assert_close(kp[page, row], k[b, :, i], atol=0, rtol=0)
            kp[page, row] = kp0[page, row]
    assert torch.equal(kp.nan_to_num(7.0), kp0.nan_to_num(7.0))


# --- bad input, refused by name --------------------------------------------------------------------

def _call_varlen(**change):
    q, k, v, cq, ck, mq, mk = _varlen(lengths=[(2, 3), (3, 2)])
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk)
    args.update(change)
    return flashlib.attention_varlen(**args, backend="reference")


@pytest.mark.parametrize("change, error, words", [
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5])), TypeError, "cu_seqlens_q must have dtype torch.int32"),
    (dict(cu_seqlens_q=torch.tensor([[0, 2, 5]], dtype=torch.int32)), ValueError, "cu_seqlens_q must be 1-D"),
    (dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError, "cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 3, 5], dtype=torch.int32)), ValueError, "cu_seqlens_k must have length"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError, "cu_seqlens_k must be non-decreasing"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError, "must end at the number of packed"),
    (dict(max_seqlen_q=2), ValueError, "max_seqlen_q must be at least the longest sequence"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
    (dict(max_seqlen_k=2.0), TypeError, "max_seqlen_k"),
    (dict(q=torch.zeros(5, 4, 16, 1, dtype=torch.float64)), ValueError, "q must have shape \\(total_tokens"),
    (dict(k=torch.zeros(5, 3, 16, dtype=torch.float64)), ValueError, "v must have the shape of k"),
    (dict(cu_seqlens_q=[0, 2, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
])
def test_attention_varlen_refuses_bad_input_by_name(change, error, words):
    with pytest.raises(error, match=words):
        _call_varlen(**change)


def test_backends_without_ragged_or_paged_kernels_are_refused_by_name():
    q, k, v, cq, ck, mq, mk = _varlen(dtype=torch.float32)
    with pytest.raises(ValueError, match="backend='cuda' does not compute ragged batches"):
        flashlib.attention_varlen(q, k, v, cq, ck, mq, mk, backend="cuda")
    q, kc, vc, _, _, lens = _decode_case(dtype=torch.float32)
    kp, vp, table = _paged(kc, vc, 8)
    with pytest.raises(ValueError, match="backend='cuda' does not compute block_table"):
        flashlib.decode(q, kp, vp, cache_seqlens=lens, block_table=table, backend="cuda")


def _decode_error(change):
    q, kc, vc, k, v, lens = _decode_case()
    args = dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=lens)
    args.update(change(args))
    return flashlib.decode(**args, backend="reference")


def _paged_args(args, page_size=8):
    kp, vp, table = _paged(args["k_cache"], args["v_cache"], page_size)
    return dict(k_cache=kp, v_cache=vp, block_table=table, k=args["k"].transpose(1, 2), v=args["v"].transpose(1, 2))


@pytest.mark.parametrize("change, error, words", [
    (lambda a: dict(cache_seqlens=None), ValueError, "k and v \\(new tokens to append\\) need cache_seqlens"),
    (lambda a: dict(v=None), ValueError, "k and v must be given together"),
    (lambda a: dict(cache_seqlens=torch.tensor([0, 7, 38], dtype=torch.int32)), ValueError,
     "appended tokens past the cache's capacity \\(40 tokens per sequence\\): sequence 2 would hold 41"),
    (lambda a: dict(k=a["k"].transpose(1, 2)), ValueError, "k must have shape \\(B, Hkv, Nnew, d\\) for a dense"),
    (lambda a: dict(k=a["k"][0, 0]), ValueError, "k must have shape \\(B, Hkv, Nnew, d\\) for a dense"),
    (lambda a: {**_paged_args(a), "v": a["v"][0, 0]}, ValueError, "v must have shape \\(B, Nnew, Hkv, d\\) for a paged"),
    (lambda a: {**_paged_args(a), "k": a["k"]}, ValueError, "k must have shape \\(B, Nnew, Hkv, d\\) for a paged"),
    (lambda a: {**_paged_args(a), "block_table": _paged_args(a)["block_table"].long()}, TypeError,
     "block_table must have dtype torch.int32"),
    (lambda a: {**_paged_args(a), "block_table": _paged_args(a)["block_table"][:2]}, ValueError,
     "block_table must have shape \\(3, max_pages >= 1\\)"),
    (lambda a: {**_paged_args(a), "block_table": _paged_args(a)["block_table"] + 100}, ValueError,
     "block_table\\[0\\] points past the cache's 18 pages"),
    (lambda a: {**_paged_args(a), "k_cache": torch.zeros(4, 0, 2, 16, dtype=torch.float64),
                "v_cache": torch.zeros(4, 0, 2, 16, dtype=torch.float64)}, ValueError, "page size \\(dim 1\\) must be >= 1"),
])
def test_decode_refuses_bad_caches_tables_and_appends_by_name(change, error, words):
    with pytest.raises(error, match=words):
        _decode_error(change)
