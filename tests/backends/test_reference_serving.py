"""The reference backend's serving functions (issue 25): forward_varlen and backward_varlen against the
float64 oracle flashlib.testing.reference_varlen (empty sequences, length 1, lengths no block divides, Nq != Nk both
ways, GQA, every variant, dropout's per-sequence counters), a float64 gradcheck of the varlen backward,
and decode with a block table: paged caches (page sizes 1, 3, 16, 256, shuffled and shared tables,
garbage past the length) give bit for bit what the dense path gives on the same data."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashlib.backends import reference as R
from flashlib.testing import assert_close, reference, reference_varlen

SEED = (2**40 + 12345, 2**33 + 7)          # dropout's (seed, offset), both past 32 bits
TOL = dict(atol=1e-10, rtol=1e-10)

# (lengths_q, lengths_k): empty sequences both ways, length 1, lengths no block divides, Nq > Nk and
# Nq < Nk within one batch
LENGTHS = {
    "ragged": ([3, 0, 5, 1, 70, 2], [6, 4, 0, 1, 67, 2]),
    "self": ([1, 37, 0, 65], [1, 37, 0, 65]),
    "one": ([1], [1]),
    "all_empty": ([0, 0], [0, 3]),
}
VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "window_causal": dict(window_size=(5, 0), causal=True),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "dropout": dict(dropout_p=0.3),
    "all": dict(causal=True, window_size=(6, 0), softcap=2.0, alibi=True, sinks=True, dropout_p=0.2),
}


def make_varlen(lens_q, lens_k, H=4, HKV=2, d=8, dv=None, dtype=torch.float64, seed=0):
    """Packed ``q (Tq, H, d)``, ``k (Tk, Hkv, d)``, ``v (Tk, Hkv, dv)``, ``do`` and int32 cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    tq, tk, dv = sum(lens_q), sum(lens_k), dv or d
    q, k = torch.randn(tq, H, d, generator=g), torch.randn(tk, HKV, d, generator=g)
    v, do = torch.randn(tk, HKV, dv, generator=g), torch.randn(tq, H, dv, generator=g)
    cu_q = torch.tensor(np.r_[0, np.cumsum(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor(np.r_[0, np.cumsum(lens_k)], dtype=torch.int32)
    return (*(x.to(dtype) for x in (q, k, v, do)), cu_q, cu_k)


def backend_variants(spec, B, H, seed=0):
    """The variants as a backend receives them (alibi float32 (B, H), sinks (H,), dropout_seed)."""
    g = torch.Generator().manual_seed(100 + seed)
    kw = {name: spec[name] for name in ("window_size", "softcap", "dropout_p") if name in spec}
    if spec.get("alibi"):
        kw["alibi_slopes"] = torch.rand(B, H, generator=g) * 0.5 + 0.05
    if spec.get("sinks"):
        kw["sinks"] = torch.randn(H, generator=g, dtype=torch.float64)
    if spec.get("dropout_p"):
        kw["dropout_seed"] = SEED
    return kw


def run_case(lens_q, lens_k, spec, *, H=4, HKV=2, d=8, dv=None, extra_max=(0, 0), seed=0):
    q, k, v, do, cu_q, cu_k = make_varlen(lens_q, lens_k, H, HKV, d, dv, seed=seed)
    causal = spec.get("causal", False)
    kw = backend_variants(spec, len(lens_q), H, seed)
    max_q, max_k = max(lens_q) + extra_max[0], max(lens_k) + extra_max[1]
    scale = d ** -0.5
    o, lse = R.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale, **kw)
    grads = R.backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal=causal, scale=scale,
                              **kw)
    o_ref, lse_ref, grads_ref = reference_varlen(q, k, v, cu_q, cu_k, causal=causal, scale=scale, do=do,
                                                 max_seqlens=(max_q, max_k), **kw)
    assert o.shape == q.shape[:2] + (v.shape[-1],) and lse.shape == (H, q.shape[0])
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    assert_close(o, o_ref, name="o", **TOL)
    assert_close(lse, lse_ref, name="lse", **TOL)
    assert len(grads) == len(grads_ref)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert_close(g, g_ref, name=name, **TOL)
    return o, lse, grads


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_varlen_matches_the_oracle_sequence_by_sequence(lengths, variant):
    run_case(*LENGTHS[lengths], VARIANTS[variant])


@pytest.mark.parametrize("heads", [(3, 3), (6, 2), (4, 1)])
def test_varlen_gqa_and_a_different_value_dim(heads):
    run_case([4, 9, 0, 2], [7, 3, 5, 2], VARIANTS["all"], H=heads[0], HKV=heads[1], d=5, dv=7)


def test_dropout_counters_follow_max_seqlen_not_the_lengths():
    """The offset step is H * max_seqlen_q * max_seqlen_k: a larger max moves every later sequence's mask
    (the oracle is told the same max)."""
    spec = VARIANTS["dropout"]
    o1, _, _ = run_case([5, 6], [7, 4], spec)
    o2, _, _ = run_case([5, 6], [7, 4], spec, extra_max=(3, 2))
    assert torch.equal(o1[:5], o2[:5])                # sequence 0: offset + 0, unchanged
    assert not torch.equal(o1[5:], o2[5:])            # sequence 1: another stretch of counters


def test_empty_sequences_and_rows_past_the_last_give_zeros():
    q, k, v, do, cu_q, cu_k = make_varlen([2, 0, 3], [0, 5, 2])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    o, lse = R.forward_varlen(q, k, v, cu_q, cu_k, 3, 5, causal=False, scale=0.3, sinks=sinks)
    assert (o[:2] == 0).all() and torch.equal(lse[:, :2], sinks[:, None].expand(4, 2))
    grads = R.backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, 3, 5, causal=False, scale=0.3,
                              sinks=sinks)
    assert (grads[0][:2] == 0).all() and (grads[1][:5] == 0).all()      # sequence 1's keys: no query
    assert not torch.isnan(torch.cat([g.flatten() for g in grads])).any()
    # cu_seqlens ending before the packed tensors: the remaining rows belong to no sequence
    short_q = torch.tensor([0, 2, 2], dtype=torch.int32)
    short_k = torch.tensor([0, 1, 6], dtype=torch.int32)
    o, lse = R.forward_varlen(q, k, v, short_q, short_k, 2, 5, causal=False, scale=0.3)
    assert (o[2:] == 0).all() and torch.isneginf(lse[:, 2:]).all()


def test_float32_and_half_inputs_keep_their_dtype_and_lse_is_float32():
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, do, cu_q, cu_k = make_varlen([3, 4], [5, 1], dtype=dtype)
        o, lse = R.forward_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=True, scale=0.35)
        assert o.dtype == dtype and lse.dtype == torch.float32
        grads = R.backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, 4, 5, causal=True, scale=0.35)
        assert [g.dtype for g in grads] == [dtype] * 3


class _Varlen(torch.autograd.Function):
    """A tiny autograd wrapper around the backend's varlen pair (sinks differentiable too)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, causal, kw):
        if sinks is not None:
            kw = dict(kw, sinks=sinks)
        o, lse = R.forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, scale=0.4, **kw)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (cu_q, cu_k, max_q, max_k, causal, kw)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        cu_q, cu_k, max_q, max_k, causal, kw = ctx.args
        grads = R.backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal=causal,
                                  scale=0.4, **kw)
        dsinks = grads[3] if len(grads) > 3 else None
        return (*grads[:3], dsinks, None, None, None, None, None, None)


@pytest.mark.parametrize("spec", [dict(causal=True), dict(window_size=(2, 1), softcap=1.2, alibi=True),
                                  dict(causal=True, dropout_p=0.25)], ids=["causal", "variants", "dropout"])
def test_varlen_backward_passes_gradcheck(spec):
    q, k, v, _, cu_q, cu_k = make_varlen([3, 0, 2, 4], [2, 3, 0, 5], H=2, HKV=1, d=3)
    kw = backend_variants(spec, 4, 2)
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, requires_grad=True)
    inputs = [x.requires_grad_() for x in (q, k, v)] + [sinks]
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: _Varlen.apply(q, k, v, s, cu_q, cu_k, 4, 5, spec.get("causal", False), kw),
        inputs, eps=1e-6, atol=1e-7)


def test_the_variant_tables_name_varlen_and_block_table():
    assert R.VARIANTS["varlen"] == R.VARIANTS["attention"]
    assert "block_table" in R.VARIANTS["decode"]


# ---- decode with a block table -------------------------------------------------------------------

def paged_copy(k_dense, v_dense, page_size, *, seed=0, shared=False, garbage=True):
    """The dense caches ``(B, Hkv, Nmax, d)`` copied into a paged pool ``(num_pages, page_size, Hkv, d)``
    in shuffled page order, with spare pages of noise; the block table int32 ``(B, max_pages)``.
    ``shared``: sequence 1 reuses sequence 0's pages (its dense cache made equal to 0's first).
    ``garbage``: table entries past the pages a sequence holds point anywhere, even out of range."""
    B, HKV, NMAX, D = k_dense.shape
    max_pages = -(-NMAX // page_size)
    g = torch.Generator().manual_seed(seed)
    num_pages = B * max_pages + 3
    order = torch.randperm(num_pages, generator=g)
    table = order[:B * max_pages].reshape(B, max_pages).to(torch.int32)
    if shared:
        table[1] = table[0]
    k_pool = torch.randn(num_pages, page_size, HKV, D, generator=g, dtype=k_dense.dtype)
    v_pool = torch.randn(num_pages, page_size, HKV, v_dense.shape[-1], generator=g, dtype=v_dense.dtype)
    for b in range(B):
        for t in range(NMAX):
            page, row = table[b, t // page_size], t % page_size
            k_pool[page, row], v_pool[page, row] = k_dense[b, :, t], v_dense[b, :, t]
    if garbage:
        table = torch.cat([table, torch.tensor([[-7, 10**6]] * B, dtype=torch.int32)], dim=1)
    return k_pool, v_pool, table


DECODE_VARIANTS = {
    "plain": {},
    "window": dict(window_size=(5, 0)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=torch.tensor([[0.1, 0.5, 0.2, 0.3], [0.4, 0.05, 0.7, 0.2],
                                             [0.3, 0.3, 0.3, 0.3]])),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)),
}


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_paged_decode_is_bit_for_bit_the_dense_decode(page_size, variant):
    g = torch.Generator().manual_seed(page_size)
    B, H, HKV, NQ, NMAX, D = 3, 4, 2, 2, 37, 8
    q = torch.randn(B, H, NQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, HKV, NMAX, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, HKV, NMAX, D, generator=g, dtype=torch.float64)
    k_pool, v_pool, table = paged_copy(k, v, page_size, seed=page_size)
    lens = torch.tensor([37, 1, 0], dtype=torch.int32)
    kw = DECODE_VARIANTS[variant]
    o_dense, lse_dense = R.decode(q, k, v, lens, num_splits=3, scale=0.3, **kw)
    o_paged, lse_paged = R.decode(q, k_pool, v_pool, lens, num_splits=3, scale=0.3, block_table=table,
                                  **kw)
    assert torch.equal(o_paged, o_dense) and torch.equal(lse_paged, lse_dense)
    # and the oracle: sequence b against its first len_b keys
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        okw = {name: x[b] if name == "alibi_slopes" else x for name, x in kw.items()}
        okw = {name: x.double().numpy() if torch.is_tensor(x) else x for name, x in okw.items()}
        o_ref, lse_ref = reference(q[b].numpy(), k[b, :, :n].repeat_interleave(2, 0).numpy(),
                                   v[b, :, :n].repeat_interleave(2, 0).numpy(), scale=0.3, **okw)
        assert_close(o_paged[b], o_ref, **TOL)
        assert_close(lse_paged[b], lse_ref, **TOL)


def test_a_table_shared_between_sequences_reads_the_same_pages():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 1, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 10, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 10, 4, generator=g, dtype=torch.float64)
    k[1], v[1] = k[0], v[0]                            # the same tokens: one set of pages
    q[1] = q[0]
    k_pool, v_pool, table = paged_copy(k, v, 3, shared=True)
    assert torch.equal(table[0], table[1])
    lens = torch.tensor([10, 7], dtype=torch.int32)
    o, lse = R.decode(q, k_pool, v_pool, lens, num_splits=2, scale=0.5, block_table=table)
    o_dense, lse_dense = R.decode(q, k, v, lens, num_splits=2, scale=0.5)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)


def test_paged_lengths_clamp_to_the_capacity_and_none_means_the_capacity():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 1, 12, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 1, 12, 4, generator=g, dtype=torch.float64)
    k_pool, v_pool, table = paged_copy(k, v, 4, garbage=False)      # capacity 3 * 4 = 12
    full = R.decode(q, k, v, None, num_splits=1, scale=0.5, window_size=(4, 0))
    for lens in (None, torch.tensor([12, 99], dtype=torch.int32)):
        paged = R.decode(q, k_pool, v_pool, lens, num_splits=1, scale=0.5, window_size=(4, 0),
                         block_table=table)
        assert all(torch.equal(a, b) for a, b in zip(paged, full))
    o, lse = R.decode(q, k_pool, v_pool, torch.tensor([-3, 12], dtype=torch.int32), num_splits=1,
                      scale=0.5, block_table=table)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all()      # a negative length: nothing


def test_paged_decode_keeps_float32_and_the_dense_path_is_unchanged():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 1, 8, generator=g)
    k, v = torch.randn(1, 2, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    k_pool, v_pool, table = paged_copy(k, v, 16)
    lens = torch.tensor([17], dtype=torch.int32)
    o, lse = R.decode(q, k_pool, v_pool, lens, num_splits=2, scale=0.3, block_table=table)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    o_dense, lse_dense = R.decode(q, k, v, lens, num_splits=2, scale=0.3)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)
