"""flashlib.ladder.serving: varlen forward and backward against the float64 oracle (empty sequences,
length 1, lengths no block divides, Nq != Nk both ways, GQA, every variant; hypothesis over ragged
batches), the IO counts of packing and cascade, the merge of attention states (hypothesis:
associativity, commutativity, identity; the same operator as softmax.merge, decoding.combine, ring's
merge_partials and flashlib.merge_states), paged caches (page sizes 1, 3, 16, 256; shuffled and shared
block tables; in-place append), paged decode bit for bit the dense decode, cascade decode equal to plain
decode, and bad arguments refused naming them."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import need_module

need_module("hypothesis")  # skip the module, saying why, where hypothesis is missing
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flashlib.ladder import decoding, serving, softmax  # noqa: E402
from flashlib.ladder.dropout import keep_mask  # noqa: E402
from flashlib.ladder.iomodel import IOCounter  # noqa: E402
from flashlib.testing import assert_close, reference, reference_varlen  # noqa: E402

TOL = dict(atol=1e-11, rtol=1e-10)
SEED = (1234, 5678)


def packed(lens_q, lens_k, H=4, HKV=2, d=6, dv=None, seed=0):
    """q (Tq, H, d), k (Tk, Hkv, d), v (Tk, Hkv, dv), do, and int32 cu_seqlens, float64."""
    rng = np.random.default_rng(seed)
    dv = dv or d
    q = rng.standard_normal((sum(lens_q), H, d))
    k = rng.standard_normal((sum(lens_k), HKV, d))
    v = rng.standard_normal((sum(lens_k), HKV, dv))
    do = rng.standard_normal((sum(lens_q), H, dv))
    cu_q = np.r_[0, np.cumsum(lens_q)].astype(np.int32)
    cu_k = np.r_[0, np.cumsum(lens_k)].astype(np.int32)
    return q, k, v, do, cu_q, cu_k


def oracle_kw(kw, lens_q, lens_k, H, max_q=None, max_k=None):
    """The oracle's arguments: dropout as one keep mask per sequence, from offset
    offset + b * H * max_q * max_k (V25.md's counters)."""
    kw = dict(kw)
    if kw.pop("dropout_seed", None) is not None:
        max_q, max_k = max_q or max(lens_q), max_k or max(lens_k)
        seed, offset = SEED
        kw["dropout_masks"] = [keep_mask(seed, offset + b * H * max_q * max_k, (H, nq, nk), kw["dropout_p"])
                               for b, (nq, nk) in enumerate(zip(lens_q, lens_k))]
    return kw


def check_varlen(lens_q, lens_k, kw, *, H=4, HKV=2, d=6, dv=None, blocks=(None, None), seed=0):
    q, k, v, do, cu_q, cu_k = packed(lens_q, lens_k, H, HKV, d, dv, seed)
    o, lse = serving.varlen_forward(q, k, v, cu_q, cu_k, block_q=blocks[0], block_k=blocks[1], **kw)
    grads = serving.varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, block_q=blocks[0],
                                    block_k=blocks[1], **kw)
    o_ref, lse_ref, grads_ref = reference_varlen(q, k, v, cu_q, cu_k, do=do,
                                                 **oracle_kw(kw, lens_q, lens_k, H))
    assert o.shape == (q.shape[0], H, v.shape[-1]) and lse.shape == (H, q.shape[0])
    assert_close(o, o_ref, name="o", **TOL)
    assert_close(lse, lse_ref, name="lse", **TOL)
    assert len(grads) == len(grads_ref)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, grads_ref):
        assert_close(g, g_ref, name=name, **TOL)


SLOPES = np.array([[0.1, 0.5, 0.2, 0.3], [0.4, 0.05, 0.7, 0.2], [0.3, 0.3, 0.3, 0.3],
                   [0.9, 0.2, 0.1, 0.6], [0.2, 0.2, 0.8, 0.1]])       # (B, H)
SINKS = np.array([0.5, -1.0, 2.0, 0.0])                                 # (H,)
VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 2)),
    "window_causal": dict(window_size=(4, 0), causal=True),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=SLOPES),
    "alibi_per_head": dict(alibi_slopes=SLOPES[0]),
    "sinks": dict(sinks=SINKS),
    "dropout": dict(dropout_p=0.3, dropout_seed=SEED),
    "all": dict(causal=True, window_size=(5, 0), softcap=2.0, alibi_slopes=SLOPES, sinks=SINKS,
                dropout_p=0.2, dropout_seed=SEED),
}
# empty sequences both ways, length 1, Nq > Nk and Nq < Nk, lengths the odd blocks do not divide
LENGTHS = ([3, 0, 11, 1, 9], [7, 4, 0, 1, 2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_varlen_matches_the_oracle_with_every_variant(variant):
    check_varlen(*LENGTHS, VARIANTS[variant], blocks=(4, 3))


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_varlen_gqa_odd_dims_and_default_blocks(heads):
    kw = dict(VARIANTS["all"], alibi_slopes=SLOPES[:4])
    check_varlen([70, 1, 0, 66], [65, 1, 2, 130], kw, H=heads[0], HKV=heads[1], d=5, dv=3)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=4),
       heads=st.sampled_from([(1, 1), (2, 1), (3, 3)]), causal=st.booleans(),
       window=st.sampled_from([(-1, -1), (2, 0), (1, 3)]), blocks=st.tuples(st.integers(1, 5),
                                                                             st.integers(1, 5)),
       seed=st.integers(0, 2**16))
def test_varlen_on_random_ragged_batches(lens, heads, causal, window, blocks, seed):
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    if sum(lens_q) == 0 or sum(lens_k) == 0:
        lens_q[0], lens_k[0] = lens_q[0] + 1, lens_k[0] + 1
    check_varlen(lens_q, lens_k, dict(causal=causal, window_size=window), H=heads[0], HKV=heads[1],
                 d=4, blocks=blocks, seed=seed)


def test_varlen_empty_sequences_give_zero_or_the_sink_and_no_nan():
    q, k, v, do, cu_q, cu_k = packed([2, 0, 3], [0, 5, 2])
    o, lse = serving.varlen_forward(q, k, v, cu_q, cu_k, sinks=SINKS)
    assert (o[:2] == 0).all() and (lse[:, :2] == SINKS[:, None]).all()
    grads = serving.varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, sinks=SINKS)
    assert (grads[0][:2] == 0).all() and (grads[1][:5] == 0).all()
    assert not any(np.isnan(g).any() for g in grads)
    # rows past cu[-1] belong to no sequence: o = 0, lse = -inf, gradient 0
    o, lse = serving.varlen_forward(q, k, v, cu_q[:2], cu_k[:2])
    assert (o == 0).all() and np.isneginf(lse).all()


def test_varlen_keeps_float32_and_the_lse_layout():
    q, k, v, do, cu_q, cu_k = (x.astype(np.float32) if x.dtype == np.float64 else x
                               for x in packed([3, 5], [4, 4]))
    o, lse = serving.varlen_forward(q, k, v, cu_q, cu_k, causal=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32 and lse.shape == (4, 8)
    grads = serving.varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, causal=True)
    assert all(g.dtype == np.float32 for g in grads)


# ---- what packing saves, measured ----------------------------------------------------------------

def test_packing_does_the_sum_of_squares_padding_b_times_the_max_square():
    lens, d = [5, 60, 3, 20], 16
    work = serving.padding_work(lens, d=d)
    assert work.packed_flops == 4 * d * sum(n * n for n in lens)
    assert work.padded_flops == 4 * d * len(lens) * max(lens) ** 2
    assert work.packed_bytes < work.padded_bytes
    equal = serving.padding_work([32] * 4, d=d)            # nothing to pad: the same work
    assert equal.packed_flops == equal.padded_flops and equal.packed_bytes == equal.padded_bytes
    assert serving.padding_work([0, 7], d=4).packed_flops == 4 * 4 * 49
    with pytest.raises(ValueError, match="lengths must hold a length >= 1"):
        serving.padding_work([0, 0])
    with pytest.raises(TypeError, match="lengths must hold ints"):
        serving.padding_work([3, 2.5])


def test_the_varlen_counter_sums_the_sequences_counters():
    q, k, v, _, cu_q, cu_k = packed([9, 0, 17], [12, 3, 5])
    io = IOCounter()
    serving.varlen_forward(q, k, v, cu_q, cu_k, causal=True, block_q=4, block_k=4, io=io)
    from flashlib.ladder import fa2
    want = IOCounter()
    for rows, keys in ((slice(0, 9), slice(0, 12)), (slice(9, 26), slice(15, 20))):
        fa2.forward(q[rows].swapaxes(0, 1), np.repeat(k[keys].swapaxes(0, 1), 2, 0),
                    np.repeat(v[keys].swapaxes(0, 1), 2, 0), causal=True, block_q=4, block_k=4, io=want)
    assert (io.matmul_flops, io.hbm_bytes, io.tiles) == (want.matmul_flops, want.hbm_bytes, want.tiles)


# ---- the merge of attention states -----------------------------------------------------------------

def state(keys, q, k, v):
    """The attention state (o, lse) of queries q (Nq, d) over the keys ``keys`` (an index list)."""
    if len(keys) == 0:
        return np.zeros((q.shape[0], v.shape[-1])), np.full(q.shape[0], -np.inf)
    return reference(q, k[keys], v[keys])


def test_merging_the_states_of_disjoint_keys_gives_attention_over_their_union():
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((12, 4)), rng.standard_normal((12, 3))
    parts = [[0, 5, 7], [1, 2], [3, 4, 6, 8, 9, 10, 11], []]
    o, lse = serving.merge(*state(parts[0], q, k, v), *state(parts[1], q, k, v))
    o, lse = serving.merge(o, lse, *state(parts[2] + parts[3], q, k, v))
    o_ref, lse_ref = reference(q, k, v)
    assert_close(o, o_ref, **TOL)
    assert_close(lse, lse_ref, **TOL)
    states = [state(p, q, k, v) for p in parts]
    o_many, lse_many = serving.merge_many(np.stack([s[0] for s in states]), np.stack([s[1] for s in states]))
    assert_close(o_many, o_ref, **TOL)
    assert_close(lse_many, lse_ref, **TOL)


_finite = st.floats(-30, 30, allow_nan=False)
_lse = st.one_of(_finite, st.just(-np.inf))


def _states(n):
    return st.lists(st.tuples(st.lists(_finite, min_size=2, max_size=2), _lse), min_size=n, max_size=n)


def _as_state(s):
    (o, lse) = s
    lse = np.array(lse)
    return (np.zeros(2) if np.isneginf(lse) else np.array(o)), lse


@settings(max_examples=200, deadline=None)
@given(states=_states(3))
def test_merge_is_associative_commutative_with_the_empty_state_as_identity(states):
    a, b, c = (_as_state(s) for s in states)
    ab_c = serving.merge(*serving.merge(*a, *b), *c)
    a_bc = serving.merge(*a, *serving.merge(*b, *c))
    ba = serving.merge(*b, *a)
    ab = serving.merge(*a, *b)
    for x, y in ((ab_c, a_bc), (ab, ba)):
        assert_close(x[0], y[0], atol=1e-12, rtol=1e-12)
        assert_close(x[1], y[1], atol=1e-12, rtol=1e-12)
    empty = (np.zeros(2), np.array(-np.inf))
    for x in (serving.merge(*a, *empty), serving.merge(*empty, *a)):
        assert np.array_equal(x[0], a[0]) and x[1] == a[1]
    o, lse = serving.merge(*empty, *empty)
    assert (o == 0).all() and np.isneginf(lse) and not np.isnan(o).any()
    stacked = serving.merge_many(np.stack([a[0], b[0], c[0]]), np.stack([a[1], b[1], c[1]]))
    assert_close(stacked[0], ab_c[0], atol=1e-12, rtol=1e-12)
    assert_close(stacked[1], ab_c[1], atol=1e-12, rtol=1e-12)


def test_merge_is_chapter_2s_merge_of_m_and_l_carried_with_the_output():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 10)) * 5                   # 6 rows of scores; the keys split 4 | 6
    v = rng.standard_normal((10, 3))
    states = []
    for part in (slice(0, 4), slice(4, 10)):
        m, l = softmax.online_state(x[:, part])
        p = softmax.safe_exp_diff(x[:, part], m[:, None]) / l[:, None]
        states.append((p @ v[part], softmax.lse_from_state(m, l), m, l))
    (o_a, lse_a, m_a, l_a), (o_b, lse_b, m_b, l_b) = states
    o, lse = serving.merge(o_a, lse_a, o_b, lse_b)
    m, l = softmax.merge(m_a, l_a, m_b, l_b)
    assert_close(lse, softmax.lse_from_state(m, l), **TOL)          # the same lse
    assert_close(o, softmax.safe_softmax(x) @ v, **TOL)             # and the whole row's output


def test_merge_many_is_flash_decodings_combine():
    rng = np.random.default_rng(5)
    o = rng.standard_normal((4, 3, 5, 2))
    lse = rng.standard_normal((4, 3, 5)) * 10
    lse[1, 0] = -np.inf                                    # an empty split
    lse[:, 2, 1] = -np.inf                                 # every split empty for one row
    o_many, lse_many = serving.merge_many(o, lse)
    o_comb, lse_comb = decoding.combine(o, lse)
    assert_close(o_many, o_comb, **TOL)
    assert_close(lse_many, lse_comb, **TOL)
    assert (o_many[2, 1] == 0).all() and np.isneginf(lse_many[2, 1])


def test_merge_is_ring_attentions_merge_partials_and_the_torch_merge_states():
    torch = pytest.importorskip("torch")
    from flashlib import merge_states
    from flashlib.parallel.ring import merge_partials
    rng = np.random.default_rng(6)
    o_a, o_b = rng.standard_normal((2, 3, 7, 4))
    lse_a, lse_b = rng.standard_normal((2, 3, 7)) * 3
    lse_a[0, :2] = -np.inf                                 # empty rows in one state
    lse_a[1, 3], lse_b[1, 3] = -np.inf, -np.inf            # and in both
    o, lse = serving.merge(o_a, lse_a, o_b, lse_b)
    t = [torch.from_numpy(x) for x in (o_a, lse_a, o_b, lse_b)]
    for fn in (merge_partials, merge_states):
        o_t, lse_t = fn(*t)
        assert_close(o_t, o, **TOL)
        assert_close(lse_t, lse, **TOL)


# ---- paged caches ----------------------------------------------------------------------------------

def paged_pool(dense, page_size, rng, *, spare=3, table=None):
    """``dense (B, Nmax, Hkv, d)`` copied into a pool ``(num_pages, page_size, Hkv, d)`` of noise in
    shuffled page order; the block table ``(B, max_pages)`` int32 (``table``: reuse one)."""
    B, NMAX = dense.shape[:2]
    max_pages = -(-NMAX // page_size)
    num_pages = B * max_pages + spare
    if table is None:
        table = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
    pool = rng.standard_normal((num_pages, page_size, *dense.shape[2:]))
    for b in range(B):
        for t in range(NMAX):
            pool[table[b, t // page_size], t % page_size] = dense[b, t]
    return pool, table


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_gather_pages_reads_a_sequence_through_its_table(page_size):
    rng = np.random.default_rng(page_size)
    dense = rng.standard_normal((3, 37, 2, 4))             # (B, N, Hkv, d)
    pool, table = paged_pool(dense, page_size, rng)
    for b, n in enumerate((37, 1, 0)):
        assert np.array_equal(serving.gather_pages(pool, table[b], n), dense[b, :n])
    garbage = table.copy()
    garbage[:, -1:] = 10**6 if table.shape[1] > 1 else garbage[:, -1:]
    n = (table.shape[1] - 1) * page_size                   # the last page is never read
    assert np.array_equal(serving.gather_pages(pool, garbage[0], n), dense[0, :n])
    clamped = serving.gather_pages(pool, np.array([-4, 10**6]), 2 * page_size)
    assert np.array_equal(clamped[:page_size], pool[0]) and np.array_equal(clamped[page_size:], pool[-1])


def test_append_writes_dense_and_paged_caches_in_place():
    rng = np.random.default_rng(7)
    B, HKV, NMAX, D, NNEW = 3, 2, 11, 4, 3
    k_dense = np.zeros((B, HKV, NMAX, D))
    v_dense = np.zeros((B, HKV, NMAX, D))
    k_new, v_new = rng.standard_normal((2, B, HKV, NNEW, D))
    lens = np.array([0, 5, 8], dtype=np.int32)
    out = serving.append(k_dense, v_dense, k_new, v_new, lens)
    assert out.tolist() == [3, 8, 11] and lens.tolist() == [0, 5, 8]   # the caller advances its own
    for b, s in enumerate(lens):
        assert np.array_equal(k_dense[b, :, s:s + NNEW], k_new[b])
        assert np.array_equal(v_dense[b, :, s:s + NNEW], v_new[b])
    assert (k_dense[0, :, NNEW:] == 0).all()
    # paged: the same tokens through a shuffled table with pages of 3
    table = np.array([[4, 0, 7, 1], [2, 9, 5, 3], [8, 6, 10, 11]], dtype=np.int32)
    k_pool, v_pool = np.zeros((12, 3, HKV, D)), np.zeros((12, 3, HKV, D))
    serving.append(k_pool, v_pool, k_new.swapaxes(1, 2), v_new.swapaxes(1, 2), lens, table)
    for b, n in enumerate(out):
        assert np.array_equal(serving.gather_pages(k_pool, table[b], n), k_dense[b, :, :n].swapaxes(0, 1))
        assert np.array_equal(serving.gather_pages(v_pool, table[b], n), v_dense[b, :, :n].swapaxes(0, 1))


def test_append_refuses_a_write_past_the_capacity_before_writing():
    k_cache, v_cache = np.zeros((2, 1, 4, 2)), np.zeros((2, 1, 4, 2))
    new = np.ones((2, 1, 2, 2))
    with pytest.raises(ValueError, match="within the cache's capacity 4"):
        serving.append(k_cache, v_cache, new, new, np.array([1, 3]))
    assert (k_cache == 0).all()                            # nothing written
    pool = np.zeros((3, 2, 1, 2))
    table = np.array([[0, 1], [2, 2]], dtype=np.int32)
    with pytest.raises(ValueError, match="capacity 4"):
        serving.append(pool, pool.copy(), new.swapaxes(1, 2), new.swapaxes(1, 2), np.array([0, 3]), table)
    with pytest.raises(ValueError, match="block_table must point into the cache's 3 pages"):
        serving.append(pool, pool.copy(), new.swapaxes(1, 2), new.swapaxes(1, 2), np.array([0, 0]),
                       np.array([[0, 1], [7, 2]], dtype=np.int32))
    assert (pool == 0).all()
    with pytest.raises(TypeError, match="cache_seqlens must be an integer array"):
        serving.append(k_cache, v_cache, new, new, np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="differ in their last dim only"):
        serving.append(k_cache, v_cache, new, new[:, :, :1], np.array([0, 0]))


DECODE_VARIANTS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(5, 0)),
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes=SLOPES[:3]),
    "sinks": dict(sinks=SINKS),
}


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_paged_decode_is_the_dense_decode_bit_for_bit_and_the_oracle(page_size, variant):
    rng = np.random.default_rng(page_size)
    B, H, HKV, NQ, NMAX, D = 3, 4, 2, 3, 29, 5
    q = rng.standard_normal((B, H, NQ, D))
    k, v = rng.standard_normal((2, B, NMAX, HKV, D))
    k_pool, table = paged_pool(k, page_size, rng)
    v_pool, _ = paged_pool(v, page_size, rng, table=table)
    lens = np.array([29, 2, 0])
    kw = DECODE_VARIANTS[variant]
    o, lse = serving.paged_decode(q, k_pool, v_pool, table, lens, num_splits=3, **kw)
    for b, n in enumerate(lens):
        kwb = {name: x[b] if name == "alibi_slopes" else x for name, x in kw.items()}
        if n == 0:
            assert (o[b] == 0).all() and (lse[b] == np.reshape(kw.get("sinks", -np.inf), (-1, 1))).all()
            continue
        k_b, v_b = (np.repeat(x[b, :n].swapaxes(0, 1), 2, axis=0) for x in (k, v))
        o_b, lse_b = decoding.forward(q[b], k_b, v_b, num_splits=3, **kwb)
        assert np.array_equal(o[b], o_b) and np.array_equal(lse[b], lse_b)
        o_ref, lse_ref = reference(q[b], k_b, v_b, **kwb)
        assert_close(o[b], o_ref, **TOL)
        assert_close(lse[b], lse_ref, **TOL)


def test_paged_decode_with_a_shared_table_clamped_lengths_and_capacity():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 2, 1, 4))
    k_pool, v_pool = rng.standard_normal((2, 5, 3, 1, 4))
    table = np.array([[3, 0, 4], [3, 0, 4]], dtype=np.int32)   # two sequences, one set of pages
    o, lse = serving.paged_decode(q, k_pool, v_pool, table, np.array([9, 9]), num_splits=2)
    q2 = np.concatenate([q[:1], q[:1]])
    o2, _ = serving.paged_decode(q2, k_pool, v_pool, table, np.array([9, 9]), num_splits=2)
    assert np.array_equal(o2[0], o2[1]) and np.array_equal(o2[0], o[0])
    full = serving.paged_decode(q, k_pool, v_pool, table, None, num_splits=2)
    over = serving.paged_decode(q, k_pool, v_pool, table, np.array([50, 9]), num_splits=2)
    assert np.array_equal(full[0][0], over[0][0])          # a length past the capacity: clamped to 9
    assert np.array_equal(full[0][1], o[1])
    o, lse = serving.paged_decode(q, k_pool, v_pool, table, np.array([-1, 9]), num_splits=1)
    assert (o[0] == 0).all() and np.isneginf(lse[0]).all()


def test_append_then_paged_decode_with_causal_new_tokens():
    """Decode with append, as the API does it: write Nnew tokens, then attend len + Nnew keys with the
    new queries causal among themselves (query i sees j <= i + len_b - Nq)."""
    rng = np.random.default_rng(9)
    B, H, NNEW, D, PS = 2, 2, 3, 4, 3
    lens = np.array([4, 0], dtype=np.int32)
    table = np.array([[5, 2, 0], [1, 4, 3]], dtype=np.int32)
    k_pool, v_pool = rng.standard_normal((2, 6, PS, H, D))
    k_new, v_new, q = rng.standard_normal((3, B, NNEW, H, D))
    serving.append(k_pool, v_pool, k_new, v_new, lens, table)
    q = q.swapaxes(1, 2)                                   # (B, H, Nq, d)
    o, lse = serving.paged_decode(q, k_pool, v_pool, table, lens + NNEW, num_splits=2, causal=True)
    for b, n in enumerate(lens + NNEW):
        k_b = serving.gather_pages(k_pool, table[b], n).swapaxes(0, 1)
        v_b = serving.gather_pages(v_pool, table[b], n).swapaxes(0, 1)
        assert np.array_equal(k_b[:, -NNEW:], k_new[b].swapaxes(0, 1))
        o_ref, lse_ref = reference(q[b], k_b, v_b, causal=True)
        assert_close(o[b], o_ref, **TOL)
        assert_close(lse[b], lse_ref, **TOL)


# ---- cascade decoding --------------------------------------------------------------------------------

def cascade_case(B=3, H=4, HKV=2, NQ=2, P=13, suffixes=(5, 0, 9), D=4, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, NQ, D))
    k_p, v_p = rng.standard_normal((2, HKV, P, D))
    k_s = [rng.standard_normal((HKV, s, D)) for s in suffixes]
    v_s = [rng.standard_normal((HKV, s, D)) for s in suffixes]
    return q, k_p, v_p, k_s, v_s


@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(softcap=1.5, sinks=SINKS),
                                dict(num_splits=3, causal=True, sinks=SINKS)],
                         ids=["plain", "causal", "softcap_sinks", "splits"])
def test_cascade_decode_is_plain_decode_of_each_whole_cache(kw):
    suffixes = (5, 2, 9) if kw.get("causal") else (5, 0, 9)
    q, k_p, v_p, k_s, v_s = cascade_case(suffixes=suffixes)
    o, lse = serving.cascade_decode(q, k_p, v_p, k_s, v_s, **kw)
    plain_kw = {name: x for name, x in kw.items() if name != "num_splits"}
    for b in range(q.shape[0]):
        k_b, v_b = (np.repeat(np.concatenate([p, s[b]], axis=1), 2, axis=0)
                    for p, s in ((k_p, k_s), (v_p, v_s)))
        o_ref, lse_ref = reference(q[b], k_b, v_b, **plain_kw)
        assert_close(o[b], o_ref, **TOL)
        assert_close(lse[b], lse_ref, **TOL)


def test_cascade_reads_the_prefix_once_plain_decode_reads_it_per_sequence():
    """Measured: growing the prefix by dP keys adds 2 * H * dP * d elements (K and V) to cascade's
    reads once, and B times to plain decoding's."""
    B, H, d, bpe = 4, 2, 8, 2
    small, large = (serving.cascade_work(B, p, 6, heads=H, d=d) for p in (32, 96))
    per_read = 2 * H * (96 - 32) * d * bpe
    assert large.plain_bytes - small.plain_bytes == B * per_read
    assert large.cascade_bytes - small.cascade_bytes == per_read
    assert large.cascade_bytes < large.plain_bytes
    with pytest.raises(ValueError, match="batch, prefix, heads and d must be >= 1"):
        serving.cascade_work(0, 8, 8)


def test_cascade_decode_refuses_bad_suffixes():
    q, k_p, v_p, k_s, v_s = cascade_case()
    with pytest.raises(ValueError, match="must hold B = 3 arrays"):
        serving.cascade_decode(q, k_p, v_p, k_s[:2], v_s[:2])
    with pytest.raises(ValueError, match="at least Nq - 1 = 1 keys"):
        serving.cascade_decode(q, k_p, v_p, k_s, v_s, causal=True)          # suffix 1 is empty
    with pytest.raises(ValueError, match=r"k_suffixes\[0\], v_suffixes\[0\] must be"):
        serving.cascade_decode(q, k_p, v_p, [k_s[0][:1]] + k_s[1:], v_s)
    with pytest.raises(ValueError, match="sinks must broadcast"):
        serving.cascade_decode(q, k_p, v_p, k_s, v_s, sinks=np.zeros(3))


# ---- bad arguments -------------------------------------------------------------------------------------

def test_varlen_refuses_bad_arguments_naming_them():
    q, k, v, do, cu_q, cu_k = packed([2, 3], [4, 1])
    call = serving.varlen_forward
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        call(q, k, v, np.array([1, 2, 5]), cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease"):
        call(q, k, v, cu_q, np.array([0, 4, 3]))
    with pytest.raises(ValueError, match="end at most at 5"):
        call(q, k, v, cu_q, np.array([0, 4, 6]))
    with pytest.raises(TypeError, match="cu_seqlens_q must be a 1-D integer array"):
        call(q, k, v, cu_q.astype(float), cu_k)
    with pytest.raises(ValueError, match="the same length B"):
        call(q, k, v, cu_q, cu_k[:2])
    with pytest.raises(ValueError, match=r"max_seqlen_k must be >= every length \(4\)"):
        call(q, k, v, cu_q, cu_k, 3, 3)
    with pytest.raises(ValueError, match="Hkv dividing H"):
        call(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), cu_q, cu_k)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        call(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match="alibi_slopes must broadcast to"):
        call(q, k, v, cu_q, cu_k, alibi_slopes=np.ones((3, 4)))
    with pytest.raises(ValueError, match="dropout_p > 0 needs dropout_seed"):
        call(q, k, v, cu_q, cu_k, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"lse must have shape \(4, 5\)"):
        serving.varlen_backward(q, k, v, q, q[0], do, cu_q, cu_k)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="q must be a NumPy array"):
        call(torch.from_numpy(q), k, v, cu_q, cu_k)


def test_paged_decode_and_merge_refuse_bad_arguments_naming_them():
    q = np.zeros((2, 2, 1, 4))
    pool = np.zeros((3, 2, 1, 4))
    table = np.zeros((2, 2), dtype=np.int32)
    with pytest.raises(TypeError, match="block_table must be an integer array"):
        serving.paged_decode(q, pool, pool, table.astype(float), None, num_splits=1)
    with pytest.raises(TypeError, match=r"block_table must be an integer array \(B, max_pages\) with B = 2"):
        serving.paged_decode(q, pool, pool, table[:1], None, num_splits=1)
    with pytest.raises(ValueError, match="page_size >= 1"):
        serving.paged_decode(q, pool[:, :0], pool[:, :0], table, None, num_splits=1)
    with pytest.raises(TypeError, match=r"cache_seqlens must be an integer array \(2,\)"):
        serving.paged_decode(q, pool, pool, table, np.array([1]), num_splits=1)
    with pytest.raises(ValueError, match="o_a and o_b must have one shape"):
        serving.merge(np.zeros((2, 3)), np.zeros(2), np.zeros((2, 4)), np.zeros(2))
    with pytest.raises(ValueError, match=r"lse_b must have shape \(2,\)"):
        serving.merge(np.zeros((2, 3)), np.zeros(2), np.zeros((2, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="S >= 1"):
        serving.merge_many(np.zeros((0, 2, 3)), np.zeros((0, 2)))
