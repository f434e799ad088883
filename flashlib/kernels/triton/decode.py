# decode.py — Flash-Decoding in Triton, version 3 of the Triton kernels.
# Changed from the forward (fa2_fwd.py): for decoding, Nq is tiny and the forward's grid
#   (query blocks x batch·heads) leaves most SMs idle. Here the grid adds a split: program
#   (b·hk, r, s) attends the query rows r to the s-th contiguous chunk of sequence b's *valid* cache
#   (cache_seqlens[b] keys, ragged across the batch) and writes a normalized partial output O_s and
#   its log-sum-exp LSE_s; a second kernel merges the splits by LSE (the online-softmax merge).
#   Both grids are flat (flashlib.kernels.triton.flat_grid): the split kernel decodes (b·hk, r, s) from
#   tl.program_id(0), s fastest, so the programs of one kv head are neighbours; the combine kernel
#   has one program per query row. Neither is bound by CUDA's 65,535 on a second grid axis.
#   GQA: the query rows of a program are all (query head of the group, query position) pairs that read
#   kv head hk, stacked — each K/V tile is loaded once for the whole group, and never copied.
#   Every query sees every valid key (decoding appends the new tokens to the cache first); a sequence
#   with cache_seqlens[b] = 0 sees nothing: o = 0, lse = -inf, like a fully masked row.
# Idea: Dao, Haziza, Massa, Sizov 2023 (Flash-Decoding); the ladder is flashlib.ladder.decoding.
# Limits: head dim <= 256; fp16, bf16, fp32; bf16 needs sm_80+; not differentiable (inference). Any
#   B·H; 32-bit offsets: each tensor, and the partials (num_splits·B·H·Nq·BLOCK_D), < 2^31 elements.
# Run: flashlib.decode(q, k_cache, v_cache, cache_seqlens=lens, backend="triton").
"""Flash-Decoding split-KV and combine kernels and their launcher.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import torch

from . import INTERPRET, flat_grid, triton, tl
from .configs import Config, launch
from .fa2_fwd import LOG2E

__all__ = ["decode", "grid_split", "grid_combine", "split_block_m"]


@triton.jit
def _split_kernel(Q, K, V, SEQLENS, OP, LP,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn,
                  qk_scale, B, H, HKV, GROUP, NQ, D,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    n_r = tl.cdiv(GROUP * NQ, BLOCK_M)                 # blocks of stacked query rows per kv head
    n_splits = tl.num_programs(0) // (B * HKV * n_r)   # the flat grid is B·HKV x n_r x n_splits
    pid = tl.program_id(0)
    split = pid % n_splits                             # kernel 1: one program per split ...
    pid_r = (pid // n_splits) % n_r                    # ... block of stacked query rows ...
    pid_bhk = pid // (n_splits * n_r)                  # ... batch b and kv head hk
    b = pid_bhk // HKV
    hk = pid_bhk % HKV
    offs_r = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)   # stacked rows r = g * NQ + iq
    row_ok = offs_r < GROUP * NQ
    h = hk * GROUP + offs_r // NQ                      # (BLOCK_M,) query head of each row
    iq = offs_r % NQ                                   # (BLOCK_M,) query position of each row
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < D
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + iq[:, None] * stride_qn + offs_d[None, :],
                mask=row_ok[:, None] & d_ok, other=0.0)
    if UPCAST:                                         # interpreter + bf16: dots in fp32 (see fa2_fwd)
        q = q.to(tl.float32)
    nk = tl.load(SEQLENS + b)                          # this sequence's valid keys
    chunk = tl.cdiv(tl.cdiv(nk, n_splits), BLOCK_N) * BLOCK_N   # keys per split, whole blocks
    start = split * chunk
    end = tl.minimum(start + chunk, nk)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + offs_d[None, :]
    for start_n in range(start, end, BLOCK_N):         # the online softmax over this split's keys
        offs_n = start_n + offs_n0
        kv_mask = (offs_n[:, None] < end) & d_ok
        k = tl.load(k_base + offs_n[:, None] * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(offs_n[None, :] < end, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])           # m_new is finite: each block has a valid key
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    seen = l_i > 0.0                                   # False for an empty split
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]                        # O_s, normalized (0 for an empty split)
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    rows = (b * H + h) * NQ + iq                       # flat row index into (B, H, NQ)
    n_rows = B * H * NQ
    tl.store(OP + (split * n_rows + rows[:, None]) * BLOCK_D + offs_d[None, :], acc,
             mask=row_ok[:, None])
    tl.store(LP + split * n_rows + rows, lse, mask=row_ok)


@triton.jit
def _combine_kernel(OP, LP, O, LSE, n_rows, H, NQ, N_SPLITS, stride_ob, stride_oh, stride_on, D,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)                             # kernel 2: one program per query row (flat)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < N_SPLITS
    lse_s = tl.load(LP + offs_s * n_rows + row, mask=s_ok, other=float("-inf"))   # (BLOCK_S,)
    m = tl.max(lse_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)       # every split empty: weights 0, no NaN
    w = tl.math.exp2((lse_s - m_use) * 1.4426950408889634)   # exp(LSE_s - m)
    l = tl.sum(w, 0)
    l_safe = tl.where(l > 0.0, l, 1.0)
    o_s = tl.load(OP + (offs_s[:, None] * n_rows + row) * BLOCK_D + offs_d[None, :],
                  mask=s_ok[:, None], other=0.0)       # (BLOCK_S, BLOCK_D)
    o = tl.sum(w[:, None] * o_s, 0) / l_safe           # sum_s exp(LSE_s - lse) O_s
    lse = tl.where(l > 0.0, m_use + tl.math.log2(l_safe) * 0.6931471805599453, float("-inf"))
    b = row // (H * NQ)
    h = (row // NQ) % H
    iq = row % NQ
    tl.store(O + b * stride_ob + h * stride_oh + iq * stride_on + offs_d, o.to(O.dtype.element_ty),
             mask=offs_d < D)
    tl.store(LSE + row, lse)


def split_block_m(cfg_block_m: int, group: int, NQ: int) -> int:
    """Stacked query rows per split-kernel program: the config's block_m is a cap, 16 the floor.

    Explained in: notebooks/07_triton."""
    return max(16, min(cfg_block_m, triton.next_power_of_2(group * NQ)))


def grid_split(B: int, HKV: int, group: int, NQ: int, block_m: int, num_splits: int) -> tuple[int]:
    """The split kernel's grid: one program per (batch·kv head, row block, split), flat, split fastest.

    Explained in: notebooks/07_triton."""
    return flat_grid(B * HKV, triton.cdiv(group * NQ, block_m), num_splits)


def grid_combine(B: int, H: int, NQ: int) -> tuple[int]:
    """The combine kernel's grid: one program per query row of (B, H, Nq).

    Explained in: notebooks/07_triton."""
    return flat_grid(B * H * NQ)


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits: int, scale: float,
           config: Config | None = None):
    """Launch split-KV then combine: ``(o, lse)`` for ``q (B, H, Nq, d)``, caches ``(B, Hkv, Nmax, d)``.

    ``cache_seqlens`` is an int32 tensor ``(B,)`` of valid cache lengths (validated by
    :func:`flashlib.decode`). Partial results live in an fp32 buffer ``(num_splits, B·H·Nq, BLOCK_D)``.
    """
    B, H, NQ, D = q.shape
    HKV = k_cache.shape[1]
    group = H // HKV
    block_d = max(16, triton.next_power_of_2(D))
    n_rows = B * H * NQ
    o_part = torch.empty((num_splits, n_rows, block_d), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((num_splits, n_rows), device=q.device, dtype=torch.float32)

    def run(cfg):
        block_m = split_block_m(cfg.block_m, group, NQ)
        _split_kernel[grid_split(B, HKV, group, NQ, block_m, num_splits)](
            q, k_cache, v_cache, cache_seqlens, o_part, lse_part,
            q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            scale * LOG2E, B, H, HKV, group, NQ, D,
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            UPCAST=INTERPRET and q.dtype == torch.bfloat16, PRECISION="ieee",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch("decode", q.device, block_d, q.element_size(), run, config)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)
    _combine_kernel[grid_combine(B, H, NQ)](
        o_part, lse_part, o, lse, n_rows, H, NQ, num_splits, o.stride(0), o.stride(1), o.stride(2), D,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d)
    return o, lse
