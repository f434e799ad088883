"""Tests of Flash-Decoding over PAGED KV caches and of the in-place append, flashlib/kernels/triton/decode_v3.py
(PAGED in its split kernel, append_kv), on conftest's DEVICE: interpreted on a CPU machine, compiled on a GPU
one.

A paged cache is built from a dense one: the same keys, scattered over pages of 1, 3, 16 or 256 rows in a
shuffled block table, one page shared by two sequences (a common prefix), every unused page and every table
entry past a sequence's length filled with garbage (NaN rows, page indices out of range). The paged decode
must give the float64 oracle's answer, and the SAME BITS as the dense decode on the same data with the same
splits (a gather changes addresses, not arithmetic). Also: lengths 0, 1 and none a block divides, GQA,
causal among several new tokens (the window (-1, 0)), every variant, the kernel's clamps, a hypothesis
search for paged != dense, and append_kv, dense and paged, writing exactly the new rows (none at or past
the capacity). Last, the PAGED split kernel and the append kernel compiled for sm_75, sm_80 and sm_90 (the
compile report's machinery, cached).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, require_module, require_tool
from test_triton_variants_decode import make_variants as _variants
from triton_cases import make_qkv

from flashlib.kernels.triton import decode_v3
from flashlib.kernels.triton.configs import Config
from flashlib.testing import assert_close, reference_gqa

SMALL = Config(16, 16)


def paginate(kc, vc, lens, page_size, *, share=None, seed=0):
    """``(k_pages, v_pages, table)``: the dense caches ``(B, Hkv, cap, d)`` scattered into pages
    ``(num_pages, page_size, Hkv, d)`` in a shuffled order (cap a multiple of page_size). Every page
    not holding a valid key is NaN, and every table entry past a sequence's length is garbage (out of
    range, negative, or a NaN page). ``share=(a, b)``: sequence b's first page is sequence a's (the
    caller made their first page_size keys equal)."""
    B, HKV, cap, D = kc.shape
    assert cap % page_size == 0, "the dense capacity must be whole pages"
    max_pages = cap // page_size
    g = torch.Generator().manual_seed(100 + seed)
    num_pages = B * max_pages + 3                       # spare pages: never used, NaN
    order = torch.randperm(num_pages, generator=g)[:B * max_pages].view(B, max_pages)
    table = order.clone().to(torch.int32)
    if share is not None:
        a, b = share
        table[b, 0] = table[a, 0]
    kp = torch.full((num_pages, page_size, HKV, D), float("nan"), dtype=kc.dtype)
    vp = kp.clone()
    for b in range(B):
        n = int(lens[b]) if lens is not None else cap
        used = -(-n // page_size)
        for p in range(max_pages):
            if p < used:        # the valid pages hold the sequence's keys (past n: NaN too)
                rows = slice(p * page_size, min((p + 1) * page_size, n))
                count = rows.stop - rows.start
                kp[table[b, p], :count] = kc[b, :, rows].transpose(0, 1).cpu()
                vp[table[b, p], :count] = vc[b, :, rows].transpose(0, 1).cpu()
            else:               # entries past the length: garbage of every kind
                table[b, p] = (10**6, -7, int(order[b, p]))[p % 3]
    dev = kc.device
    return kp.to(dev), vp.to(dev), table.to(dev)


def oracle(q, kc, vc, lens, kw=None, causal=False):
    """Float64 ``(o, lse)``: sequence b attends its first lens[b] keys (none: o = 0, lse = sink or
    -inf), with the variants ``kw`` as decode takes them."""
    kw = kw or {}
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    for b, n in enumerate(lens.tolist()):
        ref = {k: x for k, x in kw.items() if k in ("window_size", "softcap")}
        if "alibi_slopes" in kw:
            ref["alibi_slopes"] = kw["alibi_slopes"][b:b + 1].cpu().numpy()
        if "sinks" in kw:
            ref["sinks"] = kw["sinks"].cpu().numpy()
        if n:
            o[b:b + 1], lse[b:b + 1] = reference_gqa(q[b:b + 1], kc[b:b + 1, :, :n], vc[b:b + 1, :, :n],
                                                     causal=causal, **ref)
        elif "sinks" in ref:
            lse[b] = ref["sinks"][:, None]
    return o, lse


def run(q, kc, vc, lens, num_splits, kw=None, table=None, config=SMALL):
    return decode_v3.decode(q, kc, vc, lens, num_splits=num_splits, scale=q.shape[-1] ** -0.5,
                            config=config, block_table=table, **(kw or {}))


def assert_paged_right(q, kc, vc, lens, page_size, num_splits, kw=None, *, share=None, causal=False,
                       config=SMALL):
    """Paged == dense bit for bit, and both equal the oracle."""
    kp, vp, table = paginate(kc, vc, lens, page_size, share=share)
    o, lse = run(q, kp, vp, lens, num_splits, kw, table, config)
    o_dense, lse_dense = run(q, kc, vc, lens, num_splits, kw, None, config)
    assert torch.equal(o, o_dense), "paged o differs from dense o"
    assert torch.equal(lse, lse_dense), "paged lse differs from dense lse"
    ro, rl = oracle(q, kc, vc, lens if lens is not None else torch.full((q.shape[0],), kc.shape[2]),
                    kw, causal)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")
    return o, lse


def lengths(*ns):
    return torch.tensor(ns, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_paged_matches_the_oracle_and_dense_bit_for_bit(page_size, num_splits):
    """B = 4: lengths 0, 1, one no block or page divides, and a full one; H = 4 over Hkv = 2; Nq = 2;
    shuffled table, sequence 3 sharing sequence 2's first page, garbage past every length."""
    cap = 256 if page_size == 256 else 48
    q, kc, vc, _ = make_qkv(4, 4, 2, 2, cap, 16, seed=page_size, device=DEVICE)
    kc[3, :, :page_size] = kc[2, :, :page_size]          # a shared prefix page
    vc[3, :, :page_size] = vc[2, :, :page_size]
    lens = lengths(0, 1, 37 if page_size < 256 else 201, cap)
    assert_paged_right(q, kc, vc, lens, page_size, num_splits, share=(2, 3))


def test_table_shared_entirely_and_blocks_spanning_pages():
    """Two sequences on the very same pages (a forked request), page size 3 under key blocks of 16:
    every block spans six pages."""
    q, kc, vc, _ = make_qkv(2, 2, 1, 1, 30, 24, seed=1, device=DEVICE)
    kc[1], vc[1] = kc[0], vc[0]
    lens = lengths(30, 22)
    kp, vp, table = paginate(kc, vc, lens, 3)
    table[1] = table[0]                                  # entries past 22 stay valid pages: unread
    o, lse = run(q, kp, vp, lens, 2, table=table)
    ro, rl = oracle(q, kc, vc, lens)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")


@pytest.mark.parametrize("page_size", [1, 5])
def test_gqa_group_of_four_and_awkward_rows(page_size):
    """Hkv = 1, H = 4, Nq = 5: 20 stacked rows, two row blocks, head dim 40, three splits."""
    q, kc, vc, _ = make_qkv(2, 4, 1, 5, 35, 40, seed=2, device=DEVICE)
    assert_paged_right(q, kc, vc, lengths(35, 12), page_size, 3)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_causal_among_several_new_tokens(page_size):
    """Nq = 3 new tokens, causal among themselves: the window (-1, 0) (the API's causal), against the
    oracle's bottom-right causal mask; lengths 1 and 2 < Nq leave early rows empty."""
    q, kc, vc, _ = make_qkv(4, 4, 2, 3, 48, 16, seed=3, device=DEVICE)
    lens = lengths(1, 2, 17, 48)
    assert_paged_right(q, kc, vc, lens, page_size, 2, {"window_size": (-1, 0)}, causal=True)


VARIANTS = {
    "window": dict(window=(6, 0)),
    "window-both": dict(window=(4, 2)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "all": dict(window=(11, 1), softcap=2.0, alibi=True, sinks=True),
}


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_paged(name, num_splits):
    """Page size 3; lengths 0, 2 < Nq and full; H = 4 over Hkv = 2, per-head slopes and sinks."""
    q, kc, vc, _ = make_qkv(3, 4, 2, 3, 30, 16, seed=4, device=DEVICE)
    kw = _variants(3, 4, **VARIANTS[name])
    assert_paged_right(q, kc, vc, lengths(0, 2, 30), 3, num_splits, kw)


def test_no_lengths_means_the_capacity():
    """cache_seqlens None with a table: every sequence has max_pages · page_size keys."""
    q, kc, vc, _ = make_qkv(2, 2, 1, 1, 21, 16, seed=5, device=DEVICE)
    assert_paged_right(q, kc, vc, None, 7, 2, _variants(2, 2, sinks=True, window=(9, -1)))


def test_garbage_in_unused_pages_and_entries_changes_nothing():
    """The same cache with two kinds of garbage (NaN / large finite) in the unused pages and the
    rows past each length, and two kinds of garbage table entries past each length: the same bits."""
    q, kc, vc, _ = make_qkv(3, 2, 2, 2, 40, 16, seed=6, device=DEVICE)
    lens = lengths(5, 0, 33)
    kp, vp, table = paginate(kc, vc, lens, 4)
    o, lse = run(q, kp, vp, lens, 3, table=table)
    kp2, vp2, table2 = kp.clone(), vp.clone(), table.clone()
    kp2[kp2.isnan()], vp2[vp2.isnan()] = 1e4, -1e4
    for b, n in enumerate(lens.tolist()):
        table2[b, -(-n // 4):] = 2**31 - 1 - b           # past every length
    o2, lse2 = run(q, kp2, vp2, lens, 3, table=table2)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    assert not o.isnan().any()


def test_kernel_clamps_pages_and_lengths():
    """A table entry out of range (under the length) reads the clamped page; a length past the
    capacity reads the capacity; a negative one sees no key (no host checks: the API's job)."""
    q, kc, vc, _ = make_qkv(2, 2, 1, 1, 12, 16, seed=7, device=DEVICE)
    kp, vp, table = paginate(kc, vc, lengths(12, 12), 4)
    kp, vp = kp.nan_to_num(0.5), vp.nan_to_num(-0.5)    # the clamped-to pages: finite
    num_pages = kp.shape[0]
    bad = table.clone()
    bad[0, 1], bad[1, 2] = num_pages + 5, -3
    clamped = table.clone()
    clamped[0, 1], clamped[1, 2] = num_pages - 1, 0
    o_bad, lse_bad = run(q, kp, vp, lengths(40, -2), 2, table=bad)
    o_ok, lse_ok = run(q, kp, vp, lengths(12, 0), 2, table=clamped)
    assert torch.equal(o_bad, o_ok) and torch.equal(lse_bad, lse_ok)
    assert torch.isneginf(lse_bad[1]).all()


def test_table_views_and_int64_tables():
    """A table that is a strided view (every other column) or int64 gives the same bits."""
    q, kc, vc, _ = make_qkv(2, 2, 1, 1, 24, 16, seed=8, device=DEVICE)
    lens = lengths(24, 10)
    kp, vp, table = paginate(kc, vc, lens, 3)
    o, lse = run(q, kp, vp, lens, 2, table=table)
    wide = torch.zeros(2, 2 * table.shape[1], dtype=torch.int32, device=DEVICE)
    wide[:, ::2] = table
    for t in (wide[:, ::2], table.long()):
        o2, lse2 = run(q, kp, vp, lens, 2, table=t)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_hypothesis_paged_is_dense_bit_for_bit():
    """Random page sizes, capacities, lengths (empty ones too), GQA groups, query counts, split counts
    and variants: the paged decode gives the dense decode's bits."""
    require_module("hypothesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    side = st.one_of(st.just(-1), st.integers(0, 20))

    @settings(max_examples=15, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(page_size=st.integers(1, 20), max_pages=st.integers(1, 4), heads=st.sampled_from([(2, 1), (4, 2)]),
           nq=st.integers(1, 3), num_splits=st.integers(1, 4), fractions=st.lists(st.floats(0, 1), min_size=2,
                                                                                  max_size=2),
           window=st.tuples(side, side), softcap=st.sampled_from([0.0, 1.0]), alibi=st.booleans(),
           sinks=st.booleans())
    def check(page_size, max_pages, heads, nq, num_splits, fractions, window, softcap, alibi, sinks):
        cap = page_size * max_pages
        q, kc, vc, _ = make_qkv(2, heads[0], heads[1], nq, cap, 16, seed=cap + nq, device=DEVICE)
        lens = lengths(*(round(f * cap) for f in fractions))
        kw = _variants(2, heads[0], window=window, softcap=softcap, alibi=alibi, sinks=sinks)
        kp, vp, table = paginate(kc, vc, lens, page_size)
        o, lse = run(q, kp, vp, lens, num_splits, kw, table)
        o_dense, lse_dense = run(q, kc, vc, lens, num_splits, kw)
        assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)

    check()


# ---------------------------------------------------------------------------------------------- append

def test_append_dense_writes_exactly_the_new_rows():
    """Dense cache (B, Hkv, Nmax, d), Nnew = 3 from a (B, Nnew, Hkv, d) buffer viewed (B, Hkv, Nnew, d):
    sequence 0 at 0, sequence 1 two rows before the end (its third row past the capacity: not
    written), sequence 2 full (nothing written); every other element untouched."""
    B, HKV, NMAX, D, NNEW = 3, 2, 10, 20, 3
    g = torch.Generator().manual_seed(9)
    kc = torch.randn(B, HKV, NMAX, D, generator=g).to(DEVICE)
    vc = torch.randn(B, HKV, NMAX, D, generator=g).to(DEVICE)
    k = torch.randn(B, NNEW, HKV, D, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(B, NNEW, HKV, D, generator=g).to(DEVICE).transpose(1, 2)
    want_k, want_v = kc.clone(), vc.clone()
    starts = (0, NMAX - 2, NMAX)
    for b, s in enumerate(starts):
        n = min(NNEW, NMAX - s)
        want_k[b, :, s:s + n], want_v[b, :, s:s + n] = k[b, :, :n], v[b, :, :n]
    lens = lengths(*starts)
    assert decode_v3.append_kv(kc, vc, k, v, lens) is None
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert torch.equal(lens, lengths(*starts))          # the caller advances the lengths


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_append_paged_writes_exactly_the_new_rows(page_size):
    """Paged cache, shuffled table with garbage past each length, k, v (B, Nnew, Hkv, d): rows land at
    page table[b, t // page_size], slot t % page_size, for t = len_b + i under the capacity; every
    other element of the cache (sentinel values) untouched."""
    B, HKV, D, NNEW, max_pages = 3, 2, 16, 4, 3
    cap = max_pages * page_size
    g = torch.Generator().manual_seed(10)
    num_pages = B * max_pages + 2
    table = torch.randperm(num_pages, generator=g)[:B * max_pages].view(B, max_pages).to(torch.int32)
    kp = torch.full((num_pages, page_size, HKV, D), 7777.0).to(DEVICE)
    vp = torch.full((num_pages, page_size, HKV, D), -7777.0).to(DEVICE)
    k = torch.randn(B, NNEW, HKV, D, generator=g).to(DEVICE)
    v = torch.randn(B, NNEW, HKV, D, generator=g).to(DEVICE)
    starts = (0, max(cap - 2, 0), cap)
    want_k, want_v = kp.clone(), vp.clone()
    for b, s in enumerate(starts):
        for i in range(NNEW):
            t = s + i
            if t < cap:
                want_k[table[b, t // page_size], t % page_size] = k[b, i]
                want_v[table[b, t // page_size], t % page_size] = v[b, i]
    table = table.to(DEVICE)
    decode_v3.append_kv(kp, vp, k, v, lengths(*starts), table)
    assert torch.equal(kp, want_k) and torch.equal(vp, want_v)


def test_append_then_decode_paged_equals_dense_and_the_oracle():
    """A decode step with append: three new tokens written into a paged and a dense cache, then
    attended causally (window (-1, 0)) over len + 3 keys: the same bits, and the oracle's answer."""
    B, H, HKV, D, NNEW, ps = 3, 4, 2, 16, 3, 5
    cap = 30
    q, kc, vc, _ = make_qkv(B, H, HKV, NNEW, cap, D, seed=11, device=DEVICE)
    lens = lengths(0, 11, cap - NNEW)
    kp, vp, table = paginate(kc, vc, torch.full((B,), cap), ps)   # every page valid
    g = torch.Generator().manual_seed(12)
    k = torch.randn(B, NNEW, HKV, D, generator=g).to(DEVICE)
    v = torch.randn(B, NNEW, HKV, D, generator=g).to(DEVICE)
    decode_v3.append_kv(kp, vp, k, v, lens, table)
    decode_v3.append_kv(kc, vc, k.transpose(1, 2), v.transpose(1, 2), lens)
    total = lens + NNEW
    kw = {"window_size": (-1, 0)}
    o, lse = run(q, kp, vp, total, 2, kw, table)
    o_dense, lse_dense = run(q, kc, vc, total, 2, kw)
    assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)
    ro, rl = oracle(q, kc, vc, total, causal=True)
    assert_close(o, ro, atol=2e-5, rtol=2e-5, name="o")
    assert_close(lse, rl, atol=2e-5, rtol=2e-5, name="lse")


def test_append_half_precision_and_no_new_tokens():
    """fp16 caches take fp16 rows bit for bit; Nnew = 0 writes nothing; cache_seqlens is required."""
    g = torch.Generator().manual_seed(13)
    kc = torch.randn(2, 1, 8, 16, generator=g).to(DEVICE, torch.float16)
    vc = kc.clone()
    k = torch.randn(2, 1, 2, 16, generator=g).to(DEVICE, torch.float16)
    before = kc.clone()
    decode_v3.append_kv(kc, vc, k, k, lengths(3, 6))
    assert torch.equal(kc[0, :, 3:5], k[0]) and torch.equal(kc[1, :, 6:8], k[1])
    assert torch.equal(kc[0, :, :3], before[0, :, :3]) and torch.equal(kc[0, :, 5:], before[0, :, 5:])
    decode_v3.append_kv(kc, vc, k[:, :, :0], k[:, :, :0], lengths(0, 0))
    assert torch.equal(kc[0, :, 3:5], k[0])
    with pytest.raises(TypeError, match="cache_seqlens"):
        decode_v3.append_kv(kc, vc, k, k, None)


# --------------------------------------------------------------------------------------------- compile

ARCHS = ("sm_75", "sm_80", "sm_90")


def test_paged_split_and_append_compile_for_sm75_sm80_sm90():
    """The PAGED split kernel (as the report compiles the dense one: fp16, d = 128, 4 query heads per kv
    head, one new token) and the paged append kernel compile on each architecture with no spills."""
    require_module("triton")
    require_tool("ptxas")
    require_tool("cuobjdump")
    from flashlib.tools import compile_report as cr
    version = cr._version(None)
    jobs = []
    for arch in ARCHS:
        for spec, _, _, cfg in cr._triton_jobs(arch, "fp16", version):
            if spec is decode_v3.SPLIT_SPEC:
                job = cr._job(spec, arch, "fp16", version, 128, cfg)
                job["constexprs"]["PAGED"] = True
                job["label"] += " paged"
                jobs.append(job)
        job = cr._job(decode_v3.APPEND_SPEC, arch, "fp16", version, 128, decode_v3.APPEND_SPEC.fixed)
        job["constexprs"]["PAGED"] = True
        job["label"] += " paged"
        jobs.append(job)
    rows = cr._rows_of(jobs)
    print("\n" + cr.format_report(rows))
    for row in rows:
        assert row["ok"], (row["kernel"], row["arch"], row["error"])
        assert row["spill_bytes"] == 0, (row["kernel"], row["arch"], row["spill_bytes"])
    split = [r for r in rows if r["kernel"] == "decode_split"]
    assert all(r["mma_instructions"] > 0 for r in split if r["tensor_cores"])
