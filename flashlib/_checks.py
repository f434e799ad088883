"""Argument checks shared by every ladder algorithm (NumPy arrays in).

Bad input is refused here, with the argument's name, what was expected and what came, so that no
algorithm fails deep inside NumPy with an unrelated message. The scale and block-size checks are
the torch API's too: one definition each, in :mod:`flashlib.validation`. The causal mask is
:mod:`flashlib.ladder.masks`. Explained in: notebooks/01_naive_attention.
"""
from __future__ import annotations

import numpy as np

from .validation import check_block, check_scale

__all__ = ["as_array", "check_qkv", "check_like", "check_scale", "check_block", "check_io", "out_dtype",
           "acc_dtype"]


def as_array(x, name: str) -> np.ndarray:
    """``x`` as a floating-point NumPy array of rank >= 2, or a TypeError/ValueError naming ``name``."""
    if type(x).__module__.startswith("torch"):
        raise TypeError(f"{name} must be a NumPy array (the ladder is NumPy); got a torch tensor — "
                        f"pass {name}.numpy() or use flashlib.attention for tensors")
    if not isinstance(x, np.ndarray):
        if isinstance(x, (list, tuple)):
            x = np.asarray(x)
        else:
            raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must have a real floating dtype (float16, float32 or float64), "
                        f"got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., N, d) with rank >= 2, got shape {x.shape}")
    return x


def check_qkv(q, k, v):
    """Validate ``q (..., Nq, d)``, ``k (..., Nk, d)``, ``v (..., Nk, dv)``; return the three arrays."""
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(f"q, k and v must share their leading dims, got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k must have the head dim of q ({q.shape[-1]}), got k {k.shape}")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v must have as many rows as k ({k.shape[-2]}), got v {v.shape}")
    if q.shape[-2] == 0:
        raise ValueError(f"q must hold at least one query (Nq >= 1), got q {q.shape}")
    if k.shape[-2] == 0:
        raise ValueError(f"k and v must hold at least one key (Nk >= 1), got k {k.shape}")
    if q.shape[-1] == 0:
        raise ValueError(f"q must have a head dim d >= 1, got q {q.shape}")
    return q, k, v


def check_like(x, name: str, shape) -> np.ndarray:
    """``x`` as a float array of exactly ``shape`` (used for o, do and lse in the backward)."""
    x = as_array(x, name) if len(shape) >= 2 else np.asarray(x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x


def check_io(io):
    """An :class:`~flashlib.ladder.iomodel.IOCounter`, or a fresh one that nobody reads when None."""
    from .ladder.iomodel import IOCounter
    if io is None:
        return IOCounter()
    if not isinstance(io, IOCounter):
        raise TypeError(f"io must be a flashlib.ladder.iomodel.IOCounter or None, got {type(io).__name__}")
    return io


def acc_dtype(*arrays) -> np.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return np.result_type(*arrays, np.float32)


def out_dtype(*arrays) -> np.dtype:
    """Output dtype: the inputs' common floating dtype."""
    return np.result_type(*arrays)
