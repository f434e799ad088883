"""Flash-Decoding (Dao, Haziza, Massa, Sizov 2023): split K/V, attend to each
split, combine by LSE.

With one query per sequence (decoding), FlashAttention-2's parallelism over
query blocks gives a GPU only batch x heads work items. Flash-Decoding adds
parallelism over the keys: split K/V into ``num_splits`` chunks, attend to each
independently — writing a partial output O_s and its log-sum-exp LSE_s — then
merge them in a second kernel by LSE rescaling (the same merge as the online
softmax). Any number of queries works; decoding is the case Nq = 1 with a long
K/V. :func:`combine` is :func:`flashlib.ladder.serving.merge_many`, the merge
of attention states folded over the splits (notebooks/10_serving).

Explained in: notebooks/06_flash_decoding.
"""
from __future__ import annotations

import numpy as np

from ._checks import (acc_dtype, check_attention, check_blocks, check_count,
                       check_floating, check_io, check_num_splits,
                       check_variants, out_dtype)
from .fa2 import _masked_scores
from .masks import key_range, masked_matmul
from .softmax import divide_rows, lse_from_state, safe_exp_diff

__all__ = ["forward", "combine", "split_bounds", "choose_num_splits",
           "band_keys"]


def split_bounds(nk: int, num_splits: int) -> list[tuple[int, int]]:
    """Key ranges ``[(start, stop), ...]`` of ``num_splits`` near-equal
    contiguous chunks of ``nk`` keys.

    ``nk``: an int >= 0; ``num_splits``: an int >= 1. Exactly ``num_splits``
    chunks: some are empty when ``num_splits > nk`` (an empty split contributes
    ``(0, -inf)``); :func:`forward` asks for at most ``nk``.

    Explained in: notebooks/06_flash_decoding.
    Tested in: tests/ladder/test_decoding.py.
    """
    nk, num_splits = check_count(nk, "nk"), check_num_splits(num_splits)
    edges = [(s * nk) // num_splits for s in range(num_splits + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _attend_split(q, k_s, v_s, k0, nk, scale, var, acc):
    """One split, one pass: ``(O_s, LSE_s)`` of q against keys
    ``[k0, k0 + len(k_s))``, O_s normalized; the scores as FA2's (variants
    and band included)."""
    nq = q.shape[-2]
    # (..., Nq, chunk); seen None: every key is seen
    s, seen, _ = _masked_scores(q, k_s, scale, 0, k0, nq, nk, var)
    if s.shape[-1]:
        m = s.max(axis=-1, keepdims=True)
    else:                                            # an empty split
        m = np.full((*s.shape[:-1], 1), -np.inf, acc)
    p = safe_exp_diff(s, m)                          # (..., Nq, chunk)
    l = p.sum(axis=-1, keepdims=True)
    o = divide_rows(masked_matmul(p, v_s, seen), l)
    return o, lse_from_state(m, l)[..., 0]


def band_keys(nq: int, nk: int, causal: bool = False,
              window=(-1, -1)) -> tuple[int, int]:
    """``(lo, hi)``: the keys [lo, hi) that some query of ``nq`` sees (the
    first query's first key to the last query's last); ``lo == hi`` when no
    query sees any key. Flash-Decoding splits only these.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_decoding.py.
    """
    nq, nk = check_count(nq, "nq"), check_count(nk, "nk")
    if nq == 0 or nk == 0:
        return 0, 0
    first, _ = key_range(0, nq, nk, causal, window)
    _, last = key_range(nq - 1, nq, nk, causal, window)
    lo, hi = int(first), int(last) + 1
    return (lo, hi) if lo < hi else (0, 0)


def forward(q, k, v, *, num_splits, causal=False, scale=None, io=None,
            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None):
    """Flash-Decoding forward: ``num_splits`` independent partial attentions,
    then :func:`combine`.

    Args:
        q ``(..., Nq, d)`` (decoding: Nq = 1), k ``(..., Nk, d)``,
            v ``(..., Nk, dv)``: one sequence, its whole cache.
        num_splits: number of contiguous K/V chunks, an int >= 1; each is one
            work item on a GPU. The splits cover only the band, the keys some
            query sees (:func:`band_keys`); more splits than band keys act as
            that many: a split beyond would be empty and add nothing, so none
            is allocated (the torch API's ``flashlib.decode`` clamps alike).
        causal: bottom-right aligned (the new query sees the whole cache).
            scale: ``d ** -0.5``.
        io: an :class:`~flashlib.ladder.iomodel.IOCounter`; partial results
            are counted as written and read.
        window_size, softcap, alibi_slopes, sinks: as for
            :func:`flashlib.ladder.fa2.forward` (offset ``Nk - Nq``); a sink
            is one more part for :func:`combine`, with an empty value.

    Returns:
        ``(o, lse)`` as :func:`flashlib.ladder.fa2.forward`, NaN rule included.

    Explained in: notebooks/06_flash_decoding and notebooks/09_real_models.

    Tested in: tests/ladder/test_decoding.py.
    """
    q, k, v, causal, scale, io = check_attention(q, k, v, causal, scale, io)
    acc, nq, nk = acc_dtype(q, k, v), q.shape[-2], k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    var = check_variants(q, causal, window_size, softcap, alibi_slopes, sinks,
                         dtype=acc)
    lo, hi = band_keys(nq, nk, *var.band)           # the keys someone sees
    # an empty split adds nothing
    num_splits = min(check_num_splits(num_splits), max(hi - lo, 1))
    # the partial results, in HBM (one more part for a sink)
    parts = num_splits + (var.sinks is not None)
    o_parts = np.zeros((parts, *q.shape[:-1], dv), dtype=acc)
    lse_parts = np.empty((parts, *q.shape[:-1]), dtype=acc)
    # kernel 1: one program per split
    for s, (k0, k1) in enumerate(split_bounds(hi - lo, num_splits)):
        k0, k1 = lo + k0, lo + k1
        q_s = io.load(q).astype(acc)                 # each split reads Q
        k_s = io.load(k[..., k0:k1, :]).astype(acc)  # and only its own K/V
        v_s = io.load(v[..., k0:k1, :]).astype(acc)
        io.sram(q_s, k_s, v_s)
        o_s, lse_s = _attend_split(q_s, k_s, v_s, k0, nk, scale, var, acc)
        io.flops(matmul=2 * (q_s.size // d) * (k1 - k0) * (d + dv))
        io.store(o_parts, s, o_s)                    # write (O_s, LSE_s)
        io.store(lse_parts, s, lse_s)
    if var.sinks is not None:      # a sink: the part (O, LSE) = (0, sink)
        lse_parts[-1] = var.sinks[..., 0]
    # kernel 2: reduce over the splits
    o, lse = combine(o_parts, lse_parts, io=io)
    return o.astype(out_dtype(q, k, v)), lse


def combine(o_parts, lse_parts, *, io=None):
    """Merge partial results: ``lse = log sum_s exp(LSE_s)``,
    ``o = sum_s exp(LSE_s - lse) O_s``.

    Args:
        o_parts ``(S, ..., Nq, dv)``: each split's *normalized* output;
        lse_parts ``(S, ..., Nq)``.

    Returns:
        ``(o, lse)``; where every split has ``LSE_s = -inf``, ``o = 0`` and
        ``lse = -inf``.

    Explained in: notebooks/06_flash_decoding (and reused by ring attention).

    Tested in: tests/ladder/test_decoding.py.
    """
    o_parts, lse_parts, io = _check_parts(o_parts, lse_parts, io)
    lse_parts, o_parts = io.load(lse_parts), io.load(o_parts)
    m = lse_parts.max(axis=0)                        # (..., Nq)
    # weights exp(LSE_s - m)  (S, ..., Nq)
    w = safe_exp_diff(lse_parts, m)
    l = w.sum(axis=0)
    lse = lse_from_state(m, l)
    w = divide_rows(w, l)                            # exp(LSE_s - lse)
    o = (w[..., None] * o_parts).sum(axis=0)
    io.flops(other=3 * lse_parts.size + 2 * o_parts.size)
    out_o, out_lse = np.empty_like(o), np.empty_like(lse)
    io.store(out_o, ..., o), io.store(out_lse, ..., lse)
    return out_o, out_lse


def choose_num_splits(batch_heads: int, n_query_blocks: int, nk: int,
                      num_sms: int, *, block_k: int = 256,
                      max_splits: int = 128) -> int:
    """Split count heuristic: enough work items to fill the GPU about once,
    each split >= one key block.

    ``batch_heads * n_query_blocks`` work items exist without splitting. If
    they already fill ``num_sms`` SMs, one split; otherwise
    ``ceil(num_sms / items)`` splits, capped so that every split keeps at least
    ``block_k`` keys and at most ``max_splits`` splits exist.

    Explained in: notebooks/06_flash_decoding.

    Tested in: tests/ladder/test_decoding.py.
    """
    batch_heads, n_query_blocks, nk, num_sms, block_k, max_splits = (
        check_blocks(batch_heads=batch_heads, n_query_blocks=n_query_blocks,
                     nk=nk, num_sms=num_sms, block_k=block_k,
                     max_splits=max_splits))
    items = batch_heads * n_query_blocks
    if items >= num_sms:
        return 1
    wanted = -(-num_sms // items)
    return max(1, min(wanted, -(-nk // block_k), max_splits))


def _check_parts(o_parts, lse_parts, io):
    """combine's arguments: floating ``o_parts (S, ..., Nq, dv)`` and
    ``lse_parts (S, ..., Nq)``."""
    o_parts = check_floating(o_parts, "o_parts")
    lse_parts = check_floating(lse_parts, "lse_parts")
    if (o_parts.ndim < 2 or o_parts.shape[:-1] != lse_parts.shape
            or o_parts.shape[0] == 0):
        raise ValueError(
            f"o_parts must be (S, ..., Nq, dv) and lse_parts (S, ..., Nq) "
            f"with S >= 1, got o_parts {o_parts.shape} and "
            f"lse_parts {lse_parts.shape}")
    return o_parts, lse_parts, check_io(io)
