"""Argument checks shared by every ladder algorithm (NumPy arrays in).

Bad input is refused here, with the argument's name, what was expected and what came, so that no
algorithm fails deep inside NumPy with an unrelated message. Each ladder function validates in one
call at its top (:func:`check_attention` for the attention algorithms), so its displayed source
stays the algorithm. The flag, scale, block-size and split-count checks are the torch API's too: one
definition each, in :mod:`flashlib.validation` (same rules, same messages). The causal mask is
:mod:`flashlib.ladder.masks`. Explained in: notebooks/01_naive_attention.
"""
from __future__ import annotations

import numbers

import numpy as np

from ..validation import check_block, check_count, check_flag, check_num_splits, check_scale

__all__ = ["as_array", "check_qkv", "check_attention", "check_like", "check_scale", "check_block",
           "check_flag", "check_num_splits", "check_blocks", "check_count", "check_io", "check_real",
           "check_states", "check_rows", "check_floating", "out_dtype", "acc_dtype"]


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


def check_attention(q, k, v, causal, scale, io):
    """What every ladder attention function takes: :func:`check_qkv`, ``causal`` a bool
    (:func:`~flashlib.validation.check_flag`), ``scale`` (``d ** -0.5`` when None) and ``io``.
    Returns ``(q, k, v, causal, scale, io)``."""
    q, k, v = check_qkv(q, k, v)
    return q, k, v, check_flag(causal, "causal"), check_scale(scale, q.shape[-1]), check_io(io)


def check_like(x, name: str, shape) -> np.ndarray:
    """``x`` as a float array of exactly ``shape`` (used for o, do and lse in the backward)."""
    x = as_array(x, name) if len(shape) >= 2 else _floating(np.asarray(x), name)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    return x


def check_io(io):
    """An :class:`~flashlib.ladder.iomodel.IOCounter`, or a fresh one that nobody reads when None."""
    from .iomodel import IOCounter
    if io is None:
        return IOCounter()
    if not isinstance(io, IOCounter):
        raise TypeError(f"io must be a flashlib.ladder.iomodel.IOCounter or None, got {type(io).__name__}")
    return io


def check_blocks(**sizes) -> tuple[int, ...]:
    """Each keyword argument a positive int (:func:`~flashlib.validation.check_block`), in order."""
    return tuple(check_block(value, name) for name, value in sizes.items())


def _floating(x: np.ndarray, name: str) -> np.ndarray:
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"{name} must be floating-point (float16, float32 or float64), got "
                        f"dtype {x.dtype}")
    return x


def check_floating(x, name: str) -> np.ndarray:
    """``x`` (an array, list or number) as a floating-point NumPy array, or a TypeError naming it."""
    return _floating(_real(x, name), name)


def _real(x, name: str) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        raise TypeError(f"{name} must be a NumPy array or a real number, got a torch tensor — "
                        f"pass {name}.numpy()")
    given, x = x, np.asarray(x)
    if x.dtype == bool or not (np.issubdtype(x.dtype, np.floating)
                               or np.issubdtype(x.dtype, np.integer)):
        raise TypeError(f"{name} must be a real number or array (integer or floating), got "
                        f"{type(given).__name__ if x.dtype == object else 'dtype ' + str(x.dtype)}")
    return x


def check_real(**arrays) -> tuple[np.ndarray, ...]:
    """Each keyword argument as a real NumPy array (scalars and lists too; bool, complex and
    non-numbers refused), all broadcastable together; returned in order."""
    fast = (np.ndarray, np.floating)                # already float: no conversion (called per tile)
    out = tuple(x if isinstance(x, fast) and x.dtype.kind == "f" else _real(x, name)
                for name, x in arrays.items())
    try:
        if len({x.shape for x in out}) > 1:
            np.broadcast_shapes(*(x.shape for x in out))
    except ValueError:
        shapes = ", ".join(f"{name} {x.shape}" for name, x in zip(arrays, out))
        names = ", ".join(arrays)
        raise ValueError(f"{names} must have broadcastable shapes, got {shapes}") from None
    return out


def check_states(**states) -> tuple[np.ndarray, ...]:
    """Softmax states ``(m, l)``: :func:`check_real`, and every argument named ``l...`` (a sum of
    exponentials) must be >= 0 (NaN passes: it propagates as NaN)."""
    out = check_real(**states)
    for name, x in zip(states, out):
        if name.startswith("l") and (x < 0).any():
            raise ValueError(f"{name} must be >= 0 (a sum of exponentials), got a minimum of "
                             f"{x.min()}")
    return out


def check_rows(x, name: str = "x", axis=-1) -> np.ndarray:
    """``x`` as a floating NumPy array with a non-empty ``axis`` (an int), for the softmaxes."""
    x = check_floating(x, name)
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -x.ndim <= axis < x.ndim or x.shape[axis] == 0:
        where = "last axis" if axis == -1 else f"axis {axis}"
        raise ValueError(f"{name} must have a non-empty {where}, got shape {x.shape}")
    return x


def acc_dtype(*arrays) -> np.dtype:
    """Accumulation dtype: float64 stays float64, everything else accumulates in float32."""
    return np.result_type(*arrays, np.float32)


def out_dtype(*arrays) -> np.dtype:
    """Output dtype: the inputs' common floating dtype."""
    return np.result_type(*arrays)
