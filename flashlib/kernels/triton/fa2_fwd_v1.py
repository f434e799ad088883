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
#   Ragged batches (issue 25), one more constexpr, VARLEN (off: the dense kernel as before):
#   forward_varlen packs B sequences end to end, token-major (q (Tq, H, d), k, v (Tk, Hkv, d),
#   passed as (1, H, T, d) views: heads_view), with cu_seqlens CU_Q, CU_K (int32, B + 1). The grid
#   is the dense one over (B·H, ceil(max_q / BLOCK_M)); a program reads its sequence's start and
#   length from CU_Q, CU_K (no length crosses to the host), exits at once if its query block
#   starts past the sequence's end, and otherwise runs the dense kernel with NQ, NK = nq_b, nk_b
#   (masks bottom-right per sequence) from the sequence's first token (start · row stride: no
#   batch stride; kit.sequence clamps starts and lengths into the totals TQ, TK and the grid);
#   lse is (H, Tq), head h's row at h · TQ. Every variant composes: ALiBi's slopes (B, H) per
#   sequence; dropout's counters are sequence b's own dense (1, H, nq_b, nk_b) problem
#   from offset + b·H·max_q·max_k (unique, as H·nq_b·nk_b <= H·max_q·max_k).
# Idea: Dao 2023 (FlashAttention-2), Algorithm 1; exp2 trick and loop split as in Triton's
#   fused-attention tutorial (our own code, plain pointer arithmetic: no block pointers, which
#   triton 3.9 removed). Ragged batches: flash-attn's varlen interface (flash_attn_varlen_func,
#   cu_seqlens and max_seqlen; its kernels exit past a sequence's end the same way).
# Limits: head dim <= 256 (the tile is padded to the next power of two >= 16, loads are masked);
#   fp16, bf16, fp32 (fp32 in true fp32 unless allow_tf32); bf16 needs sm_80+. Any B·H (flat grid,
#   up to 2^31 - 1 programs); offsets are 64-bit (kit's "Offsets"), so a tensor may hold 2^31
#   elements or more; Nq and Nk each < 2^31. Variants: dropout's kernels spill a little at the
#   largest sm_80/sm_90 config (48-64 bytes; compile report of the variant kernels, triton 3.9).
#   Varlen: the grid is sized by max_q, so a batch of one long and many short sequences launches
#   programs that exit at once (cheap, not free); Tq, Tk < 2^31; max_q, max_k must be at least
#   every length (nothing in the kernel checks: a shorter max_q leaves rows unwritten).
# Run: flashlib.attention(q, k, v, backend="triton") (kernel="v1", the default);
#   flashlib.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend="triton") for packed
#   sequences; on a CPU both run in Triton's interpreter.
"""FlashAttention-2 forward kernel and its launcher.  Explained in: notebooks/07_triton."""
from __future__ import annotations

import torch

from . import flat_grid, kit, triton, tl
from .configs import Config, Tables
from .spec import KernelSpec, staged_bytes

__all__ = ["forward", "forward_varlen", "variant_args", "grid", "SPEC", "CONFIGS"]


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, SLOPES, SINKS, CU_Q, CU_K,
                stride_qb, stride_qh, stride_qn, stride_kb, stride_kh,
                stride_kn, stride_vb, stride_vh, stride_vn,
                stride_ob, stride_oh, stride_on,
                qk_scale, H, GROUP, NQ, NK, D, win_l, win_r, softcap2,
                drop_p, seed_lo, seed_hi, drop_lo, drop_hi, TQ, TK,
                CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
                ALIBI: tl.constexpr = False, SINK: tl.constexpr = False,
                DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False):
    # line 3: this program's query block i, of batch b, head h
    pid_m, pid_bh = kit.unflatten(tl.program_id(0), tl.cdiv(NQ, BLOCK_M))
    h, b = kit.unflatten(pid_bh, H)
    hk = h // GROUP                   # GQA: the kv head this query head reads
    # offsets in 64 bits (kit: Offsets)
    b, h, hk = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # (BLOCK_M,) query rows
    rows = offs_m.to(tl.int64)        # rows x stride can pass 2^31: 64 bits
    offs_d = tl.arange(0, BLOCK_D)    # (BLOCK_D,) head dim, padded to 2^k
    if VARLEN:
        # Ragged: sequence b is the packed tokens [cu[b], cu[b+1]) of q and
        # of k, v, token-major (no batch stride: its first token's row is
        # its base). NQ, NK, the longest lengths, sized the grid; they
        # become b's own (kit.sequence clamps start and length into the
        # tensors and the grid: a bad cu_seqlens on a GPU, unchecked, reads
        # nothing out of bounds), and a query block past b's end exits.
        max_nq, max_nk = NQ, NK
        q_start, NQ = kit.sequence(CU_Q, b, NQ, TQ)
        k_start, NK = kit.sequence(CU_K, b, NK, TK)
        if pid_m * BLOCK_M >= NQ:
            return
        q_start, k_start = q_start.to(tl.int64), k_start.to(tl.int64)
    row_ok = offs_m < NQ
    if VARLEN:
        q_rows = Q + q_start * stride_qn + h * stride_qh + rows * stride_qn
    else:
        q_rows = Q + b * stride_qb + h * stride_qh + rows * stride_qn
    # line 4: Q_i (BLOCK_M, BLOCK_D)
    q = kit.load_tile(row_ptrs=q_rows, row_ok=row_ok, offs_d=offs_d, D=D,
                      UPCAST=UPCAST)
    # line 5: m_i = -inf, l_i = 0, O_i = 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if VARLEN:
        k_base = K + k_start * stride_kn + hk * stride_kh
        v_base = V + k_start * stride_vn + hk * stride_vh
    else:
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
        if VARLEN:  # b's own (1, H, Nq, Nk) problem, from b·H·max_nq·max_nk
            drop_base = kit.join64(drop_lo, drop_hi) + \
                b * H * max_nq * max_nk + h * NQ * NK
        else:
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
    if VARLEN:
        o_rows = O + q_start * stride_on + h * stride_oh + rows * stride_on
    else:
        o_rows = O + b * stride_ob + h * stride_oh + rows * stride_on
    kit.store_tile(row_ptrs=o_rows, row_ok=row_ok, offs_d=offs_d, D=D, tile=o)
    if VARLEN:                        # lse (H, TQ): head h's row, b's part
        lse_rows = LSE + h * TQ + q_start + offs_m
    else:
        lse_rows = LSE + (b * H + h) * NQ + offs_m
    tl.store(lse_rows, lse, mask=row_ok)


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


def _spec_grid(a: dict) -> tuple[int]:
    """SPEC's grid from the launch's arguments: B is q's batch, or the number of packed sequences
    (len(cu_q) - 1) where VARLEN, NQ the longest query length (a kernel without VARLEN: dense)."""
    batch = a["CU_Q"].shape[0] - 1 if a.get("VARLEN") else a["Q"].shape[0]
    return grid(batch, a["H"], a["NQ"], a["BLOCK_M"])


SPEC = KernelSpec("fa2_fwd", _fwd_kernel, types=dict(LSE="fp32", SLOPES="fp32", SINKS="fp32", CU_Q="i32",
                                                     CU_K="i32", qk_scale="fp32", softcap2="fp32",
                                                     drop_p="fp32"),
                  grid=_spec_grid, config="fwd", tables=CONFIGS, smem=smem_estimate)


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
    # not packed: lse stands in for cu_q, cu_k (never read)
    if "CU_Q" in spec.pointers:
        extra.update(CU_Q=lse, CU_K=lse, TQ=0, TK=0)
    spec.launch(config, Q=q, K=k, V=v, O=o, LSE=lse,
                qk_scale=kit.qk_scale(scale), H=H, GROUP=H // HKV, NQ=NQ,
                NK=NK, D=D, CAUSAL=causal, BLOCK_D=kit.block_d(D),
                PRECISION="tf32" if allow_tf32 else "ieee", **extra)
    return o, lse


def heads_view(x):
    """The token-major ``x (T, H, d)`` as the kernels' ``(1, H, T, d)`` view
    (no copy): its (batch, head, row) strides are then (unused, x's head
    stride, x's token stride).

    Explained in: notebooks/10_serving.
    Tested in: tests/kernels/triton/test_triton_varlen_fwd.py.
    """
    return x.unsqueeze(0).transpose(1, 2)


def forward_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *,
                   causal: bool, scale: float, allow_tf32: bool = False,
                   config: Config | None = None, **variants):
    """Launch the forward kernel on a ragged (packed) batch: ``(o, lse)`` for
    ``q (Tq, H, d)``, ``k, v (Tk, Hkv, d)`` token-major, sequence b being
    rows ``cu_q[b]:cu_q[b+1]`` of q and ``cu_k[b]:cu_k[b+1]`` of k and v.

    ``cu_q``, ``cu_k``: int32 ``(B+1,)`` from 0, non-decreasing, contiguous
    on q's device; ``max_q``, ``max_k``: host ints at least every length
    (they size the grid: B·H·ceil(max_q / BLOCK_M) programs, those past
    their sequence's end exit at once; no length is read back to the host).
    Inputs are validated by :func:`flashlib.attention_varlen`; the last dim
    must be contiguous, other strides are passed to the kernel (a
    token-major view of a ``(B, N, H, d)`` buffer needs no copy). Masks
    align bottom-right per sequence (offset nk_b - nq_b); an empty sequence
    is allowed (nq_b = 0: nothing; nk_b = 0: its rows get o = 0 and
    lse = -inf, or the sink). Returns ``o (Tq, H, d)`` contiguous in q's
    dtype and ``lse (H, Tq)`` float32, natural log. ``config``: as
    :func:`forward`'s.

    ``variants``: :func:`forward`'s, per sequence: ``alibi_slopes`` float32
    ``(B, H)``, ``sinks`` ``(H,)``, ``window_size``, ``softcap``,
    ``dropout_p`` with ``dropout_seed=(seed, offset)``, sequence b using
    the dense counters of its own ``(1, H, nq_b, nk_b)`` problem from
    ``offset + b·H·max_q·max_k``.

    Explained in: notebooks/10_serving.
    Tested in: tests/kernels/triton/test_triton_varlen_fwd.py.
    """
    TQ, H, D = q.shape
    HKV = k.shape[1]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty((H, TQ), device=q.device, dtype=torch.float32)
    if TQ == 0 or max_q == 0:         # no query row anywhere: no program
        return o, lse
    # the variants' arguments, their band clamped at the longest lengths
    extra = variant_args(max_q, max_k, lse, causal=causal, **variants)
    SPEC.launch(config, Q=heads_view(q), K=heads_view(k), V=heads_view(v),
                O=heads_view(o), LSE=lse, CU_Q=cu_q, CU_K=cu_k, TQ=TQ, TK=k.shape[0],
                qk_scale=kit.qk_scale(scale), H=H, GROUP=H // HKV, NQ=max_q,
                NK=max_k, D=D, CAUSAL=causal, BLOCK_D=kit.block_d(D),
                PRECISION="tf32" if allow_tf32 else "ieee", VARLEN=True,
                **extra)
    return o, lse
