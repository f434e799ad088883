# fa2_fwd_v1.py — FlashAttention-2 forward in Triton, version 1 of the Triton kernels (the default).
# Changed from the NumPy ladder (flashlib.ladder.fa2.forward): one program per (query block,
#   batch·head) instead of a Python loop; the online softmax runs in base 2 with the scale folded
#   into one multiplier (exp2(x·scale·log2 e) = exp(x·scale), and exp2 is the GPU's native
#   instruction); the key loop is split in two — blocks every row of the query block sees (no mask
#   at all), then the diagonal / ragged-end blocks (causal and bounds masks) — and blocks the causal
#   mask hides entirely are never visited. GQA reads kv head h // (H // Hkv) through its stride: no
#   copy of K/V.
#   The grid is flat (flashlib.kernels.triton.flat_grid): program p is query block p % n_blocks of
#   batch·head p // n_blocks, so the query blocks of one head are neighbours (its K/V stay in L2)
#   and B·H may exceed the 65,535 programs CUDA allows on a second grid axis.
#   The pieces the kernels share live in flashlib.kernels.triton.kit: the grid decode (unflatten),
#   the key range (key_range), the tile loads, the inner loop with its two stages (attend: FULL,
#   MASKED) and its online-softmax step. SPEC (flashlib.kernels.triton.spec), read from the kernel's
#   signature, and the config table sit beside the kernel: forward allocates, builds the arguments
#   and calls SPEC.launch. Version 4 (fa2_fwd_v4_tma.py) is this forward with its own spec.
#   NaN follows flashlib's rule (kit's header): a NaN a row sees makes the row NaN (O, and L unless
#   it is in V), one it does not see (causal mask, padding) changes nothing; kit.finish and
#   kit.attend's causal MASKED stage carry it.
# Idea: Dao 2023 (FlashAttention-2), Algorithm 1; exp2 trick and loop split as in Triton's
#   fused-attention tutorial (our own code, plain pointer arithmetic: no block pointers, which
#   triton 3.9 removed).
# Limits: head dim <= 256 (the tile is padded to the next power of two >= 16, loads are masked);
#   fp16, bf16, fp32 (fp32 in true fp32 unless allow_tf32); bf16 needs sm_80+. Any B·H (flat grid,
#   up to 2^31 - 1 programs); offsets are 64-bit (kit's "Offsets"), so a tensor may hold 2^31
#   elements or more; Nq and Nk each < 2^31.
# Run: flashlib.attention(q, k, v, backend="triton") (kernel="v1", the default); on a CPU it runs in
#   Triton's interpreter.
"""FlashAttention-2 forward kernel and its launcher.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import torch

from . import flat_grid, kit, triton, tl
from .configs import Config, Tables
from .spec import KernelSpec, staged_bytes

__all__ = ["forward", "grid", "SPEC", "CONFIGS"]


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                stride_kn, stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_on,
                qk_scale, H, GROUP, NQ, NK, D,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    # line 3: this program's query block i, of batch b, head h
    pid_m, pid_bh = kit.unflatten(tl.program_id(0), tl.cdiv(NQ, BLOCK_M))
    h, b = kit.unflatten(pid_bh, H)
    hk = h // GROUP                   # GQA: the kv head this query head reads
    # offsets in 64 bits (kit: Offsets)
    b, h, hk = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,) query rows
    rows = offs_m.to(tl.int64)        # rows x stride can pass 2^31: 64 bits
    offs_d = tl.arange(0, BLOCK_D)    # (BLOCK_D,) head dim, padded to 2^k
    row_ok = offs_m < NQ
    q_rows = Q + b * stride_qb + h * stride_qh + rows * stride_qn
    # line 4: Q_i (BLOCK_M, BLOCK_D)
    q = kit.load_tile(row_ptrs=q_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    # line 5: m_i = -inf, l_i = 0, O_i = 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    # line 6: the key blocks every row sees (no mask), then the diagonal /
    # ragged ones (masked).
    lo_masked, hi = kit.key_range(
        start_m=pid_m * BLOCK_M, NQ=NQ, NK=NK, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
    acc, l_i, m_i = kit.attend(
        acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
        stride_kn=stride_kn, stride_vn=stride_vn, offs_m=offs_m,
        offs_d=offs_d, lo=0, hi=lo_masked, NK=NK, offset=NK - NQ, D=D,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.FULL, CAUSAL=CAUSAL,
        UPCAST=UPCAST, PRECISION=PRECISION)
    acc, l_i, m_i = kit.attend(
        acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
        stride_kn=stride_kn, stride_vn=stride_vn, offs_m=offs_m,
        offs_d=offs_d, lo=lo_masked, hi=hi, NK=NK, offset=NK - NQ, D=D,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.MASKED, CAUSAL=CAUSAL,
        UPCAST=UPCAST, PRECISION=PRECISION)
    # lines 12-13: O_i, L_i (natural log)
    o, lse = kit.finish(acc, l_i, m_i)
    # lines 14-15: write O_i and L_i
    o_rows = O + b * stride_ob + h * stride_oh + rows * stride_on
    kit.store_tile(row_ptrs=o_rows, row_ok=row_ok, offs_d=offs_d, D=D, tile=o)
    tl.store(LSE + (b * H + h) * NQ + offs_m, lse, mask=row_ok)


def grid(B: int, H: int, NQ: int, block_m: int) -> tuple[int]:
    """The forward's grid: one program per (batch·head, query block),
    flattened on axis 0.

    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_fa2_fwd_v1.py.
    """
    return flat_grid(B * H, kit.ceil_div(NQ, block_m))


def smem_estimate(cfg: Config, block_d: int, elem_bytes: int) -> int:
    """Shared-memory bytes of the forward's tiles: Q resident, K and V streamed per pipeline stage.

    Explained in: notebooks/07_triton."""
    return staged_bytes(cfg, elem_bytes, resident=cfg.block_m * block_d, streamed=2 * cfg.block_n * block_d)


# The candidates per architecture (configs.Tables; how they were chosen: configs' header). sm_80+: the
# H100's list (cross-compiled for sm_80-sm_89, not run there).
CONFIGS = Tables(
    sm80=(Config(128, 64, 8, 3), Config(128, 32, 8, 2), Config(64, 64, 4, 2), Config(64, 32, 4, 2),
          Config(32, 32, 4, 1)),
    sm75=(Config(32, 16, 8, 1),), fp32=(Config(32, 16, 8, 1),), sm75_fp32=(Config(32, 16, 8, 1),),
    interpreter=Config(32, 16))
SPEC = KernelSpec("fa2_fwd", _fwd_kernel, types=dict(LSE="fp32", qk_scale="fp32"),
                  grid=lambda a: grid(a["Q"].shape[0], a["H"], a["NQ"], a["BLOCK_M"]),
                  config="fwd", tables=CONFIGS, smem=smem_estimate)


def forward(q, k, v, *, causal: bool, scale: float, allow_tf32: bool = False,
            config: Config | None = None, spec: KernelSpec = SPEC):
    """Launch the forward kernel: ``(o, lse)`` for ``q (B, H, Nq, d)``,
    ``k, v (B, Hkv, Nk, d)``.

    Inputs are validated by :func:`flashlib.attention`; the last dim must be
    contiguous (stride 1), other strides are passed to the kernel. ``lse``
    is float32 ``(B, H, Nq)``, natural log. ``config``: None lets the
    device's table choose (:meth:`KernelSpec.launch`); tests give one to
    force several blocks on short sequences. ``spec``: this file's kernel,
    or another with its arguments (the TMA forward's,
    :mod:`flashlib.kernels.triton.fa2_fwd_v4_tma`).

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_fa2_fwd_v1.py.
    """
    B, H, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)
    spec.launch(config, Q=q, K=k, V=v, O=o, LSE=lse,
                qk_scale=kit.qk_scale(scale), H=H, GROUP=H // HKV, NQ=NQ,
                NK=NK, D=D, CAUSAL=causal, BLOCK_D=kit.block_d(D),
                PRECISION="tf32" if allow_tf32 else "ieee")
    return o, lse
