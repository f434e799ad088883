"""Serving in NumPy: ragged (varlen) batches, paged KV caches, the merge of
attention states, and cascade (shared-prefix) decoding.

* Ragged batches (:func:`varlen_forward`, :func:`varlen_backward`): B
  sequences packed end to end, token-major ``(total, H, d)``, sequence b the
  rows ``cu_seqlens[b]:cu_seqlens[b + 1]``. Each sequence is its own
  FlashAttention-2 problem (masks bottom-right per sequence), so packing does
  ``sum_b len_b^2`` work where padding to the longest does
  ``B * max_len^2`` (:func:`padding_work` measures both with the IO counter).
* Paged caches (:func:`gather_pages`, :func:`append`, :func:`paged_decode`):
  a cache ``(num_pages, page_size, Hkv, d)`` shared by every sequence, and a
  block table ``(B, max_pages)``: token t of sequence b lives in page
  ``block_table[b, t // page_size]``, row ``t % page_size``.
* The merge of attention states (:func:`merge`, :func:`merge_many`,
  FlashInfer's): ``(o, lse)`` over disjoint key sets combine into the state
  over their union. It is chapter 2's :func:`~flashlib.ladder.softmax.merge`
  of ``(m, l)`` carried with the output, chapter 6's
  :func:`~flashlib.ladder.decoding.combine` and ring attention's
  :func:`~flashlib.parallel.ring.merge_partials`: one operator.
* Cascade decoding (:func:`cascade_decode`): B sequences that share a prompt
  prefix attend it once, all their queries stacked, then their own suffix;
  a merge joins the two.

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

import numbers
from functools import reduce
from typing import NamedTuple

import numpy as np

from . import decoding, fa2
from ._checks import acc_dtype, check_floating, check_io, out_dtype
from .iomodel import IOCounter
from .softmax import safe_exp_diff

__all__ = ["varlen_forward", "varlen_backward", "padding_work",
           "merge", "merge_many", "gather_pages", "append", "paged_decode",
           "cascade_decode", "cascade_work"]


# ---- ragged batches ----------------------------------------------------------

def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                   max_seqlen_k=None, *, causal=False, scale=None,
                   block_q=None, block_k=None, io=None, **variants):
    """FlashAttention-2 over a packed (ragged) batch, one sequence at a time.

    Args:
        q ``(total_q, H, d)``, k ``(total_k, Hkv, d)``, v ``(total_k, Hkv,
            dv)``: the sequences packed end to end (token-major), Hkv dividing
            H (GQA: query head h reads kv head ``h // (H // Hkv)``).
        cu_seqlens_q, cu_seqlens_k: integer ``(B + 1,)``, from 0,
            non-decreasing: sequence b is rows ``cu[b]:cu[b + 1]``. Empty
            sequences are allowed; rows past ``cu[-1]`` belong to none.
        max_seqlen_q, max_seqlen_k: ints >= every length (None: the longest);
            they fix dropout's counters, as they size a kernel's grid.
        causal, scale, block_q, block_k, io: as for
            :func:`flashlib.ladder.fa2.forward`; masks align bottom-right per
            sequence.
        variants: fa2's (``window_size``, ``softcap``, ``sinks (H,)``,
            ``dropout_p`` with ``dropout_seed``) and ``alibi_slopes (B, H)``
            or ``(H,)``, per sequence. Dropout: sequence b draws the counters
            of its own ``(H, nq_b, nk_b)`` problem from offset
            ``offset + b * H * max_seqlen_q * max_seqlen_k``.

    Returns:
        ``(o, lse)``: ``o (total_q, H, dv)``, ``lse (H, total_q)``. A row
        that sees no key (``nk_b = 0``, or the causal mask) has ``o = 0`` and
        ``lse = -inf`` (the sink with sinks).

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    seqs, per_seq, io = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, io,
                                      variants)
    o = np.zeros((*q.shape[:-1], v.shape[-1]), out_dtype(q, k, v))
    lse = np.full(q.shape[-2::-1], -np.inf, acc_dtype(q, k, v))
    for b, rows, keys, q_b, k_b, v_b in seqs:        # one sequence at a time
        if q_b.shape[-2] == 0:
            continue                                 # no query: nothing
        kw = per_seq(b)
        if k_b.shape[-2] == 0:                       # no key: o = 0 and
            lse[:, rows] = _empty_lse(kw)            # lse = -inf (or sink)
            continue
        # (H, nq_b, dv), (H, nq_b)
        o_b, lse_b = fa2.forward(q_b, k_b, v_b, causal=causal, scale=scale,
                                 block_q=block_q, block_k=block_k, io=io,
                                 **kw)
        o[rows] = o_b.swapaxes(0, 1)                 # (nq_b, H, dv)
        lse[:, rows] = lse_b
    return o, lse


def varlen_backward(q, k, v, o, lse, do, cu_seqlens_q, cu_seqlens_k,
                    max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                    scale=None, block_q=None, block_k=None, io=None,
                    **variants):
    """The backward of :func:`varlen_forward`, one sequence at a time
    (:func:`flashlib.ladder.fa2.backward`).

    Args:
        q, k, v, the lengths and the variants: as for :func:`varlen_forward`;
        o ``(total_q, H, dv)`` and lse ``(H, total_q)`` from it; do like o.

    Returns:
        ``(dq, dk, dv)`` shaped like q, k, v (dk, dv summed over each GQA
        group); with ``sinks``, a fourth: ``dsinks (H,)`` summed over the
        sequences. Rows of empty sequences get 0.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    seqs, per_seq, io = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, io,
                                      variants, o=o, lse=lse, do=do)
    acc, hkv = acc_dtype(q, k, v, do), k.shape[1]
    dq, dk, dv = (np.zeros(x.shape, acc) for x in (q, k, v))
    dsinks = np.zeros(q.shape[1], acc)               # (H,)
    for b, rows, keys, q_b, k_b, v_b in seqs:
        if q_b.shape[-2] == 0 or k_b.shape[-2] == 0:
            continue                                 # nothing seen: grads 0
        o_b, do_b = o[rows].swapaxes(0, 1), do[rows].swapaxes(0, 1)
        # (H, nq_b, d), (H, nk_b, d), (H, nk_b, dv)[, (H,)]
        dq_b, dk_b, dv_b, *ds = fa2.backward(
            q_b, k_b, v_b, o_b, lse[:, rows], do_b, causal=causal,
            scale=scale, block_q=block_q, block_k=block_k, io=io,
            **per_seq(b))
        dq[rows] = dq_b.swapaxes(0, 1)               # (nq_b, H, d)
        # GQA: sum each group's gradients onto its kv head  (nk_b, Hkv, d)
        nk = k_b.shape[-2]
        dk[keys] = dk_b.reshape(hkv, -1, nk, k.shape[-1]).sum(1).swapaxes(0, 1)
        dv[keys] = dv_b.reshape(hkv, -1, nk, v.shape[-1]).sum(1).swapaxes(0, 1)
        dsinks += ds[0] if ds else 0.0
    dt = out_dtype(q, k, v, do)
    grads = dq.astype(dt), dk.astype(dt), dv.astype(dt)
    return grads if variants.get("sinks") is None else (*grads, dsinks)


class PaddingWork(NamedTuple):
    """What :func:`padding_work` measured: matmul flops and HBM bytes of the
    packed batch and of the same batch padded to its longest sequence.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    packed_flops: int
    padded_flops: int
    packed_bytes: int
    padded_bytes: int


def padding_work(lengths, *, d=16, causal=False, bytes_per_element=2):
    """Measure what padding costs: run :func:`varlen_forward` on sequences of
    ``lengths`` packed end to end, and :func:`flashlib.ladder.fa2.forward` on
    the same batch padded to ``(B, 1, max_len, d)`` (one head each), each
    with an :class:`~flashlib.ladder.iomodel.IOCounter`.

    Without ``causal``, the packed matmul flops are ``4 d sum_b len_b^2``
    and the padded ones ``4 d B max_len^2`` (with ``causal``, both skip the
    tiles the mask hides): counted, not typed in. Returns a
    :class:`PaddingWork`.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    lens = [_count(n, "lengths") for n in _as_list(lengths, "lengths")]
    if not lens or max(lens) == 0:
        raise ValueError(f"lengths must hold a length >= 1, got {lens}")
    cu = np.concatenate([[0], np.cumsum(lens)])      # (B + 1,)
    x = np.ones((int(cu[-1]), 1, d), np.float32)     # (total, 1, d)
    packed = IOCounter(bytes_per_element)
    varlen_forward(x, x, x, cu, cu, causal=causal, io=packed)
    padded = IOCounter(bytes_per_element)
    pad = np.ones((len(lens), 1, max(lens), d), np.float32)  # (B, 1, N, d)
    fa2.forward(pad, pad, pad, causal=causal, io=padded)
    return PaddingWork(packed.matmul_flops, padded.matmul_flops,
                       packed.hbm_bytes, padded.hbm_bytes)


# ---- the merge of attention states -------------------------------------------

def merge(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint key sets (FlashInfer's
    operator): ``lse = logaddexp(lse_a, lse_b)``,
    ``o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b``.

    ``o (..., dv)`` normalized outputs, ``lse (...)`` their log-sum-exps
    (``o.shape[:-1]``). Associative and commutative; the empty state
    ``(0, -inf)`` is its identity, and two empty states give ``(0, -inf)``,
    never NaN. It is chapter 2's ``merge`` of ``(m, l)`` with
    ``l = exp(lse - m)`` carried along with o.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    o_a, lse_a, o_b, lse_b = _check_states(o_a, lse_a, o_b, lse_b)
    lse = np.logaddexp(lse_a, lse_b)                 # (...)
    w_a = safe_exp_diff(lse_a, lse)[..., None]       # exp(lse_a - lse)
    w_b = safe_exp_diff(lse_b, lse)[..., None]       # 0 for an empty state
    return w_a * o_a + w_b * o_b, lse


def merge_many(o, lse):
    """Merge S states: :func:`merge` folded over the first axis (any order
    gives the same: it is associative and commutative). ``o (S, ..., dv)``,
    ``lse (S, ...)``, S >= 1. This is Flash-Decoding's
    :func:`~flashlib.ladder.decoding.combine` of its splits.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    o, lse = check_floating(o, "o"), check_floating(lse, "lse")
    if o.ndim < 2 or o.shape[:-1] != lse.shape or o.shape[0] == 0:
        raise ValueError(f"o must be (S, ..., dv) and lse (S, ...) with "
                         f"S >= 1, got o {o.shape} and lse {lse.shape}")
    return reduce(lambda a, b: merge(*a, *b), zip(o, lse))


# ---- paged caches ------------------------------------------------------------

def gather_pages(cache, table_row, length):
    """The first ``length`` tokens of one sequence of a paged cache:
    ``cache (num_pages, page_size, Hkv, d)``, ``table_row (max_pages,)`` its
    block-table row; token t is row ``t % page_size`` of page
    ``table_row[t // page_size]``. Page indices are clamped into
    ``[0, num_pages - 1]``, as the kernels do (entries past the length are
    never read). Returns ``(length, Hkv, d)``.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    num_pages, page_size = cache.shape[:2]
    t = np.arange(length)                            # logical token index
    page = np.clip(np.asarray(table_row)[t // page_size], 0, num_pages - 1)
    return cache[page, t % page_size]                # (length, Hkv, d)


def append(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Write new tokens into a cache in place, at positions
    ``[cache_seqlens[b], cache_seqlens[b] + Nnew)`` of each sequence b.

    Dense: caches ``(B, Hkv, Nmax, d)``, ``k, v (B, Hkv, Nnew, d)``. Paged
    (``block_table (B, max_pages)``): caches ``(num_pages, page_size, Hkv,
    d)``, ``k, v (B, Nnew, Hkv, d)``. A position at or past the capacity
    (``Nmax``, or ``max_pages * page_size``) is a ValueError, raised before
    anything is written. Returns the new lengths ``cache_seqlens + Nnew``
    (the caller advances its own).

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    lens, n_new = _check_append(k_cache, v_cache, k, v, cache_seqlens,
                                block_table)
    for b, start in enumerate(lens):
        t = np.arange(start, start + n_new)          # positions written
        if block_table is None:                      # (Hkv, Nnew, d)
            k_cache[b, :, t[0]:t[0] + n_new] = k[b]
            v_cache[b, :, t[0]:t[0] + n_new] = v[b]
        else:                                        # (Nnew, Hkv, d)
            page_size = k_cache.shape[1]
            page = np.asarray(block_table)[b, t // page_size]
            k_cache[page, t % page_size] = k[b]
            v_cache[page, t % page_size] = v[b]
    return lens + n_new


def paged_decode(q, k_cache, v_cache, block_table, cache_seqlens, *,
                 num_splits, causal=False, scale=None, io=None, **variants):
    """Flash-Decoding over a paged cache: each sequence's pages gathered
    through the block table, then :func:`flashlib.ladder.decoding.forward`.

    Args:
        q ``(B, H, Nq, d)``; k_cache, v_cache ``(num_pages, page_size, Hkv,
            d)``; block_table ``(B, max_pages)`` ints; cache_seqlens ``(B,)``
            the lengths to attend (None: the capacity ``max_pages *
            page_size``), clamped into ``[0, capacity]`` as the kernels do.
        num_splits, causal (query i sees key j iff ``j <= i + len_b - Nq``),
            scale, io: as for decoding.forward.
        variants: ``window_size``, ``softcap``, ``alibi_slopes (B, H)`` or
            ``(H,)``, ``sinks (H,)``.

    Returns:
        ``(o (B, H, Nq, dv), lse (B, H, Nq))``; a sequence of length 0 gets
        ``o = 0`` and ``lse = -inf`` (the sink with sinks).

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    lens, group, per_seq = _check_paged(q, k_cache, v_cache, block_table,
                                        cache_seqlens, variants)
    dt = out_dtype(q, k_cache, v_cache)
    o = np.zeros((*q.shape[:-1], v_cache.shape[-1]), dt)
    lse = np.full(q.shape[:-1], -np.inf, acc_dtype(q, k_cache, v_cache))
    for b, n in enumerate(lens):
        kw = per_seq(b)
        if n == 0:                                   # nothing to attend
            lse[b] = _empty_lse(kw)
            continue
        # (len_b, Hkv, d) -> (H, len_b, d): the pages, read in table order
        k_b = gather_pages(k_cache, block_table[b], n).swapaxes(0, 1)
        v_b = gather_pages(v_cache, block_table[b], n).swapaxes(0, 1)
        k_b, v_b = (np.repeat(x, group, axis=0) for x in (k_b, v_b))
        o[b], lse[b] = decoding.forward(q[b], k_b, v_b, num_splits=num_splits,
                                        causal=causal, scale=scale, io=io,
                                        **kw)
    return o, lse


def cascade_decode(q, k_prefix, v_prefix, k_suffixes, v_suffixes, *,
                   num_splits=1, causal=False, scale=None, io=None,
                   softcap=0.0, sinks=None):
    """Decoding for B sequences that share a prompt prefix (cascade
    attention): the prefix is attended ONCE for all ``B * Nq`` queries (and
    the query heads of a GQA group) stacked, each suffix by its own
    sequence, and :func:`merge` joins the two states.

    Args:
        q ``(B, H, Nq, d)``; k_prefix ``(Hkv, P, d)``, v_prefix
            ``(Hkv, P, dv)``: the shared prefix; k_suffixes, v_suffixes: B
            arrays ``(Hkv, S_b, d)`` / ``(Hkv, S_b, dv)``, each sequence's
            own keys after the prefix (S_b may be 0).
        num_splits, scale, io, softcap: as for decoding.forward.
        causal: query i sees key j iff ``j <= i + P + S_b - Nq``; the new
            queries are the cache's last tokens (S_b >= Nq - 1).
        sinks ``(H,)``: one more state ``(0, sink)`` merged at the end.

    Returns:
        ``(o (B, H, Nq, dv), lse (B, H, Nq))``: what decoding each sequence
        against its whole cache (prefix then suffix) returns.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    B, H, nq, d = _check_cascade(q, k_prefix, v_prefix, k_suffixes,
                                 v_suffixes, causal, sinks)
    hkv, dv = k_prefix.shape[0], v_prefix.shape[-1]
    io = check_io(io)
    # the prefix, once: (B, H, Nq, d) -> (Hkv, B * group * Nq, d)
    q_all = q.reshape(B, hkv, -1, d).swapaxes(0, 1).reshape(hkv, -1, d)
    o_p, lse_p = decoding.forward(q_all, k_prefix, v_prefix,
                                  num_splits=num_splits, scale=scale,
                                  softcap=softcap, io=io)
    # back to (B, H, Nq, dv) and (B, H, Nq)
    o_p = o_p.reshape(hkv, B, -1, dv).swapaxes(0, 1).reshape(B, H, nq, dv)
    lse_p = lse_p.reshape(hkv, B, -1).swapaxes(0, 1).reshape(B, H, nq)
    # each suffix, its own sequence's
    o_s = np.zeros_like(o_p)
    lse_s = np.full_like(lse_p, -np.inf)
    for b, (k_b, v_b) in enumerate(zip(k_suffixes, v_suffixes)):
        if k_b.shape[-2] == 0:
            continue                                 # empty: (0, -inf)
        k_b, v_b = (np.repeat(x, H // hkv, axis=0) for x in (k_b, v_b))
        o_s[b], lse_s[b] = decoding.forward(q[b], k_b, v_b, causal=causal,
                                            num_splits=num_splits, io=io,
                                            scale=scale, softcap=softcap)
    o, lse = merge(o_p, lse_p, o_s, lse_s)           # prefix + suffix
    if sinks is not None:                            # + the state (0, sink)
        sink = np.broadcast_to(np.asarray(sinks)[:, None], lse.shape)
        o, lse = merge(o, lse, np.zeros_like(o), sink)
    return o.astype(out_dtype(q, k_prefix, v_prefix)), lse


class CascadeWork(NamedTuple):
    """What :func:`cascade_work` measured: HBM bytes read by plain decoding
    (every sequence reads the prefix) and by :func:`cascade_decode`.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    plain_bytes: int
    cascade_bytes: int


def cascade_work(batch, prefix, suffix, *, heads=1, d=16,
                 bytes_per_element=2):
    """Measure what a shared prefix costs: ``batch`` sequences of one new
    query each, sharing ``prefix`` keys and holding ``suffix`` keys of their
    own, decoded plainly (:func:`flashlib.ladder.decoding.forward` on each
    whole cache) and by :func:`cascade_decode`, each with an
    :class:`~flashlib.ladder.iomodel.IOCounter`. Plain decoding reads the
    prefix ``batch`` times, cascade once: the HBM bytes read, counted.

    Explained in: notebooks/10_serving.
    Tested in: tests/ladder/test_serving.py.
    """
    batch, prefix = _count(batch, "batch"), _count(prefix, "prefix")
    suffix, heads = _count(suffix, "suffix"), _count(heads, "heads")
    if min(batch, prefix, heads, d) < 1:
        raise ValueError(f"batch, prefix, heads and d must be >= 1, got "
                         f"{batch}, {prefix}, {heads}, {d}")
    q = np.ones((batch, heads, 1, d), np.float32)    # (B, H, 1, d)
    k_p = np.ones((heads, prefix, d), np.float32)    # (H, P, d)
    k_s = [np.ones((heads, suffix, d), np.float32)] * batch
    plain = IOCounter(bytes_per_element)
    for b in range(batch):                           # (H, P + S, d)
        k_b = np.concatenate([k_p, k_s[b]], axis=1)
        decoding.forward(q[b], k_b, k_b, num_splits=1, io=plain)
    cascade = IOCounter(bytes_per_element)
    cascade_decode(q, k_p, k_p, k_s, k_s, io=cascade)
    return CascadeWork(plain.hbm_read_bytes, cascade.hbm_read_bytes)


# ---- argument checks (kept out of the functions a chapter shows) -------------

def _count(x, name):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must hold ints, got {type(x).__name__} {x!r}")
    if x < 0:
        raise ValueError(f"{name} must hold ints >= 0, got {x}")
    return int(x)


def _as_list(xs, name):
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        raise TypeError(f"{name} must be a list of ints, "
                        f"got {type(xs).__name__}")
    return [int(x) if isinstance(x, np.integer) else x for x in xs]


def _numpy(x, name, ndim):
    """``x`` a floating NumPy array of rank ``ndim``."""
    if type(x).__module__.startswith("torch"):
        raise TypeError(f"{name} must be a NumPy array (the ladder is NumPy), "
                        f"got a torch tensor; pass {name}.numpy()")
    x = check_floating(x, name)
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {x.shape}")
    return x


def _cu_seqlens(cu, name, total):
    """An integer ``(B + 1,)`` array from 0, non-decreasing, ``<= total``."""
    if type(cu).__module__.startswith("torch"):
        raise TypeError(f"{name} must be a NumPy array, got a torch tensor")
    cu = np.asarray(cu)
    if cu.dtype.kind not in "iu" or cu.ndim != 1 or cu.size == 0:
        raise TypeError(f"{name} must be a 1-D integer array (B + 1,), got "
                        f"dtype {cu.dtype} shape {cu.shape}")
    if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[-1] > total:
        raise ValueError(f"{name} must start at 0, never decrease and end "
                         f"at most at {total}, got {cu.tolist()}")
    return [int(c) for c in cu]


def _max_len(given, lens, name):
    if given is None:
        return max(lens, default=0)
    given = _count(given, name)
    if lens and given < max(lens):
        raise ValueError(f"{name} must be >= every length ({max(lens)}), "
                         f"got {given}")
    return given


def _empty_lse(kw):
    """The lse ``(H, 1)`` of rows that see no key: the sinks, or -inf."""
    return np.reshape(kw.get("sinks", -np.inf), (-1, 1))


def _per_head(x, name, shape):
    """A per-head variant as a NumPy array broadcast to ``shape``."""
    try:
        return np.broadcast_to(check_floating(x, name), shape)
    except ValueError:
        raise ValueError(f"{name} must broadcast to {shape}, got shape "
                         f"{np.shape(x)}") from None


def _sequence_variants(variants, n_seqs, n_heads, seed_step=0):
    """A function of b: the variants of sequence b as the ladder takes them
    (ALiBi's row b, the sinks as (H,), dropout's offset moved by b steps)."""
    variants = dict(variants)
    if variants.get("alibi_slopes") is not None:
        variants["alibi_slopes"] = _per_head(variants["alibi_slopes"],
                                             "alibi_slopes",
                                             (n_seqs, n_heads))
    if variants.get("sinks") is not None:
        variants["sinks"] = _per_head(variants["sinks"], "sinks", (n_heads,))
    for name in ("alibi_slopes", "sinks"):
        if name in variants and variants[name] is None:
            del variants[name]

    def per_seq(b):
        kw = dict(variants)
        if "alibi_slopes" in kw:
            kw["alibi_slopes"] = kw["alibi_slopes"][b]
        if kw.get("dropout_p") and kw.get("dropout_seed") is not None:
            seed, offset = kw["dropout_seed"]
            kw["dropout_seed"] = (seed, offset + b * seed_step)
        return kw
    return per_seq


def _check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, io, variants, **more):
    """The packed arguments checked; returns ``(seqs, per_seq, io)``: seqs
    yields ``(b, rows, keys, q_b (H, nq, d), k_b (H, nk, d), v_b)`` with k
    and v expanded over each GQA group."""
    q, k, v = _numpy(q, "q", 3), _numpy(k, "k", 3), _numpy(v, "v", 3)
    if (k.shape[:2] != v.shape[:2] or k.shape[-1] != q.shape[-1]
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]):
        raise ValueError(f"q must be (total_q, H, d) and k, v (total_k, Hkv, "
                         f"d/dv) with Hkv dividing H, got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    cu_q = _cu_seqlens(cu_q, "cu_seqlens_q", q.shape[0])
    cu_k = _cu_seqlens(cu_k, "cu_seqlens_k", k.shape[0])
    if len(cu_q) != len(cu_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same "
                         f"length B + 1, got {len(cu_q)} and {len(cu_k)}")
    lens_q, lens_k = np.diff(cu_q).tolist(), np.diff(cu_k).tolist()
    max_q = _max_len(max_q, lens_q, "max_seqlen_q")
    max_k = _max_len(max_k, lens_k, "max_seqlen_k")
    shapes = {"o": (*q.shape[:-1], v.shape[-1]), "lse": q.shape[-2::-1],
              "do": (*q.shape[:-1], v.shape[-1])}
    for name, x in more.items():
        x = check_floating(x, name)
        if x.shape != shapes[name]:
            raise ValueError(f"{name} must have shape {shapes[name]}, got "
                             f"{x.shape}")
    B, H, group = len(cu_q) - 1, q.shape[1], q.shape[1] // k.shape[1]
    per_seq = _sequence_variants(variants, B, H, H * max_q * max_k)

    def seqs():
        for b in range(B):
            rows = slice(cu_q[b], cu_q[b + 1])
            keys = slice(cu_k[b], cu_k[b + 1])
            k_b, v_b = (np.repeat(x[keys].swapaxes(0, 1), group, axis=0)
                        for x in (k, v))
            yield b, rows, keys, q[rows].swapaxes(0, 1), k_b, v_b
    return seqs(), per_seq, check_io(io)


def _check_states(o_a, lse_a, o_b, lse_b):
    o_a, o_b = check_floating(o_a, "o_a"), check_floating(o_b, "o_b")
    lse_a = check_floating(lse_a, "lse_a")
    lse_b = check_floating(lse_b, "lse_b")
    if o_a.ndim < 1 or o_b.shape != o_a.shape:
        raise ValueError(f"o_a and o_b must have one shape (..., dv), got "
                         f"{o_a.shape} and {o_b.shape}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != o_a.shape[:-1]:
            raise ValueError(f"{name} must have shape {o_a.shape[:-1]} (o's "
                             f"without dv), got {x.shape}")
    return o_a, lse_a, o_b, lse_b


def _table(block_table, n_seqs):
    if type(block_table).__module__.startswith("torch"):
        raise TypeError("block_table must be a NumPy array, got a torch "
                        "tensor")
    table = np.asarray(block_table)
    if table.dtype.kind not in "iu" or table.ndim != 2 \
            or table.shape[0] != n_seqs:
        raise TypeError(f"block_table must be an integer array (B, "
                        f"max_pages) with B = {n_seqs}, got dtype "
                        f"{table.dtype} shape {table.shape}")
    return table


def _lengths(cache_seqlens, n_seqs, name="cache_seqlens"):
    if type(cache_seqlens).__module__.startswith("torch"):
        raise TypeError(f"{name} must be a NumPy array, got a torch tensor")
    lens = np.asarray(cache_seqlens)
    if lens.dtype.kind not in "iu" or lens.shape != (n_seqs,):
        raise TypeError(f"{name} must be an integer array ({n_seqs},), got "
                        f"dtype {lens.dtype} shape {lens.shape}")
    return lens.astype(np.int64)


def _check_append(k_cache, v_cache, k, v, cache_seqlens, block_table):
    """``(lengths (B,), Nnew)``; a ValueError for a write past capacity."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k),
                    ("v", v)):
        _numpy(x, name, 4)
    same = (k.shape[:-1] == v.shape[:-1]
            and k_cache.shape[:-1] == v_cache.shape[:-1])
    if not same:
        raise ValueError(f"k and v (and k_cache and v_cache) must differ in "
                         f"their last dim only, got k {k.shape}, v {v.shape}"
                         f", k_cache {k_cache.shape}, v_cache "
                         f"{v_cache.shape}")
    if block_table is None:
        B, _, n_new, _ = k.shape                     # (B, Hkv, Nnew, d)
        capacity = k_cache.shape[2]
    else:
        B, n_new = k.shape[:2]                       # (B, Nnew, Hkv, d)
        capacity = _table(block_table, B).shape[1] * k_cache.shape[1]
        table = np.asarray(block_table)
    lens = _lengths(cache_seqlens, B)
    if (lens < 0).any() or (lens + n_new > capacity).any():
        raise ValueError(f"cache_seqlens + Nnew must stay within the cache's "
                         f"capacity {capacity} (and cache_seqlens >= 0), "
                         f"got cache_seqlens {lens.tolist()} and Nnew "
                         f"{n_new}")
    if block_table is not None and n_new:
        t = np.concatenate([np.arange(s, s + n_new) for s in lens])
        pages = table[np.repeat(np.arange(B), n_new), t // k_cache.shape[1]]
        if ((pages < 0) | (pages >= k_cache.shape[0])).any():
            raise ValueError(f"block_table must point into the cache's "
                             f"{k_cache.shape[0]} pages where it is written")
    return lens, n_new


def _check_paged(q, k_cache, v_cache, block_table, cache_seqlens, variants):
    """``(lengths, group, per_seq)``: lengths clamped into [0, capacity]."""
    q = _numpy(q, "q", 4)
    k_cache = _numpy(k_cache, "k_cache", 4)
    v_cache = _numpy(v_cache, "v_cache", 4)
    if (k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[1] == 0
            or k_cache.shape[-1] != q.shape[-1] or k_cache.shape[2] == 0
            or q.shape[1] % k_cache.shape[2]):
        raise ValueError(f"k_cache, v_cache must be (num_pages, page_size, "
                         f"Hkv, d/dv) with page_size >= 1 and Hkv dividing "
                         f"q's H, got q {q.shape}, k_cache {k_cache.shape}, "
                         f"v_cache {v_cache.shape}")
    table = _table(block_table, q.shape[0])
    capacity = table.shape[1] * k_cache.shape[1]
    lens = (np.full(q.shape[0], capacity) if cache_seqlens is None
            else np.clip(_lengths(cache_seqlens, q.shape[0]), 0, capacity))
    per_seq = _sequence_variants(variants, q.shape[0], q.shape[1])
    return lens.tolist(), q.shape[1] // k_cache.shape[2], per_seq


def _check_cascade(q, k_prefix, v_prefix, k_suffixes, v_suffixes, causal,
                   sinks):
    q = _numpy(q, "q", 4)
    k_prefix = _numpy(k_prefix, "k_prefix", 3)
    v_prefix = _numpy(v_prefix, "v_prefix", 3)
    B, H, nq, d = q.shape
    hkv = k_prefix.shape[0]
    if (k_prefix.shape[:2] != v_prefix.shape[:2] or hkv == 0 or H % hkv
            or k_prefix.shape[-1] != d or k_prefix.shape[1] == 0):
        raise ValueError(f"k_prefix, v_prefix must be (Hkv, P, d/dv) with "
                         f"P >= 1 and Hkv dividing H, got q {q.shape}, "
                         f"k_prefix {k_prefix.shape}, v_prefix "
                         f"{v_prefix.shape}")
    if len(k_suffixes) != B or len(v_suffixes) != B:
        raise ValueError(f"k_suffixes and v_suffixes must hold B = {B} "
                         f"arrays, got {len(k_suffixes)} and "
                         f"{len(v_suffixes)}")
    for b, (k_b, v_b) in enumerate(zip(k_suffixes, v_suffixes)):
        k_b = _numpy(k_b, f"k_suffixes[{b}]", 3)
        v_b = _numpy(v_b, f"v_suffixes[{b}]", 3)
        if (k_b.shape[0] != hkv or k_b.shape[-1] != d or v_b.shape[0] != hkv
                or v_b.shape[1] != k_b.shape[1]
                or v_b.shape[-1] != v_prefix.shape[-1]):
            raise ValueError(f"k_suffixes[{b}], v_suffixes[{b}] must be "
                             f"(Hkv, S_b, d/dv) like the prefix, got "
                             f"{k_b.shape} and {v_b.shape}")
        if causal and k_b.shape[1] < nq - 1:
            raise ValueError(f"causal cascade needs every suffix to hold "
                             f"at least Nq - 1 = {nq - 1} keys, got "
                             f"k_suffixes[{b}] with {k_b.shape[1]}")
    if sinks is not None:
        _per_head(sinks, "sinks", (H,))
    return B, H, nq, d
