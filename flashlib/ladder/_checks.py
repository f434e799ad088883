"""Argument checks shared by every ladder algorithm (NumPy arrays in).

Bad input is refused here, with the argument's name, what was expected and what came, so that no
algorithm fails deep inside NumPy with an unrelated message. Each ladder function validates in one
call at its top (:func:`check_attention` for the attention algorithms), so its displayed source
stays the algorithm. The flag, scale, block-size and split-count checks are the torch API's too: one
definition each, in :mod:`flashlib.validation` (same rules, same messages). The causal mask is
:mod:`flashlib.ladder.masks`. Explained in: notebooks/01_naive_attention.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from ..validation import check_block, check_count, check_flag, check_num_splits, check_scale

__all__ = ["as_array", "check_qkv", "check_attention", "check_like", "check_scale", "check_block",
           "check_flag", "check_num_splits", "check_blocks", "check_count", "check_io", "check_real",
           "check_states", "check_rows", "check_floating", "out_dtype", "acc_dtype",
           "check_window_size", "check_softcap", "check_per_head", "check_dropout", "check_variants",
           "Variants"]


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


# ---- the variants real models use (flash-attn's semantics; notebooks/09_real_models) ----

class Variants(NamedTuple):
    """The checked variants of one ladder call: the band (``causal``, ``window`` ``(L, R)``),
    ``softcap`` (0: off), ``slopes`` and ``sinks`` (None, or arrays ``(..., 1, 1)`` over q's leading
    dims, in the accumulation dtype), ``dropout_p`` (0: off) and ``dropout_seed`` ``(seed, offset)``."""
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    slopes: np.ndarray | None = None
    sinks: np.ndarray | None = None
    dropout_p: float = 0.0
    dropout_seed: tuple | None = None

    @property
    def band(self) -> tuple:
        """``(causal, window)``, the masks' arguments."""
        return self.causal, self.window


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_window_size(window, name: str = "window_size") -> tuple[int, int]:
    """``(left, right)``: a pair of ints, each >= 0 or -1 (unbounded); a TypeError/ValueError
    naming ``name`` otherwise."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(map(_is_int, window))):
        raise TypeError(f"{name} must be a pair of ints (left, right), got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"{name} entries must be >= 0, or -1 for unbounded, got {tuple(window)}")
    return int(window[0]), int(window[1])


def check_softcap(softcap) -> float:
    """``softcap`` a finite real number >= 0 (0: off)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__} {softcap!r}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    return float(softcap)


def check_per_head(x, name: str, lead, dtype):
    """None, or a finite real array broadcastable to ``lead`` (q's leading dims), returned as
    ``(*lead, 1, 1)`` in ``dtype``."""
    if x is None:
        return None
    x = _real(x, name)
    try:
        x = np.broadcast_to(x, tuple(lead))
    except ValueError:
        raise ValueError(f"{name} must broadcast to q's leading dims {tuple(lead)}, got shape "
                         f"{x.shape}") from None
    if not np.isfinite(x).all():
        raise ValueError(f"{name} must be finite, got {x[~np.isfinite(x)].ravel()[:3]}")
    return x.astype(dtype)[..., None, None]


def check_dropout(dropout_p, dropout_seed):
    """``dropout_p`` a real in [0, 1); when > 0, ``dropout_seed`` a pair of ints (seed, offset) with
    0 <= seed < 2**63 and 0 <= offset < 2**62 (flashlib.ladder.dropout). Returns
    ``(dropout_p, dropout_seed or None)``."""
    from .dropout import OFFSET_LIMIT, SEED_LIMIT, check_seed
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__} {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0:
        return 0.0, None
    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed=(seed, offset), the ints that fix the "
                         "dropout mask (flashlib.ladder.dropout)")
    if not (isinstance(dropout_seed, (tuple, list)) and len(dropout_seed) == 2):
        raise TypeError(f"dropout_seed must be a pair of ints (seed, offset), got {dropout_seed!r}")
    seed, offset = dropout_seed
    return float(dropout_p), (check_seed(seed, "dropout_seed[0] (seed)", SEED_LIMIT),
                              check_seed(offset, "dropout_seed[1] (offset)", OFFSET_LIMIT))


def check_variants(q, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   sinks=None, dropout_p=0.0, dropout_seed=None, *, dtype=np.float64) -> Variants:
    """Every variant argument of a ladder call checked (an error naming the argument), as
    :class:`Variants`; ``q`` gives the leading dims the per-head arguments broadcast to."""
    lead = q.shape[:-2]
    return Variants(check_flag(causal, "causal"), check_window_size(window_size),
                    check_softcap(softcap), check_per_head(alibi_slopes, "alibi_slopes", lead, dtype),
                    check_per_head(sinks, "sinks", lead, dtype), *check_dropout(dropout_p, dropout_seed))
