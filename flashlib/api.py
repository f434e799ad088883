"""flashlib's public torch API: ``attention`` and ``decode``, with pluggable backends.

Three thin layers, as in flash-attn's interface (STYLE.md §3):

1. the private launches — a backend's ``forward`` / ``backward`` / ``decode`` callables (for Triton,
   :mod:`flashlib.kernels.triton`; for "reference", the ladder's NumPy :mod:`flashlib.ladder.fa2` and
   :mod:`flashlib.ladder.decoding` run on a CPU copy);
2. autograd (:mod:`flashlib._ops`): the custom ops ``flashlib::attention_fwd`` /
   ``flashlib::attention_bwd`` (:mod:`torch.library`, with fake implementations, so torch.compile
   needs no graph break), or a :class:`torch.autograd.Function` on torch < 2.4 — both call a
   backend's forward and backward;
3. :func:`attention` and :func:`decode`, which validate every argument and pick the backend.

Adding a backend (the seam the CUDA kernels will use): write the three callables with the signatures
of :class:`Backend`, then ``register_backend(Backend("cuda", ...))`` and, to make it the default for
CUDA tensors, ``AUTO["cuda"] = "cuda"``. Nothing else here changes. Importing this module imports
neither torch nor triton; both are imported when first used.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ._checks import check_block
from ._checks import check_scale as _check_scale

__all__ = ["attention", "attention_qkvpacked", "decode", "Backend", "BACKENDS", "AUTO", "register_backend",
           "default_num_splits", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
CPU_SPLIT_SMS = 4       # decode's split heuristic on a CPU: pretend to fill 4 "SMs" (a fixed rule)


@dataclass(frozen=True)
class Backend:
    """One way of computing attention. Tensors in, tensors out, layout ``(B, H, N, d)``.

    ``forward(q, k, v, *, causal, scale, allow_tf32, blocks) -> (o, lse)``;
    ``backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32, blocks) -> (dq, dk, dv)``
    (``blocks`` = the caller's ``(block_q, block_k)``, None for "backend's choice"; dk, dv shaped
    like k, v: GQA groups summed); ``decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale)
    -> (o, lse)``; ``check(q, op)`` raises (ValueError/RuntimeError with the reason) when this backend
    cannot run on ``q``'s device and dtype in this process, ``op`` being "attention" or "decode".
    Inputs reach a backend validated: same dtype and device, ``H % Hkv == 0``, head dim <= 256.
    """
    name: str
    forward: Callable
    backward: Callable
    decode: Callable
    check: Callable
    description: str = field(default="", compare=False)


BACKENDS: dict[str, Backend] = {}
AUTO: dict[str, str] = {"cuda": "triton", "cpu": "reference"}   # device type -> backend for "auto"


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to :data:`BACKENDS` under ``backend.name`` (replacing one of that name)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a flashlib.api.Backend, got {type(backend).__name__}")
    BACKENDS[backend.name] = backend
    return backend


# --------------------------------------------------------------------------------------------------
# The "reference" backend: the ladder's NumPy algorithms on a CPU copy, any device, any float dtype.
# --------------------------------------------------------------------------------------------------

def _to_numpy(x) -> np.ndarray:
    """A CPU NumPy copy; float16/bfloat16 go to float32 (NumPy has no bfloat16; the ladder
    accumulates half precision in float32 anyway)."""
    import torch
    dt = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    return x.detach().to(device="cpu", dtype=dt).numpy()


def _to_torch(a: np.ndarray, like, dtype=None):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=like.device, dtype=dtype or like.dtype)


def _lse_dtype(q):
    import torch
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _ref_forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    from .ladder import fa2
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(_to_numpy(k), group, axis=1)        # GQA: kv head h // group, expanded on the CPU
    vv = np.repeat(_to_numpy(v), group, axis=1)
    o, lse = fa2.forward(_to_numpy(q), kk, vv, causal=causal, scale=scale, block_q=blocks[0],
                         block_k=blocks[1])
    return _to_torch(o, q), _to_torch(lse, q, _lse_dtype(q))


def _ref_backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    from .ladder import fa2
    B, HKV, NK, D = k.shape
    group = q.shape[1] // HKV
    kk = np.repeat(_to_numpy(k), group, axis=1)
    vv = np.repeat(_to_numpy(v), group, axis=1)
    dq, dk, dv = fa2.backward(_to_numpy(q), kk, vv, _to_numpy(o), _to_numpy(lse), _to_numpy(do),
                              causal=causal, scale=scale, block_q=blocks[0], block_k=blocks[1])
    dk = dk.reshape(B, HKV, group, NK, D).sum(axis=2)  # sum each group's gradients back onto its kv head
    dv = dv.reshape(B, HKV, group, NK, v.shape[-1]).sum(axis=2)
    return _to_torch(dq, q), _to_torch(dk, k), _to_torch(dv, v)


def _ref_decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
    from .ladder import decoding
    B, H, NQ, D = q.shape
    group = H // k_cache.shape[1]
    qn, kn, vn = _to_numpy(q), _to_numpy(k_cache), _to_numpy(v_cache)
    lens = cache_seqlens.detach().cpu().tolist()
    o = np.zeros(qn.shape, dtype=qn.dtype)
    lse = np.full(qn.shape[:-1], -np.inf, dtype=qn.dtype)
    for b in range(B):                                 # ragged: each sequence its own valid length
        if lens[b] == 0:
            continue                                   # nothing to see: o = 0, lse = -inf
        kb = np.repeat(kn[b, :, :lens[b]], group, axis=0)
        vb = np.repeat(vn[b, :, :lens[b]], group, axis=0)
        o[b], lse[b] = decoding.forward(qn[b], kb, vb, num_splits=num_splits, scale=scale)
    return _to_torch(o, q), _to_torch(lse, q, _lse_dtype(q))


def _ref_check(q, op):
    return None                                        # NumPy on a CPU copy: runs everywhere


register_backend(Backend("reference", _ref_forward, _ref_backward, _ref_decode, _ref_check,
                         "the ladder's NumPy fa2/decoding on a CPU copy (slow; any device)"))


# --------------------------------------------------------------------------------------------------
# The "triton" backend: flashlib.kernels.triton, imported on first use (compiled on CUDA, interpreted on CPU).
# --------------------------------------------------------------------------------------------------

def _last_dim_contiguous(*xs):
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _triton_config(blocks):
    """A Config from the caller's (block_q, block_k), or None to let the device's table choose."""
    if blocks == (None, None):
        return None
    from .kernels.triton.configs import Config
    for name, b in zip(("block_q", "block_k"), blocks):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"backend='triton' needs {name} to be a power of two >= 16 (tl.arange "
                             f"and tl.dot), got {b}")
    bq, bk = (b if b is not None else 32 for b in blocks)
    return Config(bq, bk, 4, 1)


def _triton_forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    from .kernels.triton import fa2_fwd
    q, k, v = _last_dim_contiguous(q, k, v)
    return fa2_fwd.forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                           config=_triton_config(blocks))


def _triton_backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    from .kernels.triton import fa2_bwd
    q, k, v, o, do = _last_dim_contiguous(q, k, v, o, do)
    cfg = _triton_config(blocks)                  # dK/dV: key block = block_k, query step = block_q
    return fa2_bwd.backward(q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32,
                            config_dkdv=cfg, config_dq=cfg)


def _triton_decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
    import torch
    from .kernels.triton import decode as triton_decode
    q, k_cache, v_cache = _last_dim_contiguous(q, k_cache, v_cache)
    return triton_decode.decode(q, k_cache, v_cache, cache_seqlens.to(torch.int32).contiguous(),
                                num_splits=num_splits, scale=scale)


def _triton_check(q, op):
    import torch
    try:
        from .kernels import triton as ft
    except ImportError as exc:
        raise RuntimeError(f"backend='triton' cannot run here: {exc}") from None
    ft.check_tensors(q)
    if q.dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32, got torch.float64; "
                        "use backend='reference' for float64")
    if q.device.type == "cuda":
        from .kernels.triton.configs import check_dtype_arch, device_arch
        check_dtype_arch(str(q.dtype).removeprefix("torch."), device_arch(q.device))


register_backend(Backend("triton", _triton_forward, _triton_backward, _triton_decode, _triton_check,
                         "flashlib.kernels.triton kernels (compiled on CUDA, Triton's interpreter on CPU)"))


# --------------------------------------------------------------------------------------------------
# The "cuda" backend: flashlib/kernels/cuda/csrc's CUDA C++ kernels — NVRTC on a GPU, flashlib's emulator on a CPU.
# v1 (scalar) takes fp32, v2 (WMMA tensor cores) fp16/bf16. There is no CUDA backward kernel: the
# backward is Triton's on a GPU and the reference (NumPy FA2) on a CPU, from the same saved LSE.
# --------------------------------------------------------------------------------------------------

def _cuda_forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    from .kernels import cuda
    if blocks != (None, None):
        raise ValueError("backend='cuda' sizes its tiles from the head dim and the 48 KB of shared "
                         "memory (flashlib.kernels.cuda.launch); block_q/block_k are for 'triton' and "
                         "'reference'")
    return cuda.forward(q, k, v, causal=causal, scale=scale)


def _cuda_backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    other = BACKENDS["triton" if q.device.type == "cuda" else "reference"]
    return other.backward(q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32)


def _cuda_decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
    from .kernels import cuda
    return cuda.decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=num_splits,
                       scale=scale)


def _cuda_check(q, op):
    import importlib.util

    import torch
    from .kernels.cuda import build
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='cuda' takes float32 (kernel v1) or float16/bfloat16 (kernel v2), "
                        f"got {q.dtype}")
    if q.device.type == "cpu":
        if build.find_tool("g++") is None:
            raise RuntimeError("backend='cuda' runs CPU tensors in flashlib's CUDA emulator, which "
                               "needs g++: not found on PATH")
    elif q.device.type == "cuda":
        if importlib.util.find_spec("cupy") is None:
            raise RuntimeError("backend='cuda' compiles the kernels with NVRTC through CuPy, which is "
                               "not installed (pip install cupy-cuda12x)")
    else:
        raise ValueError(f"backend='cuda' runs on CUDA or CPU tensors, got device {q.device}")


register_backend(Backend("cuda", _cuda_forward, _cuda_backward, _cuda_decode, _cuda_check,
                         "flashlib/kernels/cuda/csrc CUDA C++ kernels (NVRTC on a GPU, the emulator on CPU)"))


# --------------------------------------------------------------------------------------------------
# Layer 2: autograd, in flashlib/_ops.py (imported on first use, so that importing flashlib needs no
# torch): with torch >= 2.4 the custom ops "flashlib::attention_fwd" / "flashlib::attention_bwd" with
# fake implementations and registered autograd (torch.compile sees one opaque op: no graph break);
# with an older torch a torch.autograd.Function. Both call these helpers; the backend travels as its
# registry name.
# --------------------------------------------------------------------------------------------------

def _blocks(block_q: int, block_k: int):
    return (block_q or None, block_k or None)      # 0 travels through the op as "not chosen"


def _fwd_impl(q, k, v, causal, scale, allow_tf32, backend, block_q=0, block_k=0):
    o, lse = BACKENDS[backend].forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                                       blocks=_blocks(block_q, block_k))
    return o.contiguous(), lse.contiguous()         # the op's promise (see its fake in _ops.py)


def _bwd_impl(q, k, v, o, lse, do, causal, scale, allow_tf32, backend, block_q=0, block_k=0):
    grads = BACKENDS[backend].backward(q, k, v, o, lse, do, causal=causal, scale=scale,
                                       allow_tf32=allow_tf32, blocks=_blocks(block_q, block_k))
    return tuple(g.contiguous() for g in grads)


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs                           # causal, scale, allow_tf32, backend, blocks
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(lse)                   # lse is an output to read, not to train


def _attention_op():
    """The differentiable forward: ``op(q, k, v, causal, scale, allow_tf32, backend) -> (o, lse)``.

    Defined in :mod:`flashlib._ops` (imported here, on first use: torch.compile imports it too)."""
    from ._ops import attention_op
    return attention_op


# --------------------------------------------------------------------------------------------------
# Layer 3: validation and the public functions.
# --------------------------------------------------------------------------------------------------

def _check_tensor(x, name: str):
    import torch
    if not isinstance(x, torch.Tensor):
        hint = (" (for NumPy arrays use the ladder, e.g. flashlib.ladder.fa2.forward)"
                if isinstance(x, np.ndarray) else "")
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}{hint}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dims (B, H, N, d), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")


def _check_same(q, others: dict):
    for name, x in others.items():
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {x.device}")


def _check_heads(q, k, v, kname: str, vname: str):
    B, H, NQ, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"{kname} must have the batch size of q ({B}), got {kname} {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"{vname} must have the shape of {kname} {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[-1] != D:
        raise ValueError(f"{kname} must have the head dim of q ({D}), got {kname} {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv < 1 or H % hkv != 0:
        raise ValueError(f"the heads of q ({H}) must be a multiple of the heads of {kname} ({hkv}) "
                         f"(GQA/MQA: query head h reads kv head h // (H // Hkv))")
    if NQ < 1:
        raise ValueError(f"q must hold at least one query (Nq >= 1), got q {tuple(q.shape)}")
    if not 1 <= D <= MAX_HEAD_DIM:
        raise ValueError(f"q's head dim must be between 1 and {MAX_HEAD_DIM}, got {D}")


def _check_flag(value, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _resolve_backend(backend, q, op: str) -> Backend:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend == "auto":
        name = AUTO.get(q.device.type, "reference")
    elif backend in BACKENDS:
        name = backend
    else:
        raise ValueError(f"backend must be one of {['auto', *sorted(BACKENDS)]}, got {backend!r}")
    chosen = BACKENDS[name]
    chosen.check(q, op)
    return chosen


def attention(q, k, v, *, causal=False, scale=None, return_lse=False, backend="auto", allow_tf32=False,
              block_q=None, block_k=None):
    """Exact attention ``softmax(scale · q kᵀ) v``, FlashAttention-2 style, differentiable.

    Args:
        q: ``(B, H, Nq, d)`` queries. float16, bfloat16, float32 (float64: backend "reference" only).
        k: ``(B, Hkv, Nk, d)`` keys, same dtype and device as q. ``H % Hkv == 0``: GQA (MQA when
            Hkv = 1) — query head ``h`` reads kv head ``h // (H // Hkv)``; K/V are never copied by
            the Triton kernels.
        v: ``(B, Hkv, Nk, d)`` values, the shape of k.
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``
            (flash-attn >= 2.1). A query that sees no key outputs 0 with ``lse = -inf``; its gradients
            are 0, never NaN.
        scale: softmax scale, default ``d ** -0.5``.
        return_lse: also return ``lse``, the natural-log log-sum-exp of the scaled (masked) scores,
            float32 ``(B, H, Nq)`` (float64 for float64 inputs). It carries no gradient.
        backend: "triton" (flashlib.kernels.triton; on CPU tensors, Triton's interpreter — no environment
            variable needed), "reference" (the ladder's NumPy flashlib.ladder.fa2 on a CPU copy: slow, any
            device), or "auto" (see :data:`AUTO`: triton for CUDA tensors, reference for CPU ones).
        allow_tf32: let fp32 matmuls use TF32 tensor cores (Triton on sm_80+). Default False: fp32
            is computed in true fp32 (``input_precision="ieee"``).
        block_q, block_k: choose the chunking yourself (query rows and keys per tile, forward and
            backward): positive ints for "reference", powers of two >= 16 for "triton"; None lets
            the backend choose (Triton: per-architecture table). "cuda" sizes its own tiles.

    Returns:
        ``o`` ``(B, H, Nq, d)`` in q's dtype, or ``(o, lse)`` if ``return_lse``. Gradients flow to
        q, k and v on every backend (dk, dv summed over each GQA group).

    Raises:
        TypeError: a non-tensor, a non-float dtype, q/k/v dtypes differ, a non-bool flag, a non-str
            backend, float64 on "triton".
        ValueError: q/k/v not 4-D, on different devices, batch or head dims disagree,
            ``H % Hkv != 0``, ``Nq`` or ``Nk`` < 1, head dim > 256, a non-finite scale, an unknown
            backend, bfloat16 on a GPU older than sm_80 (e.g. the T4).
        RuntimeError: the backend cannot run here (triton missing, or triton already imported in
            the other mode than these tensors need), with the reason.

    Explained in: notebooks/07_triton.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(x, name)
    _check_same(q, {"k": k, "v": v})
    _check_heads(q, k, v, "k", "v")
    if k.shape[2] < 1:
        raise ValueError(f"k and v must hold at least one key (Nk >= 1), got k {tuple(k.shape)}")
    causal = _check_flag(causal, "causal")
    return_lse = _check_flag(return_lse, "return_lse")
    allow_tf32 = _check_flag(allow_tf32, "allow_tf32")
    scale = _check_scale(scale, q.shape[-1])
    chosen = _resolve_backend(backend, q, "attention")
    bq = 0 if block_q is None else check_block(block_q, "block_q")
    bk = 0 if block_k is None else check_block(block_k, "block_k")
    o, lse = _attention_op()(q, k, v, causal, scale, allow_tf32, chosen.name, bq, bk)
    return (o, lse) if return_lse else o


def attention_qkvpacked(qkv, *, causal=False, scale=None, return_lse=False, backend="auto",
                        allow_tf32=False, block_q=None, block_k=None):
    """:func:`attention` on a packed ``qkv`` ``(B, N, 3, H, d)`` — the layout a fused QKV projection
    produces (flash-attn's ``flash_attn_qkvpacked_func``; flash-attention-ipu's packed entry point).

    Q, K and V are strided views of ``qkv`` (no copy on "triton"). Returns ``o`` ``(B, N, H, d)``
    (and ``lse`` ``(B, H, N)`` if ``return_lse``); gradients flow back into ``qkv``. ``block_q`` /
    ``block_k`` choose the query and key chunking as in :func:`attention`.

    Explained in: notebooks/09_models.
    """
    import torch
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (B, N, 3, H, d), got {tuple(qkv.shape)}")
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))      # (B, H, N, d) views
    out = attention(q, k, v, causal=causal, scale=scale, return_lse=return_lse, backend=backend,
                    allow_tf32=allow_tf32, block_q=block_q, block_k=block_k)
    o, lse = out if return_lse else (out, None)
    o = o.transpose(1, 2)                                              # (B, N, H, d)
    return (o, lse) if return_lse else o


def default_num_splits(q, k_cache) -> int:
    """Decode's split count when ``num_splits=None``: fill the GPU about once.

    Work items without splitting: ``B · Hkv · ceil(group · Nq / 64)`` (a decode program takes up to 64
    stacked query rows of one kv head). :func:`flashlib.ladder.decoding.choose_num_splits` then asks for
    ``ceil(SMs / items)`` splits, each keeping at least 256 keys of the cache (Nmax), at most 128.
    SMs: the CUDA device's count; on a CPU a fixed 4 (:data:`CPU_SPLIT_SMS`).
    """
    from .ladder.decoding import choose_num_splits
    B, H, NQ, _ = q.shape
    hkv, nmax = k_cache.shape[1], k_cache.shape[2]
    row_blocks = -(-(H // hkv) * NQ // 64)
    if q.device.type == "cuda":
        import torch
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    else:
        sms = CPU_SPLIT_SMS
    return choose_num_splits(B * hkv, row_blocks, max(nmax, 1), sms, block_k=256)


def decode(q, k_cache, v_cache, *, cache_seqlens=None, num_splits=None, scale=None, return_lse=False,
           backend="auto"):
    """Attention of a few new queries to a KV cache, Flash-Decoding style (split-KV, then combine).

    Args:
        q: ``(B, H, Nq, d)``, Nq small (1 when generating token by token). float16, bfloat16,
            float32 (float64: "reference" only).
        k_cache, v_cache: ``(B, Hkv, Nmax, d)``, same dtype and device as q; ``H % Hkv == 0`` (GQA).
        cache_seqlens: None (every sequence uses all Nmax entries) or an integer tensor ``(B,)``
            (int32 or int64, on q's device) of valid lengths ``0 <= cache_seqlens[b] <= Nmax``:
            sequence b attends to ``k_cache[b, :, :cache_seqlens[b]]`` (ragged batches). Every query
            sees every valid key (append the new tokens to the cache first). A sequence of length 0
            outputs 0 with ``lse = -inf``.
        num_splits: number of K/V chunks attended in parallel (int >= 1), or None for
            :func:`default_num_splits` (from the GPU's SM count; on a CPU a fixed rule).
        scale: softmax scale, default ``d ** -0.5``.
        return_lse: also return the float32 ``lse (B, H, Nq)`` (natural log).
        backend: "triton", "reference" or "auto", as for :func:`attention`.

    Returns:
        ``o`` ``(B, H, Nq, d)`` in q's dtype, or ``(o, lse)``. Inference only: not differentiable.

    Raises:
        TypeError: as :func:`attention`; cache_seqlens not an integer tensor; num_splits not an int.
        ValueError: as :func:`attention`; cache_seqlens of the wrong shape or device, or a length
            outside ``[0, Nmax]``; num_splits < 1; inputs that require grad while grad is enabled.

    Explained in: notebooks/07_triton.
    """
    import torch
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(x, name)
    _check_same(q, {"k_cache": k_cache, "v_cache": v_cache})
    _check_heads(q, k_cache, v_cache, "k_cache", "v_cache")
    B, nmax = q.shape[0], k_cache.shape[2]
    if cache_seqlens is None:
        cache_seqlens = torch.full((B,), nmax, dtype=torch.int32, device=q.device)
    else:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise TypeError(f"cache_seqlens must be a torch.Tensor of int32/int64 or None, got "
                            f"{type(cache_seqlens).__name__}")
        if cache_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cache_seqlens must have dtype int32 or int64, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (B,):
            raise ValueError(f"cache_seqlens must have shape ({B},) (one length per sequence), got "
                             f"{tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens must be on the device of q ({q.device}), got "
                             f"{cache_seqlens.device}")
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < 0 or hi > nmax:
            raise ValueError(f"cache_seqlens must lie in [0, {nmax}] (Nmax of k_cache), got values in "
                             f"[{lo}, {hi}]")
    if num_splits is None:
        num_splits = default_num_splits(q, k_cache)
    elif isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int >= 1 or None, got {type(num_splits).__name__}")
    elif num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1 or None, got {num_splits}")
    return_lse = _check_flag(return_lse, "return_lse")
    scale = _check_scale(scale, q.shape[-1])
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_cache, v_cache)):
        raise ValueError("decode is inference-only (not differentiable), but q, k_cache or v_cache "
                         "requires grad: call it under torch.no_grad(), or use flashlib.attention")
    chosen = _resolve_backend(backend, q, "decode")
    with torch.no_grad():
        o, lse = chosen.decode(q, k_cache, v_cache, cache_seqlens, num_splits=int(num_splits), scale=scale)
    return (o, lse) if return_lse else o
