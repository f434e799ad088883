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
#   The variants of real models (issue 24), each a constexpr flag that defaults to off (a dense call
#   compiles the kernel as before): WINDOW — the key loop runs over the band (kit.band_key_range:
#   the full blocks unmasked, then both partial edges in one masked loop; blocks outside the band
#   never visited); SOFTCAP and ALIBI — kit.score_mods on every block (ALiBi's slope of (b, h) per
#   row); SINK — kit.add_sink after finish (lse includes the sink); DROPOUT — kit.dropout_keep in the
#   inner loop (tl.rand on flashlib.ladder.dropout's counters), O scaled by 1 / (1 - p) at the end.
#   The pointers SLOPES, SINKS and the scalars (variant_args) are passed on every call (lse stands
#   in for an unused pointer: never read).
# Idea: Dao 2023 (FlashAttention-2), Algorithm 1; exp2 trick and loop split as in Triton's
#   fused-attention tutorial (our own code, plain pointer arithmetic: no block pointers, which
#   triton 3.9 removed).
# Limits: head dim <= 256 (the tile is padded to the next power of two >= 16, loads are masked);
#   fp16, bf16, fp32 (fp32 in true fp32 unless allow_tf32); bf16 needs sm_80+. Any B·H (flat grid,
#   up to 2^31 - 1 programs); offsets are 64-bit (kit's "Offsets"), so a tensor may hold 2^31
#   elements or more; Nq and Nk each < 2^31. Variants: dropout's kernels spill a little at the
#   largest sm_80/sm_90 config (48-64 bytes; compile report of the variant kernels, triton 3.9).
# Run: flashlib.attention(q, k, v, backend="triton") (kernel="v1", the default); on a CPU it runs in
#   Triton's interpreter.
"""FlashAttention-2 forward kernel and its launcher.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import torch

from . import flat_grid, kit, triton, tl
from .configs import Config, Tables
from .spec import KernelSpec, staged_bytes

__all__ = ["forward", "variant_args", "grid", "SPEC", "CONFIGS"]


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, SLOPES, SINKS,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                stride_kn, stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_on,
                qk_scale, H, GROUP, NQ, NK, D, win_l, win_r, softcap2,
                drop_p, seed_lo, seed_hi, drop_lo, drop_hi,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                ALIBI: tl.constexpr = False, SINK: tl.constexpr = False,
                DROPOUT: tl.constexpr = False):
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
    # The variants (constexprs, each off by default: the dense kernel is
    # compiled as without them). ALiBi: this head's slope, base 2, per row.
    if ALIBI:
        slopes2 = tl.full([BLOCK_M], 0.0, tl.float32) + \
            tl.load(SLOPES + b * H + h) * kit.LOG2E
    else:
        slopes2 = 0.0
    if DROPOUT:     # counters offset + ((b·H + h)·Nq + i)·Nk + j, 64-bit
        seed = kit.join64(seed_lo, seed_hi)
        drop_base = kit.join64(drop_lo, drop_hi) + (b * H + h) * NQ * NK
    else:
        seed = 0
        drop_base = 0
    # line 6: the key blocks every row sees in [lo_full, hi_full) (no mask),
    # then the diagonal / ragged ones in [lo, hi) past those (masked).
    if WINDOW:        # the band: both partial edges, blocks outside it skipped
        lo, lo_full, hi_full, hi = kit.band_key_range(
            start_m=pid_m * BLOCK_M, NQ=NQ, NK=NK, WIN_L=win_l, WIN_R=win_r,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    else:
        hi_full, hi = kit.key_range(
            start_m=pid_m * BLOCK_M, NQ=NQ, NK=NK, BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, CAUSAL=CAUSAL)
        lo_full = 0
        lo = hi_full
    acc, l_i, m_i = kit.attend(
        acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
        stride_kn=stride_kn, stride_vn=stride_vn, offs_m=offs_m,
        offs_d=offs_d, lo=lo_full, hi=hi_full, NK=NK, offset=NK - NQ, D=D,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.FULL, CAUSAL=CAUSAL,
        UPCAST=UPCAST, PRECISION=PRECISION, win_l=win_l, win_r=win_r,
        softcap2=softcap2, slopes2=slopes2, seed=seed, drop_base=drop_base,
        drop_p=drop_p, WINDOW=WINDOW, SOFTCAP=SOFTCAP, ALIBI=ALIBI,
        DROPOUT=DROPOUT)
    acc, l_i, m_i = kit.attend(
        acc=acc, l_i=l_i, m_i=m_i, q=q, k_base=k_base, v_base=v_base,
        stride_kn=stride_kn, stride_vn=stride_vn, offs_m=offs_m,
        offs_d=offs_d, lo=lo, hi=hi, NK=NK, offset=NK - NQ, D=D,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.MASKED, CAUSAL=CAUSAL,
        UPCAST=UPCAST, PRECISION=PRECISION, win_l=win_l, win_r=win_r,
        softcap2=softcap2, slopes2=slopes2, seed=seed, drop_base=drop_base,
        drop_p=drop_p, skip_lo=lo_full, skip_hi=hi_full, WINDOW=WINDOW,
        SOFTCAP=SOFTCAP, ALIBI=ALIBI, DROPOUT=DROPOUT)
    # lines 12-13: O_i, L_i (natural log)
    o, lse = kit.finish(acc, l_i, m_i)
    if DROPOUT:                       # P~ = P o Z / (1 - p): the 1 / (1 - p)
        o = o * (1.0 / (1.0 - drop_p))
    if SINK:                          # the sink joins the denominator only
        o, lse = kit.add_sink(o, lse, tl.full([BLOCK_M], 0.0, tl.float32)
                              + tl.load(SINKS + h))
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
SPEC = KernelSpec("fa2_fwd", _fwd_kernel, types=dict(LSE="fp32", SLOPES="fp32", SINKS="fp32", qk_scale="fp32",
                                                     softcap2="fp32", drop_p="fp32"),
                  grid=lambda a: grid(a["Q"].shape[0], a["H"], a["NQ"], a["BLOCK_M"]),
                  config="fwd", tables=CONFIGS, smem=smem_estimate)


# The variant arguments of a dense call: every flag off (their defaults), the scalars unused.
_DENSE = dict(win_l=0, win_r=0, softcap2=1.0, drop_p=0.0, seed_lo=0, seed_hi=0, drop_lo=0, drop_hi=0)


def variant_args(nq: int, nk: int, unused, *, causal: bool, window_size=(-1, -1), softcap: float = 0.0,
                 alibi_slopes=None, sinks=None, dropout_p: float = 0.0, dropout_seed=None,
                 spec: KernelSpec | None = None) -> dict:
    """The variant arguments of the forward kernel by name (the backward's take the same names): the
    constexpr flags WINDOW, SOFTCAP, ALIBI, SINK, DROPOUT, each True only for a variant in use (a
    dense call compiles the dense kernel); the scalars — the band ``win_l``, ``win_r``
    (:func:`kit.band`, causal folded in), ``softcap2`` = softcap · log2 e, ``drop_p``, and the seed and
    offset as int32 words ``seed_lo``, ``seed_hi``, ``drop_lo``, ``drop_hi`` (:func:`kit.split32`) —
    and the SLOPES / SINKS pointers (``unused``, a float32 tensor, where not given: never read).
    ``alibi_slopes`` float32 ``(B, H)`` contiguous, ``sinks`` float32 ``(H,)``, ``dropout_seed``
    ``(seed, offset)``: as flashlib.api passes them (V24's backend interface). ``spec``: a kernel
    that takes no variant (the TMA forward's) gets no argument, and a ValueError naming each
    variant in use.

    Explained in: notebooks/09_real_models.
    Tested in: tests/kernels/triton/test_triton_variants_fwd.py.
    """
    window = tuple(window_size) != (-1, -1)
    if spec is not None and "win_l" not in spec.scalars:
        used = [name for name, on in (("window_size", window), ("softcap", softcap > 0),
                                      ("alibi_slopes", alibi_slopes is not None),
                                      ("sinks", sinks is not None), ("dropout_p", dropout_p > 0)) if on]
        if used:
            raise ValueError(f"{spec.name} takes no attention variant, got {', '.join(used)}: "
                             "version 1 runs them")
        return {}
    args = dict(_DENSE, WINDOW=window, SOFTCAP=bool(softcap), ALIBI=alibi_slopes is not None,
                SINK=sinks is not None, DROPOUT=dropout_p > 0,
                SLOPES=unused if alibi_slopes is None else alibi_slopes,
                SINKS=unused if sinks is None else sinks)
    if window:
        args["win_l"], args["win_r"] = kit.band(window_size, causal, nq, nk)
    if softcap:
        args["softcap2"] = float(softcap) * kit.LOG2E.value
    if dropout_p > 0:
        if dropout_seed is None:
            raise ValueError("dropout_p > 0 needs dropout_seed=(seed, offset)")
        seed, offset = dropout_seed
        args["drop_p"] = float(dropout_p)
        args["seed_lo"], args["seed_hi"] = kit.split32(int(seed))
        args["drop_lo"], args["drop_hi"] = kit.split32(int(offset))
    return args


def forward(q, k, v, *, causal: bool, scale: float, allow_tf32: bool = False,
            config: Config | None = None, spec: KernelSpec = SPEC, **variants):
    """Launch the forward kernel: ``(o, lse)`` for ``q (B, H, Nq, d)``,
    ``k, v (B, Hkv, Nk, d)``.

    Inputs are validated by :func:`flashlib.attention`; the last dim must be
    contiguous (stride 1), other strides are passed to the kernel. ``lse``
    is float32 ``(B, H, Nq)``, natural log. ``config``: None lets the
    device's table choose (:meth:`KernelSpec.launch`); tests give one to
    force several blocks on short sequences. ``spec``: this file's kernel,
    or another with its arguments (the TMA forward's,
    :mod:`flashlib.kernels.triton.fa2_fwd_v4_tma`, which takes no variant).

    ``variants``: ``window_size`` ``(left, right)``, ``softcap``,
    ``alibi_slopes`` float32 ``(B, H)``, ``sinks`` float32 ``(H,)`` (lse
    includes the sink), ``dropout_p`` with ``dropout_seed=(seed, offset)``
    (flashlib.ladder.dropout's counters), flash-attn's semantics, validated
    by flashlib.attention. Each one used compiles its constexpr branch
    (:func:`variant_args`); none used, the dense kernel as before.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_fa2_fwd_v1.py and
    tests/kernels/triton/test_triton_variants_fwd.py.
    """
    B, H, NQ, D = q.shape
    HKV, NK = k.shape[1], k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty((B, H, NQ), device=q.device, dtype=torch.float32)
    # the variants' kernel arguments (none used: the dense kernel)
    extra = variant_args(NQ, NK, lse, causal=causal, spec=spec, **variants)
    spec.launch(config, Q=q, K=k, V=v, O=o, LSE=lse,
                qk_scale=kit.qk_scale(scale), H=H, GROUP=H // HKV, NQ=NQ,
                NK=NK, D=D, CAUSAL=causal, BLOCK_D=kit.block_d(D),
                PRECISION="tf32" if allow_tf32 else "ieee", **extra)
    return o, lse
