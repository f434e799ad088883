# fa2_fwd_v4_tma.py — FlashAttention-2 forward in Triton through tensor descriptors (TMA on Hopper),
#   version 4 of the Triton kernels ("the TMA forward"). Version 1 (fa2_fwd_v1.py) stays the default.
# Changed from version 1: every tile moves through a tensor descriptor instead of a grid of
#   pointers.
#   Each program makes four 2-D descriptors on the device (tl.make_tensor_descriptor): Q, K, V and O
#   of its own (batch, head), shape (N, d), row stride from the tensor, block (rows, BLOCK_D). A
#   descriptor knows the tensor's bounds, so the loads need no masks: rows past N and columns past d
#   read 0 (the padding="zero" rule), and the store of O drops them. On sm_90 Triton lowers a
#   descriptor load to TMA (the Tensor Memory Accelerator: one thread asks for a whole tile, the
#   copy engine writes it into shared memory and signals an mbarrier, no address arithmetic in the
#   warps); below sm_90 Triton rewrites descriptors back into pointer loads, so the kernel runs
#   everywhere.
#   The online softmax, masks, key ranges and the epilogue are version 1's own
#   (flashlib.kernels.triton.kit), and so is the launcher: fa2_fwd_v1.forward with this file's SPEC
#   (version 1's grid, config table and shared memory; scratch=True, see Limits). So is the NaN rule
#   (kit's header): finish's l == 0 test, and in the causal MASKED stage kit.hide_nan_values (a NaN
#   value the mask hides from a row leaves that row alone).
#   The key loop is a tl.range(..., warp_specialize=WARP_SPECIALIZE), a constant of the spec: asked
#   for (SPEC_WARP_SPECIALIZED), Triton's Hopper warp-specialization pass would split the loop into
#   a producer warp group that only issues TMA copies and consumer warp groups that only run wgmma
#   and the softmax (FlashAttention-3's producer/consumer split, done by the compiler).
# Idea: Shah et al. 2024 (FlashAttention-3), section 3.1 (producer/consumer warp specialization with
#   TMA); Triton's fused-attention tutorial (its tensor-descriptor variant); Dao 2023, Algorithm 1.
# Limits: what TMA requires of the memory — fp16 or bf16 (fp32 inputs run version 1), the last dim
#   contiguous, every other stride and each (batch, head) start a multiple of 16 bytes (d a multiple
#   of 8 for contiguous tensors; d = 40, 64, 128 yes, 59 and 111 no): :func:`supported` says whether
#   a call qualifies and why not; triton >= 3.4 (:func:`descriptors_missing`). Device-side
#   descriptors need a global scratch buffer (128 bytes per descriptor per program): the spec says
#   scratch=True, and KernelSpec.launch sets Triton's allocator for this launch only, leaving the
#   caller's alone. Head dim <= 256, any B·H (flat grid), 64-bit offsets as version 1. No attention
#   variant (window, softcap, ALiBi, sinks, dropout; issue 24): :func:`supported` names the one
#   given, and version 1 runs it.
#   Warp specialization is off: triton 3.9 cannot do it for this loop (cross-compiled for sm_90,
#   with 4 warps its NVGPUWarpSpecialization pass fails on an MLIR dominance assertion; with 8 warps
#   it leaves the loop whole, one partition, no setmaxnreg), and Triton's persistent-matmul tutorial
#   says its warp specialization "only works on Blackwell right now"
#   (tests/kernels/triton/test_triton_fa2_fwd_v4_tma.py keeps both facts checked).
#   Measured on no GPU yet, so opt-in; `flashlib bench` times it beside version 1 (row
#   flashlib-tma).
# Run: flashlib.attention(q, k, v, backend="triton", kernel="v4") (or FLASHLIB_TRITON_FWD=v4 as the
#   default), or fa2_fwd_v4_tma.forward(q, k, v, causal=True, scale=d ** -0.5); on a CPU it runs in
#   Triton's interpreter, which checks the descriptors' alignment rules too.
"""FlashAttention-2 forward through tensor descriptors (TMA on sm_90); warp specialization as an experiment.

Explained in: notebooks/07c_hopper."""
from __future__ import annotations

import dataclasses

import torch

from ...validation import check_flag, check_scale, check_tensors
from . import fa2_fwd_v1, kit, triton, tl, versions
from .configs import Config

__all__ = ["forward", "supported", "descriptors_missing", "SPEC", "SPEC_WARP_SPECIALIZED"]


@triton.jit
def _attend_desc(acc, l_i, m_i, q, k_desc, v_desc, offs_m, lo, hi, NK,
                 offset, qk_scale, BLOCK_N: tl.constexpr, STAGE: tl.constexpr,
                 CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """kit.attend with descriptor loads: Algorithm 1, lines 6-10, for the key
    blocks in [lo, hi). A descriptor zero-fills keys past NK, so only the
    scores need a mask (MASKED stage), and causal, the values: V NaNs the
    mask hides must not spread (kit.hide_nan_values, as kit.attend)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N,
                            warp_specialize=WARP_SPECIALIZE):
        # line 7: K_j, V_j (BLOCK_N, BLOCK_D), one TMA copy each
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # line 8: S_ij, in base 2
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if STAGE == kit.MASKED:
            s = kit.mask_scores(s=s, offs_m=offs_m, offs_n=start_n + offs_n,
                                NK=NK, offset=offset, CAUSAL=CAUSAL)
            if CAUSAL:        # NaN rule: hidden V NaNs must not spread ...
                v, row_nan = kit.hide_nan_values(
                    v=v, offs_m=offs_m, offs_n=start_n + offs_n, offset=offset)
        m_i, l_i, acc = kit.softmax_step(
            m_i=m_i, l_i=l_i, acc=acc, s=s, v=v, PRECISION=PRECISION,
            MAY_BE_EMPTY=STAGE == kit.MASKED)
        if STAGE == kit.MASKED:
            if CAUSAL:        # ... but a NaN a row sees makes it NaN
                acc = tl.where(row_nan[:, None], float("nan"), acc)
    return acc, l_i, m_i


@triton.jit
def _fwd_tma_kernel(Q, K, V, O, LSE,
                    stride_qb, stride_qh, stride_qn,
                    stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn,
                    stride_ob, stride_oh, stride_on,
                    qk_scale, H, GROUP, NQ, NK, D,
                    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr):
    # line 3: this program's query block i, of batch b, head h
    pid_m, pid_bh = kit.unflatten(tl.program_id(0), tl.cdiv(NQ, BLOCK_M))
    h, b = kit.unflatten(pid_bh, H)
    hk = h // GROUP                   # GQA: the kv head this query head reads
    # offsets in 64 bits (kit: Offsets)
    b, h, hk = b.to(tl.int64), h.to(tl.int64), hk.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)          # (BLOCK_M,) query rows
    # One 2-D descriptor per tensor for this (batch, head): shape (N, D), so
    # rows past N and columns past D read as 0 and are never written.
    q_desc = kit.desc_2d(base=Q + b * stride_qb + h * stride_qh, N=NQ, D=D,
                         stride_n=stride_qn, ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    k_desc = kit.desc_2d(base=K + b * stride_kb + hk * stride_kh, N=NK, D=D,
                         stride_n=stride_kn, ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    v_desc = kit.desc_2d(base=V + b * stride_vb + hk * stride_vh, N=NK, D=D,
                         stride_n=stride_vn, ROWS=BLOCK_N, BLOCK_D=BLOCK_D)
    o_desc = kit.desc_2d(base=O + b * stride_ob + h * stride_oh, N=NQ, D=D,
                         stride_n=stride_on, ROWS=BLOCK_M, BLOCK_D=BLOCK_D)
    q = q_desc.load([start_m, 0])         # line 4: Q_i (BLOCK_M, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)
    # line 5: m_i = -inf, l_i = 0, O_i = 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # line 6: the key blocks every row sees (no mask), then the diagonal /
    # ragged ones (masked).
    lo_masked, hi = kit.key_range(
        start_m=start_m, NQ=NQ, NK=NK, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CAUSAL=CAUSAL)
    acc, l_i, m_i = _attend_desc(
        acc=acc, l_i=l_i, m_i=m_i, q=q, k_desc=k_desc, v_desc=v_desc,
        offs_m=offs_m, lo=0, hi=lo_masked, NK=NK, offset=NK - NQ,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.FULL, CAUSAL=CAUSAL,
        UPCAST=UPCAST, PRECISION=PRECISION, WARP_SPECIALIZE=WARP_SPECIALIZE)
    acc, l_i, m_i = _attend_desc(
        acc=acc, l_i=l_i, m_i=m_i, q=q, k_desc=k_desc, v_desc=v_desc,
        offs_m=offs_m, lo=lo_masked, hi=hi, NK=NK, offset=NK - NQ,
        qk_scale=qk_scale, BLOCK_N=BLOCK_N, STAGE=kit.MASKED, CAUSAL=CAUSAL,
        UPCAST=UPCAST, PRECISION=PRECISION, WARP_SPECIALIZE=WARP_SPECIALIZE)
    # lines 12-13: O_i, L_i (natural log)
    o, lse = kit.finish(acc, l_i, m_i)
    # line 14: rows past NQ are dropped
    o_desc.store([start_m, 0], o.to(O.dtype.element_ty))
    # line 15
    tl.store(LSE + (b * H + h) * NQ + offs_m, lse, mask=offs_m < NQ)


# Version 1's grid, config table and shared memory; this kernel, which makes tensor descriptors on the
# device (Triton's scratch allocator during the launch); the key loop as it runs by default, or
# warp-specialized (an experiment: see the header).
# (Version 1's types less its variants' pointers and scalars: this kernel takes no variant, supported
# refuses them.)
SPEC = dataclasses.replace(fa2_fwd_v1.SPEC, name="fa2_fwd_tma", fn=_fwd_tma_kernel, scratch=True,
                           types=dict(LSE="fp32", qk_scale="fp32"), constants=dict(WARP_SPECIALIZE=False))
SPEC_WARP_SPECIALIZED = dataclasses.replace(SPEC, constants=dict(WARP_SPECIALIZE=True))


def descriptors_missing(version=None) -> str | None:
    """Why this Triton has no device-side tensor descriptors (one sentence), or None: they exist from
    triton 3.4 on (``tl.make_tensor_descriptor``, with ``triton.set_allocator`` for their scratch, which
    3.3 added). ``version``: a Triton version (None: the installed one, checked for both names too).

    Explained in: notebooks/07c_hopper.
    Tested in: tests/kernels/triton/test_triton_versions.py.
    """
    v = versions.parse(version) if version is not None else versions.installed()
    missing = [n for n, m in (("tl.make_tensor_descriptor", tl), ("triton.set_allocator", triton))
               if version is None and not hasattr(m, n.split(".")[1])]
    if versions.has_tensor_descriptors(v) and not missing:
        return None
    have = "triton " + ".".join(map(str, v))
    names = ", ".join(missing) or "tl.make_tensor_descriptor"
    return (f"{have} has no device-side tensor descriptors ({names} missing; triton >= 3.4 has "
            "them): versions 1 and 2 run instead")


_NO_DESCRIPTORS = descriptors_missing()       # this process's Triton: asked once, at import


# The attention variants at their defaults (off): what supported accepts (issue 24).
_VARIANT_DEFAULTS = dict(window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
                         dropout_seed=None)


def supported(q, k, v, do=None, **variants) -> str | None:
    """None if tensor descriptors can carry these tensors (and ``do``, for the backward), else why not
    (one sentence). This Triton must have tensor descriptors (:func:`descriptors_missing`: 3.4 on).
    ``variants``: the attention variants of the call (window_size, softcap, alibi_slopes, sinks,
    dropout_p, dropout_seed); the TMA kernels run none of them, so one that is not at its default
    (off) gets a reason naming it (versions 1 and 2 run them).

    TMA's rules: fp16/bf16 here, the last dim contiguous, every other stride and every (batch, head)
    start a multiple of 16 bytes, the base 16-byte aligned; rows that do not overlap (a 2-D descriptor
    per (batch, head) needs a row stride; batch and head strides may be 0, as in an expanded K/V).

    Explained in: notebooks/07c_hopper.
    Tested in: tests/kernels/triton/test_triton_fa2_fwd_v4_tma.py and
    tests/kernels/triton/test_triton_variants_fwd.py.
    """
    for t in (q, k, v, do):                         # plain loops: the backend asks on every call
        if t is not None and not isinstance(t, torch.Tensor):
            check_tensors(q, k, v)                  # raises the TypeError naming the argument
            raise TypeError(f"do must be a torch.Tensor or None, got {type(do).__name__}")
    for name, value in variants.items():           # the attention variants: none here
        if name not in _VARIANT_DEFAULTS:
            raise TypeError(f"supported() got an unexpected keyword argument {name!r}")
        if name == "dropout_seed":                  # comes with dropout_p, which decides
            continue
        default = _VARIANT_DEFAULTS[name]
        off = value is None if default is None else (tuple(value) == default if name == "window_size"
                                                     else not value)
        if not off:
            return (f"the TMA kernels take no attention variant, and {name} is given "
                    "(versions 1 and 2 run it)")
    if _NO_DESCRIPTORS:
        return _NO_DESCRIPTORS
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the TMA kernels take float16 or bfloat16, got {q.dtype} (versions 1 and 2 run it)"
    for name, t in (("q", q), ("k", k), ("v", v), ("do", do)):
        if t is None:
            continue
        strides, shape = t.stride(), t.shape
        if strides[-1] != 1:
            return f"{name}'s last dim is not contiguous (stride {strides[-1]})"
        if shape[-2] > 1 and strides[-2] == 0:
            return f"{name}'s rows all share one memory row (row stride 0, an expanded tensor)"
        es, aligned = t.element_size(), t.data_ptr() % 16 == 0
        for st, n in zip(strides[:-1], shape[:-1]):
            aligned = aligned and (n == 1 or (st * es) % 16 == 0)
        if not aligned:
            return (f"{name}'s strides {tuple(strides)} or its start are not multiples of 16 bytes "
                    f"(TMA needs them; d = {shape[-1]}: a multiple of 8 for contiguous tensors)")
    return None


def forward(q, k, v, *, causal: bool, scale: float, config: Config | None = None,
            warp_specialize: bool = False):
    """Launch the TMA forward: ``(o, lse)`` for ``q (B, H, Nq, d)``, ``k, v (B, Hkv, Nk, d)``.

    Version 1's launcher (:func:`flashlib.kernels.triton.fa2_fwd_v1.forward`) with this file's spec;
    inputs are checked as flashlib.attention checks them (TypeError/ValueError
    naming the argument), and ValueError if :func:`supported` refuses the tensors. ``warp_specialize``: ask Triton to
    warp-specialize the key loop (an experiment: triton 3.9 cannot for this loop, see the header).

    Explained in: notebooks/07c_hopper.
    Tested in: tests/kernels/triton/test_triton_fa2_fwd_v4_tma.py.
    """
    check_tensors(q, k, v)
    check_flag(causal, "causal")
    check_flag(warp_specialize, "warp_specialize")
    scale = check_scale(scale, q.shape[-1])
    why = supported(q, k, v)
    if why is not None:
        raise ValueError(f"fa2_fwd_v4_tma.forward: {why}")
    return fa2_fwd_v1.forward(q, k, v, causal=causal, scale=scale, config=config,
                           spec=SPEC_WARP_SPECIALIZED if warp_specialize else SPEC)
