# fa2_fwd.py — FlashAttention-2 forward in Triton, version 1 of the Triton kernels.
# Changed from the NumPy ladder (flashlib.ladder.fa2.forward): one program per (query block, batch·head)
#   instead of a Python loop; the online softmax runs in base 2 with the scale folded into one
#   multiplier (exp2(x·scale·log2 e) = exp(x·scale), and exp2 is the GPU's native instruction);
#   the key loop is split in two — blocks every row of the query block sees (no mask at all), then the
#   diagonal / ragged-end blocks (causal and bounds masks) — and blocks the causal mask hides entirely
#   are never visited. GQA reads kv head h // (H // Hkv) through its stride: no copy of K/V.
#   The grid is flat (flashlib.kernels.triton.flat_grid): program p is query block p % n_blocks of batch·head
#   p // n_blocks, so the query blocks of one head are neighbours (its K/V stay in L2) and B·H may
#   exceed the 65,535 programs CUDA allows on a second grid axis.
# Idea: Dao 2023 (FlashAttention-2), Algorithm 1; exp2 trick and loop split as in Triton's
#   fused-attention tutorial (our own code, plain pointer arithmetic: no block pointers, which
#   triton 3.9 removed).
# Limits: head dim <= 256 (the tile is padded to the next power of two >= 16, loads are masked);
#   fp16, bf16, fp32 (fp32 in true fp32 unless allow_tf32); bf16 needs sm_80+. Any B·H (flat grid, up
#   to 2^31 - 1 programs); offsets are 32-bit integers, so each tensor must hold < 2^31 elements.
# Run: flashlib.attention(q, k, v, backend="triton"); on a CPU it runs in Triton's interpreter.
"""FlashAttention-2 forward kernel and its launcher.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import math

import torch

from . import INTERPRET, flat_grid, triton, tl
from .configs import Config, launch

__all__ = ["forward", "grid"]

LOG2E = math.log2(math.e)   # exp(x) = exp2(x * log2 e)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                qk_scale, H, GROUP, NQ, NK, D,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    n_m = tl.cdiv(NQ, BLOCK_M)                        # query blocks per head (flat grid: axis 0)
    pid_m = tl.program_id(0) % n_m                    # line 3: this program is query block i ...
    pid_bh = tl.program_id(0) // n_m                  # ... of batch b, head h
    b = pid_bh // H
    h = pid_bh % H
    hk = h // GROUP                                   # GQA: the kv head this query head reads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query rows
    offs_n = tl.arange(0, BLOCK_N)                    # (BLOCK_N,) key offsets within a block
    offs_d = tl.arange(0, BLOCK_D)                    # (BLOCK_D,) head dim, padded to a power of 2
    d_ok = offs_d[None, :] < D                        # padding columns load as 0: dots unchanged
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :]
    k_base = K + b * stride_kb + hk * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + hk * stride_vh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m[:, None] < NQ) & d_ok, other=0.0)   # line 4: Q_i (BLOCK_M, BLOCK_D)
    if UPCAST:                                        # triton 3.9's interpreter gets bf16 tl.dot
        q = q.to(tl.float32)                          # wrong: dot in fp32 when interpreting bf16
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # line 5: m_i = -inf, l_i = 0, O_i = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Key range. Bottom-right causal: query i sees key j iff j <= i + (NK - NQ).
    offset = NK - NQ
    if CAUSAL:
        last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, NQ) - 1
        hi = tl.minimum(tl.maximum(last_row + offset + 1, 0), NK)        # keys past hi: hidden
        seen_by_all = tl.minimum(tl.maximum(pid_m * BLOCK_M + offset + 1, 0), NK)
    else:
        hi = NK
        seen_by_all = NK
    lo_masked = (seen_by_all // BLOCK_N) * BLOCK_N    # whole blocks before this need no mask

    # line 6, part 1: key blocks every row sees, no mask.
    for start_n in range(0, lo_masked, BLOCK_N):
        rows = start_n + offs_n
        k = tl.load(k_base + rows[:, None] * stride_kn, mask=d_ok, other=0.0)   # line 7: K_j, V_j
        v = tl.load(v_base + rows[:, None] * stride_vn, mask=d_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale      # line 8: S_ij, base 2
        m_new = tl.maximum(m_i, tl.max(s, 1))                                  # line 9: m_i^(j)
        p = tl.math.exp2(s - m_new[:, None])                                   # P~_ij
        alpha = tl.math.exp2(m_i - m_new)                                      # e^(m^(j-1) - m^(j))
        l_i = l_i * alpha + tl.sum(p, 1)                                       # l_i^(j)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # line 10
        m_i = m_new

    # line 6, part 2: the diagonal blocks (causal) and the ragged last block: masked.
    for start_n in range(lo_masked, hi, BLOCK_N):
        rows = start_n + offs_n
        k = tl.load(k_base + rows[:, None] * stride_kn, mask=(rows[:, None] < NK) & d_ok, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vn, mask=(rows[:, None] < NK) & d_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = rows[None, :] < NK
        if CAUSAL:
            visible = visible & (rows[None, :] <= offs_m[:, None] + offset)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that saw nothing yet: avoid
        p = tl.math.exp2(s - m_use[:, None])                   # (-inf) - (-inf) = NaN
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    seen = l_i > 0.0                                           # False: the row sees no key
    l_safe = tl.where(seen, l_i, 1.0)
    acc = acc / l_safe[:, None]                                # line 12: O_i = diag(l)^-1 O_i (0 if unseen)
    # line 13: L_i = m_i + log l_i, back from base 2 to natural log (x ln 2); -inf for unseen rows
    lse = tl.where(seen, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=(offs_m[:, None] < NQ) & d_ok)  # line 14
    tl.store(LSE + pid_bh * NQ + offs_m, lse, mask=offs_m < NQ)                       # line 15


def grid(B: int, H: int, NQ: int, block_m: int) -> tuple[int]:
    """The forward's grid: one program per (batch·head, query block), flattened on axis 0.

    Explained in: notebooks/07_triton."""
    return flat_grid(B * H, triton.cdiv(NQ, block_m))


def forward(q, k, v, *, causal: bool, scale: float, allow_tf32: bool = False, config: Config | None = None):
    """Launch the forward kernel: ``(o, lse)`` for ``q (B, H, Nq, d)``, ``k, v (B, Hkv, Nk, d)``.

    Inputs are validated by :func:`flashlib.attention`; the last dim must be contiguous (stride 1),
    other strides are passed to the kernel. ``lse`` is float32 ``(B, H, Nq)``, natural log.
    ``config`` overrides the block sizes (tests use it to force several blocks on short sequences);
    otherwise :func:`flashlib.kernels.triton.configs.launch` picks them for the device.
    """
    B, H, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    o = torch.empty_like(q)
    lse = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)

    def run(cfg):
        _fwd_kernel[grid(B, H, NQ, cfg.block_m)](
            q, k, v, o, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            scale * LOG2E, H, H // HKV, NQ, NK, D,
            CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
            UPCAST=INTERPRET and q.dtype == torch.bfloat16,
            PRECISION="tf32" if allow_tf32 else "ieee",
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    launch("fwd", q.device, block_d, q.element_size(), run, config)
    return o, lse
