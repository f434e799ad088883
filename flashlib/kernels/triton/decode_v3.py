# decode_v3.py — Flash-Decoding in Triton, version 3 of the Triton kernels.
# Changed from the forward (fa2_fwd_v1.py): for decoding, Nq is tiny and the forward's grid (query
#   blocks x batch·heads) leaves most SMs idle. Here the grid adds a split: program (b·hk, r, s)
#   attends the query rows r to the s-th contiguous chunk of sequence b's *valid* cache
#   (cache_seqlens[b] keys, ragged across the batch) and writes a normalized partial output O_s and
#   its log-sum-exp LSE_s; a second kernel merges the splits by LSE (the online-softmax merge).
#   Both grids are flat (flashlib.kernels.triton.flat_grid): the split kernel decodes (b·hk, r, s)
#   from tl.program_id(0), s fastest, so the programs of one kv head are neighbours; the combine
#   kernel has one program per query row. Neither is bound by CUDA's 65,535 on a second grid axis.
#   With one split there is nothing to merge: the split kernel writes o and lse themselves and the
#   combine is not launched. Without cache_seqlens (None) Triton compiles the kernel with SEQLENS a
#   constexpr None, and every sequence uses all Nmax keys: no lengths tensor to allocate and fill.
#   GQA: the query rows of a program are all (query head of the group, query position) pairs that
#   read kv head hk, stacked — each K/V tile is loaded once for the whole group, and never copied.
#   Without a window every query sees every valid key (the new tokens are in the cache); a
#   sequence with cache_seqlens[b] = 0 sees nothing: o = 0, lse = -inf, like a fully masked row.
#   The split kernel is the forward's inner loop (kit.attend, every block in its MASKED stage: a
#   split ends anywhere) and its end (kit.finish); both kernels decode their flat grid with
#   kit.unflatten, and each has its KernelSpec (flashlib.kernels.triton.spec), read from its
#   signature, beside it.
#   NaN (kit's rule): keys at or past a split's end (past cache_seqlens included) are loaded as 0,
#   never as what the cache holds there, so a NaN past a sequence's length changes nothing; a NaN
#   the split sees gives it O_s and LSE_s NaN (kit.finish), and the combine keeps it ("every split
#   empty" is l == 0 there too).
#   The variants of real models (issue 24), constexpr flags that default to off (the dense kernels
#   compile as before): query i of sequence b sits at position i + len_b - Nq (the window and
#   ALiBi use that offset). WINDOW — only the band of each sequence (kit.band_keys of its query
#   positions) is read, and the splits divide the band, not Nmax; SOFTCAP and ALIBI — kit.score_mods
#   with one slope per stacked row (its query head's: a program's rows span a GQA group); SINK — in
#   the combine (the merged row's lse), or in the split kernel when there is one split. Decode's
#   causal (several new tokens, causal among themselves) is the window (left, 0): flashlib.decode
#   turns causal=True into it, so the kernels see only WINDOW.
#   Serving (issue 25; notebooks/10_serving):
#   * PAGED, a constexpr that defaults to off (the dense kernel compiles as before): K, V are
#     (num_pages, page_size, Hkv, d), viewed without a copy as (num_pages, Hkv, page_size, d) so
#     the spec's "batch" stride is the page's, and logical key t of sequence b is row
#     t % page_size of page block_table[b, t // page_size]. kit.load_kv gathers each key row
#     through its own pointer (kit.page_slots), so a key block may span pages and ANY page size
#     >= 1 works. FA2 asks for pages of a multiple of 256 because it computes one base address
#     per key block of kBlockN rows (and copies the block as one tile): a block must never cross
#     a page, so the page size must be a multiple of every block size it may pick. A per-row
#     gather has no such unit: the cost is one table entry per key row (a few bytes beside the
#     row's d values, cached) and an integer division. Pages past the valid length are never
#     read (table loads are masked at the split's end); a page index is clamped into
#     [0, num_pages - 1] and the length into [0, capacity = max_pages·page_size] in the kernel:
#     no host read-back, CUDA-graph safe, as cache_seqlens. The splits divide the logical range
#     (or the window's band), exactly as for a dense cache: same data, same splits, same bits.
#   * append_kv: a small kernel (one program per batch·kv head and block of new tokens) that
#     writes new K, V rows in place at positions cache_seqlens[b] + i, dense or paged, with a
#     masked store: a position at or past the capacity is not written, and nothing is read back
#     by the host. flashlib.decode calls it before attending when given k, v.
# Idea: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding); the ladder is flashlib.ladder.decoding.
#   Paged caches: vLLM's PagedAttention (Kwon et al. 2023); any page size by gathering rows, as
#   FlashInfer (Ye et al. 2025) does. Our own code, through kit's helpers.
# Limits: head dim <= 256; fp16, bf16, fp32; bf16 needs sm_80+; not differentiable (inference). Any
#   B·H; 64-bit offsets (kit's "Offsets"): the caches, q and the partials (num_splits·B·H·Nq·d) may
#   hold 2^31 elements or more; one kv head's query rows (group·Nq) < 2^31. Paged: the block table
#   int32 with a contiguous last dim (copied on the device where it is not); no TMA or block loads
#   of K, V (a gather), so on sm_90 the paged kernel reads as the dense one does (cp.async).
#   Appending into a page that two sequences share is the caller's race.
# Run: flashlib.decode(q, k_cache, v_cache, cache_seqlens=lens, backend="triton") (kernel="v3", the
#   only version); paged, with append: flashlib.decode(q, k_cache, v_cache, k=k_new, v=v_new,
#   cache_seqlens=lens, block_table=table, backend="triton").
"""Flash-Decoding split-KV and combine kernels and their launcher, over dense or paged caches, and
the in-place append.  Explained in: notebooks/07b_backward_decoding."""
from __future__ import annotations

import torch

from . import flat_grid, kit, triton, tl
from .configs import Config, Tables
from .fa2_fwd_v1 import smem_estimate
from .spec import KernelSpec

__all__ = ["decode", "append_kv", "grid_split", "grid_combine", "split_block_m", "SPLIT_SPEC",
           "COMBINE_SPEC", "APPEND_SPEC", "SPLIT_CONFIGS"]


@triton.jit
def _split_kernel(Q, K, V, SEQLENS, OP, LP, SLOPES, SINKS, TABLE,
                  stride_qb, stride_qh, stride_qn,
                  stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  qk_scale, B, H, HKV, GROUP, NQ, NMAX, D, win_l, win_r,
                  softcap2, page_size, num_pages, table_row,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr, WINDOW: tl.constexpr = False,
                  SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                  SINK: tl.constexpr = False, PAGED: tl.constexpr = False):
    # blocks of stacked query rows per kv head
    n_r = tl.cdiv(GROUP * NQ, BLOCK_M)
    # the flat grid is B·HKV x n_r x n_splits
    n_splits = tl.num_programs(0) // (B * HKV * n_r)
    # kernel 1: one program per split, block of stacked query rows, batch b
    # and kv head hk
    split, rest = kit.unflatten(tl.program_id(0), n_splits)
    pid_r, pid_bhk = kit.unflatten(rest, n_r)
    hk, b = kit.unflatten(pid_bhk, HKV)
    b, hk = b.to(tl.int64), hk.to(tl.int64)  # offsets in 64 bits (kit: Offsets)
    # Stacked rows stay 32-bit, as in every grid decode: GROUP·NQ, one kv
    # head's query rows in a decode step (B·HKV·GROUP·NQ·d = q's elements),
    # must be < 2^31.
    # stacked rows r = g * NQ + iq
    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,)
    row_ok = offs_r < GROUP * NQ
    iq, g = kit.unflatten(offs_r, NQ)   # (BLOCK_M,) query position, member
    h = hk * GROUP + g                  # (BLOCK_M,) query head of each row
    offs_d = tl.arange(0, BLOCK_D)      # (BLOCK_D,) head dim, padded to 2^k
    q_rows = Q + b * stride_qb + h * stride_qh + iq.to(tl.int64) * stride_qn
    # the stacked Q rows (BLOCK_M, BLOCK_D)
    q = kit.load_tile(row_ptrs=q_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    if SEQLENS is None:     # no lengths (a constexpr None): the whole cache
        nk = NMAX
    else:
        # this sequence's valid keys, clamped into [0, NMAX] (paged: NMAX is
        # the capacity): the host does not read them back (no sync)
        nk = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), NMAX)
    if WINDOW:
        # Only the band: the keys the sequence's query positions 0..NQ-1
        # see together (offset nk - NQ), split in whole blocks from the
        # block holding its first key.
        band_lo, band_hi = kit.band_keys(first_row=0, last_row=NQ - 1, NK=nk,
                                         offset=nk - NQ, WIN_L=win_l,
                                         WIN_R=win_r)
        base = (band_lo // BLOCK_N) * BLOCK_N
        chunk = tl.cdiv(tl.cdiv(band_hi - base, n_splits), BLOCK_N) * BLOCK_N
        start = base + split * chunk
        end = tl.minimum(start + chunk, band_hi)
    else:
        # keys per split, whole blocks
        chunk = tl.cdiv(tl.cdiv(nk, n_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, nk)
    # m_i, l_i (BLOCK_M,) and the output rows (BLOCK_M, BLOCK_D), fp32
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The online softmax over this split's keys [start, end), every block
    # masked at `end`, no causal mask.
    if PAGED:
        # K, V viewed (num_pages, HKV, page_size, d): the "batch" stride is
        # the page's; each key row finds its page in sequence b's row of the
        # block table (kit.load_kv's gather)
        k_base = K + hk * stride_kh
        v_base = V + hk * stride_vh
        table = TABLE + b * table_row
    else:
        k_base = K + b * stride_kb + hk * stride_kh
        v_base = V + b * stride_vb + hk * stride_vh
        table = TABLE
    if (WINDOW or SOFTCAP) or ALIBI:
        # The variants: rows at query positions iq, offset nk - NQ (the
        # sequence's own); ALiBi per ROW, each its query head's slope.
        if ALIBI:
            slopes2 = tl.load(SLOPES + b * H + h, mask=row_ok,
                              other=0.0) * kit.LOG2E
        else:
            slopes2 = 0.0
        acc, l_i, m_i = kit.attend(
            acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
            stride_kn=stride_kn, stride_vn=stride_vn, offs_m=iq,
            offs_d=offs_d, lo=start, hi=end, NK=end, offset=nk - NQ, D=D,
            qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.MASKED,
            CAUSAL=False, UPCAST=UPCAST, PRECISION=PRECISION, win_l=win_l,
            win_r=win_r, softcap2=softcap2, slopes2=slopes2, WINDOW=WINDOW,
            SOFTCAP=SOFTCAP, ALIBI=ALIBI, table=table, page_size=page_size,
            num_pages=num_pages, stride_kp=stride_kb, stride_vp=stride_vb,
            PAGED=PAGED)
    else:
        acc, l_i, m_i = kit.attend(
            acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
            stride_kn=stride_kn, stride_vn=stride_vn, offs_m=offs_r,
            offs_d=offs_d, lo=start, hi=end, NK=end, offset=0, D=D,
            qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.MASKED,
            CAUSAL=False, UPCAST=UPCAST, PRECISION=PRECISION, table=table,
            page_size=page_size, num_pages=num_pages, stride_kp=stride_kb,
            stride_vp=stride_vb, PAGED=PAGED)
    # O_s normalized, LSE_s (0 and -inf: an empty split)
    o, lse = kit.finish(acc, l_i, m_i)
    if SINK:          # one split: its output is the answer, the sink joins
        o, lse = kit.add_sink(o, lse, tl.load(SINKS + h, mask=row_ok,
                                              other=0.0))
    rows = (b * H + h) * NQ + iq      # flat row index into (B, H, NQ), 64-bit
    # tl.cast: B is a plain int where the JIT made it 1
    n_rows = tl.cast(B, tl.int64) * H * NQ
    # OP (num_splits, B·H·NQ, D): fp32 partials, or o itself (one split), so
    # cast to OP's type
    op_ptrs = OP + (split * n_rows + rows[:, None]) * D + offs_d[None, :]
    tl.store(op_ptrs, o.to(OP.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < D))
    tl.store(LP + split * n_rows + rows, lse, mask=row_ok)


@triton.jit
def _combine_kernel(OP, LP, O, LSE, SINKS, stride_ob, stride_oh, stride_on,
                    n_rows, H, NQ, N_SPLITS, D,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                    SINK: tl.constexpr = False):
    row = tl.program_id(0)    # kernel 2: one program per query row (flat)
    offs_s = tl.arange(0, BLOCK_S)    # (BLOCK_S,) splits, padded to 2^k
    offs_d = tl.arange(0, BLOCK_D)    # (BLOCK_D,) head dim, padded to 2^k
    s_ok = offs_s < N_SPLITS
    # splits x n_rows x D can pass 2^31: 64 bits
    splits = offs_s.to(tl.int64)
    # (BLOCK_S,)
    lse_s = tl.load(LP + splits * n_rows + row, mask=s_ok,
                    other=float("-inf"))
    m = tl.max(lse_s, 0)
    # every split empty: weights 0, no NaN
    m_use = tl.where(m == float("-inf"), 0.0, m)
    # (BLOCK_S,) exp(LSE_s - m)
    w = tl.math.exp2((lse_s - m_use) * kit.LOG2E)
    l = tl.sum(w, 0)            # NaN if a split is NaN (w NaN): kept
    # no split saw a key (not l > 0: NaN is not empty)
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    # (BLOCK_S, BLOCK_D)
    o_s = tl.load(OP + (splits[:, None] * n_rows + row) * D + offs_d[None, :],
                  mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    # (BLOCK_D,) sum_s exp(LSE_s - lse) O_s
    o = tl.sum(w[:, None] * o_s, 0) / l_safe
    lse = tl.where(empty, float("-inf"),
                   m_use + tl.math.log2(l_safe) * kit.LN2)
    iq, bh = kit.unflatten(row, NQ)             # row = (b·H + h)·NQ + iq
    h, b = kit.unflatten(bh, H)
    # offsets in 64 bits (kit: Offsets)
    b, h, iq = b.to(tl.int64), h.to(tl.int64), iq.to(tl.int64)
    if SINK:          # the sink joins the merged row: a merge with an
        sink = tl.load(SINKS + h)     # empty-value state (kit.add_sink)
        new = kit.logaddexp(lse, sink)
        o = o * tl.where(lse == float("-inf"), 0.0,
                         tl.math.exp2((lse - new) * kit.LOG2E))
        lse = new
    o_ptrs = O + b * stride_ob + h * stride_oh + iq * stride_on + offs_d
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=offs_d < D)
    tl.store(LSE + row, lse)


def split_block_m(cfg_block_m: int, group: int, NQ: int) -> int:
    """Stacked query rows per split-kernel program: the config's block_m is a cap, 16 the floor.

    Explained in: notebooks/07b_backward_decoding.

    Tested in: tests/kernels/triton/test_triton_spec.py.
    """
    return max(16, min(cfg_block_m, kit.next_pow2(group * NQ)))


def grid_split(B: int, HKV: int, group: int, NQ: int, block_m: int, num_splits: int) -> tuple[int]:
    """The split kernel's grid: one program per (batch·kv head, row block, split), flat, split fastest.

    Explained in: notebooks/07b_backward_decoding.

    Tested in: tests/kernels/triton/test_triton_spec.py.
    """
    return flat_grid(B * HKV, kit.ceil_div(group * NQ, block_m), num_splits)


def grid_combine(B: int, H: int, NQ: int) -> tuple[int]:
    """The combine kernel's grid: one program per query row of (B, H, Nq).

    Explained in: notebooks/07b_backward_decoding.

    Tested in: tests/kernels/triton/test_triton_spec.py.
    """
    return flat_grid(B * H * NQ)


# The spec describes the general case (the compile report compiles it): lengths given, fp32 partials.
# decode() may also pass SEQLENS=None (a constexpr: no lengths) and, with one split, OP = o itself; a dense
# cache passes TABLE=None (PAGED off). The paged kernel is PAGED=True with the same signature.
# A program stacks a kv head's GROUP x NQ query rows: its config's block_m is only a cap (split_block_m).
# The candidates per architecture (configs.Tables; how they were chosen: configs' header). block_m caps
# the stacked query rows (GQA group x Nq) a program takes; block_n is the key step.
SPLIT_CONFIGS = Tables(
    sm80=(Config(64, 64, 4, 2), Config(32, 32, 4, 1)),
    sm75=(Config(16, 32, 4, 1),),
    fp32=(Config(16, 32, 8, 2), Config(16, 16, 4, 1)),
    sm75_fp32=(Config(16, 32, 4, 1), Config(16, 16, 4, 1)),
    interpreter=Config(64, 16))
SPLIT_SPEC = KernelSpec(
    "decode_split", _split_kernel, types=dict(SEQLENS="i32", OP="fp32", LP="fp32", SLOPES="fp32", SINKS="fp32",
                                              TABLE="i32", qk_scale="fp32", softcap2="fp32"),
    grid=lambda a: grid_split(a["B"], a["HKV"], a["GROUP"], a["NQ"], a["BLOCK_M"], a["OP"].shape[0]),
    config="decode", tables=SPLIT_CONFIGS, smem=smem_estimate,     # Q resident, K and V streamed: the forward's tiles
    blocks=lambda cfg, a: dict(BLOCK_M=split_block_m(cfg.block_m, a["GROUP"], a["NQ"]),
                               BLOCK_N=cfg.block_n))
COMBINE_SPEC = KernelSpec(
    "decode_combine", _combine_kernel, types=dict(OP="fp32", LP="fp32", LSE="fp32", SINKS="fp32"),
    grid=lambda a: grid_combine(a["O"].shape[0], a["H"], a["NQ"]),
    fixed=Config(0, 0, num_warps=4, num_stages=1), uses_dot=False)


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits: int, scale: float,
           config: Config | None = None, block_table=None, window_size=(-1, -1), softcap: float = 0.0,
           alibi_slopes=None, sinks=None):
    """Launch split-KV then combine: ``(o, lse)`` for ``q (B, H, Nq, d)``, caches ``(B, Hkv, Nmax, d)``.

    ``cache_seqlens`` is None (every sequence uses all Nmax keys) or an int32 tensor ``(B,)`` of valid
    cache lengths (checked by :func:`flashlib.decode` on a CPU; on a GPU never read back by the host —
    the kernel clamps each into ``[0, Nmax]`` — so a decode step neither waits for the GPU nor breaks
    CUDA-graph capture). Partial results live in an fp32 buffer ``(num_splits, B·H·Nq, d)``; with one
    split the split kernel writes ``o`` and ``lse`` directly and the combine is not launched.

    ``block_table`` int32 ``(B, max_pages)``: the caches are paged, ``(num_pages, page_size, Hkv, d)``
    (any page size >= 1, any strides with a contiguous last dim), and key t of sequence b is row
    ``t % page_size`` of page ``block_table[b, t // page_size]``, gathered row by row. Nmax is then
    the capacity ``max_pages · page_size`` (cache_seqlens None: every sequence has it); only the pages
    under a sequence's length are read, and page indices are clamped into ``[0, num_pages - 1]``
    in the kernel. Same data, same splits: the same bits as the dense cache.

    The variants (validated by flashlib.decode; sequence b's query i sits at position ``i + len_b -
    Nq``): ``window_size`` — only the band of each sequence is read and split (the splits divide
    the band, not Nmax; decode's causal arrives as the window ``(left, 0)``); ``softcap``;
    ``alibi_slopes`` float32 ``(B, H)`` — per stacked row, each its own query head's slope;
    ``sinks`` float32 ``(H,)`` — in the combine (lse includes it), or in the split kernel when
    there is one split.

    Explained in: notebooks/06_flash_decoding.
    Tested in: tests/kernels/triton/test_triton_decode_v3.py,
    tests/kernels/triton/test_triton_variants_decode.py and
    tests/kernels/triton/test_triton_paged_decode.py.
    """
    B, H, NQ, D = q.shape
    paged = {}                     # left out: PAGED off, the dense kernel
    if block_table is None:
        HKV, nmax = k_cache.shape[1], k_cache.shape[2]
        table, page_size, num_pages, table_row = None, 1, 1, 0
    else:
        num_pages, page_size, HKV = k_cache.shape[:3]
        nmax = block_table.shape[1] * page_size        # the capacity
        table = _table(block_table)
        table_row = table.stride(0)
        # viewed (num_pages, Hkv, page_size, d): strides (page, head, slot), no copy
        k_cache, v_cache = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
        paged["PAGED"] = True
    group = H // HKV
    block_d = kit.block_d(D)
    n_rows = B * H * NQ
    # one split: the split kernel's output is the answer (o in q's dtype, contiguous like the partials)
    o_part = torch.empty((num_splits, n_rows, D), device=q.device,
                         dtype=q.dtype if num_splits == 1 else torch.float32)
    lse_part = torch.empty((num_splits, n_rows), device=q.device, dtype=torch.float32)
    window = tuple(window_size) != (-1, -1)
    win_l, win_r = kit.band(window_size, False, NQ, nmax) if window else (0, 0)
    variants = {}                  # flags left out: their defaults (off), the dense kernel
    if window:
        variants["WINDOW"] = True
    if softcap:
        variants["SOFTCAP"] = True
    if alibi_slopes is not None:
        variants["ALIBI"] = True
    if sinks is not None and num_splits == 1:
        variants["SINK"] = True
    SPLIT_SPEC.launch(config, Q=q, K=k_cache, V=v_cache, SEQLENS=cache_seqlens, OP=o_part, LP=lse_part,
                      SLOPES=lse_part if alibi_slopes is None else alibi_slopes,
                      SINKS=lse_part if sinks is None else sinks, TABLE=table, qk_scale=kit.qk_scale(scale),
                      B=B, H=H, HKV=HKV, GROUP=group, NQ=NQ, NMAX=nmax, D=D, win_l=win_l, win_r=win_r,
                      softcap2=float(softcap) * kit.LOG2E.value if softcap else 1.0, page_size=page_size,
                      num_pages=num_pages, table_row=table_row, BLOCK_D=block_d, PRECISION="ieee",
                      **variants, **paged)
    if num_splits == 1:
        return o_part.view(B, H, NQ, D), lse_part.view(B, H, NQ)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)
    sink = {} if sinks is None else {"SINK": True}
    COMBINE_SPEC.launch(OP=o_part, LP=lse_part, O=o, LSE=lse, SINKS=lse if sinks is None else sinks,
                        n_rows=n_rows, H=H, NQ=NQ, N_SPLITS=num_splits, D=D,
                        BLOCK_S=max(2, kit.next_pow2(num_splits)), BLOCK_D=block_d, **sink)
    return o, lse


def _table(block_table):
    """The block table as the kernels read it: int32 with a contiguous last dim (a copy only where it
    is not: on the device, no host read)."""
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    return table if table.stride(-1) == 1 else table.contiguous()


# ------------------------------------------------------------------------------ the in-place append

@triton.jit
def _append_kernel(KC, VC, KN, VN, SEQLENS, TABLE,
                   stride_kcb, stride_kch, stride_kcn,
                   stride_vcb, stride_vch, stride_vcn,
                   stride_knb, stride_knh, stride_knn,
                   stride_vnb, stride_vnh, stride_vnn,
                   HKV, NNEW, CAP, D, page_size, num_pages, table_row,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGED: tl.constexpr = False):
    # one program per (batch b, kv head hk, block of BLOCK_M new tokens)
    pid_t, pid_bhk = kit.unflatten(tl.program_id(0), tl.cdiv(NNEW, BLOCK_M))
    hk, b = kit.unflatten(pid_bhk, HKV)
    b, hk = b.to(tl.int64), hk.to(tl.int64)      # offsets in 64 bits
    offs_i = pid_t * BLOCK_M + tl.arange(0, BLOCK_M)   # new tokens i
    offs_d = tl.arange(0, BLOCK_D)
    # the cache's length, clamped into [0, CAP] as decode clamps it (no
    # host read-back); token i goes to position len + i, if under CAP
    n = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), CAP)
    pos = n + offs_i
    ok = (offs_i < NNEW) & (pos < CAP)
    # the new rows, (B, HKV, NNEW, d) strides
    rows = offs_i.to(tl.int64)
    src_k = KN + b * stride_knb + hk * stride_knh + rows * stride_knn
    src_v = VN + b * stride_vnb + hk * stride_vnh + rows * stride_vnn
    if PAGED:         # the cache viewed (num_pages, HKV, page_size, d)
        page, slot = kit.page_slots(table=TABLE + b * table_row, rows=pos,
                                    row_ok=ok, page_size=page_size,
                                    num_pages=num_pages)
        dst_k = KC + page * stride_kcb + hk * stride_kch + slot * stride_kcn
        dst_v = VC + page * stride_vcb + hk * stride_vch + slot * stride_vcn
    else:
        slot = pos.to(tl.int64)
        dst_k = KC + b * stride_kcb + hk * stride_kch + slot * stride_kcn
        dst_v = VC + b * stride_vcb + hk * stride_vch + slot * stride_vcn
    k = kit.load_tile(row_ptrs=src_k, row_ok=ok, offs_d=offs_d, D=D,
                      UPCAST=False)
    v = kit.load_tile(row_ptrs=src_v, row_ok=ok, offs_d=offs_d, D=D,
                      UPCAST=False)
    kit.store_tile(row_ptrs=dst_k, row_ok=ok, offs_d=offs_d, D=D, tile=k)
    kit.store_tile(row_ptrs=dst_v, row_ok=ok, offs_d=offs_d, D=D, tile=v)


APPEND_BLOCK_M = 16        # new tokens per append program (a step appends 1 to a few)


def grid_append(B: int, HKV: int, NNEW: int, block_m: int = APPEND_BLOCK_M) -> tuple[int]:
    """The append kernel's grid: one program per (batch·kv head, block of new tokens), flat.

    Explained in: notebooks/10_serving.

    Tested in: tests/kernels/triton/test_triton_paged_decode.py.
    """
    return flat_grid(B * HKV, kit.ceil_div(NNEW, block_m))


# The general case (the compile report's): paged is PAGED=True, a constexpr, as decode's.
APPEND_SPEC = KernelSpec(
    "decode_append", _append_kernel, types=dict(SEQLENS="i32", TABLE="i32"),
    grid=lambda a: grid_append(a["KN"].shape[0], a["HKV"], a["NNEW"], a["BLOCK_M"]),
    fixed=Config(APPEND_BLOCK_M, 0, num_warps=4, num_stages=1), uses_dot=False)


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Write the new tokens ``k, v`` into the cache IN PLACE, at positions ``cache_seqlens[b] + i``.

    Dense cache ``(B, Hkv, Nmax, d)`` with ``k, v (B, Hkv, Nnew, d)``; paged cache ``(num_pages,
    page_size, Hkv, d)`` with ``block_table`` int32 ``(B, max_pages)`` and ``k, v (B, Nnew, Hkv,
    d)`` (token t of sequence b: row ``t % page_size`` of page ``block_table[b, t // page_size]``).
    Any strides with a contiguous last dim; k, v are converted to the cache's dtype. A position at
    or past the capacity (Nmax, or ``max_pages · page_size``) is not written (a masked store: on a
    CPU :func:`flashlib.append_kv` raises first); nothing else is touched. ``cache_seqlens`` int32
    ``(B,)`` is never read by the host (clamped into ``[0, capacity]`` in the kernel, as decode's),
    nor is the table (page indices clamped into ``[0, num_pages - 1]``): CUDA-graph safe. The caller
    advances cache_seqlens. Returns None.

    Explained in: notebooks/10_serving.

    Tested in: tests/kernels/triton/test_triton_paged_decode.py.
    """
    if cache_seqlens is None:
        raise TypeError("cache_seqlens must be an int32 tensor (B,): where the new tokens go")
    if block_table is None:
        B, HKV, NNEW, D = k.shape
        cap = k_cache.shape[2]
        table, page_size, num_pages, table_row, paged = None, 1, 1, 0, {}
    else:
        B, NNEW, HKV, D = k.shape
        num_pages, page_size = k_cache.shape[:2]
        cap = block_table.shape[1] * page_size
        table = _table(block_table)
        table_row = table.stride(0)
        # the same (batch/page, head, row) views as decode's: no copy
        k_cache, v_cache = k_cache.permute(0, 2, 1, 3), v_cache.permute(0, 2, 1, 3)
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
        paged = {"PAGED": True}
    if B * HKV * NNEW == 0:
        return None
    APPEND_SPEC.launch(KC=k_cache, VC=v_cache, KN=k, VN=v, SEQLENS=cache_seqlens, TABLE=table, HKV=HKV,
                       NNEW=NNEW, CAP=cap, D=D, page_size=page_size, num_pages=num_pages,
                       table_row=table_row, BLOCK_D=kit.block_d(D), **paged)
    return None
