"""The "triton" backend: :mod:`flashlib.kernels.triton`, compiled on a GPU, Triton's interpreter on a CPU.

The kernels are imported on first use (importing flashlib imports no triton). The caller's
``(block_q, block_k)`` become a :class:`~flashlib.kernels.triton.configs.Config`; None lets the
device's table choose.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

DESCRIPTION = "flashlib.kernels.triton kernels (compiled on CUDA, Triton's interpreter on CPU)"


def _last_dim_contiguous(*xs):
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


def _config(blocks):
    """A Config from the caller's (block_q, block_k), or None to let the device's table choose."""
    if blocks == (None, None):
        return None
    from ..kernels.triton.configs import Config
    for name, b in zip(("block_q", "block_k"), blocks):
        if b is not None and (b < 16 or b & (b - 1)):
            raise ValueError(f"backend='triton' needs {name} to be a power of two >= 16 (tl.arange "
                             f"and tl.dot), got {b}")
    bq, bk = (b if b is not None else 32 for b in blocks)
    return Config(bq, bk, 4, 1)


def forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    """Backend.forward: :func:`flashlib.kernels.triton.fa2_fwd.forward`.
    Explained in: notebooks/07_triton."""
    from ..kernels.triton import fa2_fwd
    q, k, v = _last_dim_contiguous(q, k, v)
    return fa2_fwd.forward(q, k, v, causal=causal, scale=scale, allow_tf32=allow_tf32,
                           config=_config(blocks))


def backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    """Backend.backward: :func:`flashlib.kernels.triton.fa2_bwd.backward`.
    Explained in: notebooks/07_triton."""
    from ..kernels.triton import fa2_bwd
    q, k, v, o, do = _last_dim_contiguous(q, k, v, o, do)
    cfg = _config(blocks)                         # dK/dV: key block = block_k, query step = block_q
    return fa2_bwd.backward(q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32,
                            config_dkdv=cfg, config_dq=cfg)


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
    """Backend.decode: :func:`flashlib.kernels.triton.decode.decode` (split-KV, then combine).
    Explained in: notebooks/07_triton."""
    import torch

    from ..kernels.triton import decode as triton_decode
    q, k_cache, v_cache = _last_dim_contiguous(q, k_cache, v_cache)
    return triton_decode.decode(q, k_cache, v_cache, cache_seqlens.to(torch.int32).contiguous(),
                                num_splits=num_splits, scale=scale)


def check(q, op):
    """Backend.check: triton importable, in the mode q's device needs; no float64; bf16 needs sm_80+.
    Explained in: notebooks/07_triton."""
    import torch
    try:
        from ..kernels import triton as ft
    except ImportError as exc:
        raise RuntimeError(f"backend='triton' cannot run here: {exc}") from None
    ft.check_tensors(q)
    if q.dtype == torch.float64:
        raise TypeError("backend='triton' supports float16, bfloat16 and float32, got torch.float64; "
                        "use backend='reference' for float64")
    if q.device.type == "cuda":
        from ..kernels.triton.configs import check_dtype_arch, device_arch
        check_dtype_arch(str(q.dtype).removeprefix("torch."), device_arch(q.device))
