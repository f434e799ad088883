"""Dropout's random numbers: Philox4x32-10, exactly as Triton's ``tl.rand``.

This module is flashlib's one definition of the dropout mask Z. Every layer
(this NumPy ladder, the reference backend, the Triton kernels) draws the same
bits, so that backends can be compared bit for bit on the mask, and the
backward regenerates Z instead of storing it ("recompute, don't store").

The definition. The attention probabilities of a call form a
``(B, H, Nq, Nk)`` matrix (any leading dims: their row-major flat index plays
``b * H + h``). Element ``(b, h, i, j)`` gets the 64-bit counter::

    c = offset + ((b * H + h) * Nq + i) * Nk + j

(the row-major flat index of the element, plus ``offset``), and the uniform
number ``u = tl.rand(seed, c)``:

1. Philox4x32-10 (Salmon et al. 2011): the state ``(c0, c1, c2, c3) =
   (c mod 2**32, c >> 32, 0, 0)`` and the key ``(k0, k1) = (seed mod 2**32,
   seed >> 32)`` go through ten rounds of::

       c0, c1, c2, c3 = (hi(B * c2) ^ c1 ^ k0, lo(B * c2),
                         hi(A * c0) ^ c3 ^ k1, lo(A * c0))
       k0, k1 = k0 + 0x9E3779B9, k1 + 0xBB67AE85        (mod 2**32)

   with ``A = 0xD2511F53``, ``B = 0xCD9E8D57`` and ``hi``/``lo`` the upper
   and lower 32 bits of the 64-bit product; the first word ``c0`` is kept.
2. Triton's ``uint_to_uniform_float``: ``x`` = that word read as an int32,
   ``x = ~x`` where ``x < 0``, then ``u = float32(x) * 4.6566127342e-10``
   (in float32), a number in ``[0, 1)``.

Element ``(b, h, i, j)`` is KEPT iff ``u >= p`` (probability ``1 - p``;
the comparison in float32, ``p`` rounded to float32 as a kernel receives it).
``seed`` and ``offset`` are ints (``0 <= seed < 2**63``,
``0 <= offset < 2**62``; ``flashlib.attention`` draws them, offset below
2**40, from torch's default CPU generator, so ``torch.manual_seed`` reproduces a call. In a
Triton kernel, ``tl.rand(seed, c)`` with ``c`` an int64 block gives the same
``u`` on triton 3.6 and later (tests/ladder/test_dropout.py checks it bit for
bit in Triton's interpreter); triton 3.2 and 3.3 run a 64-bit Philox for
int64 counters instead, so flashlib's kernels build the two 32-bit counter
words themselves and call ``tl.philox``
(:func:`flashlib.kernels.triton.kit.dropout_keep`), the same bits on every
Triton flashlib supports.

Explained in: notebooks/09_real_models.
"""
from __future__ import annotations

import numbers

import numpy as np

__all__ = ["philox_uniform", "keep_mask"]

# Philox4x32's round multipliers and key increments (Salmon et al. 2011)
_A, _B = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)
ROUNDS = 10
# Triton's uint_to_uniform_float: the largest scale with MAX_INT * scale < 1
_TO_UNIFORM = np.float32(4.6566127342e-10)
# The API draws offsets below 2**40 (flashlib.validation.MAX_DROPOUT_OFFSET); the ladder takes up to
# 2**62, so that a ragged batch's per-sequence offsets (offset + b·H·max_q·max_k, chapter 10) fit.
SEED_LIMIT, OFFSET_LIMIT = 2 ** 63, 2 ** 62


def _philox(seed: int, counters: np.ndarray) -> np.ndarray:
    """Philox4x32-10's first output word (uint32) for state
    ``(lo(c), hi(c), 0, 0)`` and key ``(lo(seed), hi(seed))``."""
    c0, c1 = counters & _LO, counters >> _32          # uint64 holding 32 bits
    c2 = c3 = np.zeros_like(c0)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(ROUNDS):
        prod_b, prod_a = _B * c2, _A * c0             # exact: < 2**64
        c0, c1, c2, c3 = ((prod_b >> _32) ^ c1 ^ np.uint64(k0),
                          prod_b & _LO,
                          (prod_a >> _32) ^ c3 ^ np.uint64(k1),
                          prod_a & _LO)
        k0, k1 = (k0 + _KEY_A) & 0xFFFFFFFF, (k1 + _KEY_B) & 0xFFFFFFFF
    return c0.astype(np.uint32)


def philox_uniform(seed, counters) -> np.ndarray:
    """Triton's ``tl.rand(seed, counters)`` in NumPy: float32 numbers in
    ``[0, 1)``, one per counter, bit for bit (the module docstring gives the
    definition).

    Args:
        seed: an int, ``0 <= seed < 2**63``.
        counters: non-negative integers below ``2**63`` (an array of any
            shape, or an int); taken as 64-bit.

    Returns:
        float32 array shaped like ``counters``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_dropout.py.
    """
    seed = check_seed(seed, "seed", SEED_LIMIT)
    counters = np.asarray(counters)
    if counters.dtype.kind not in "iu":
        raise TypeError("counters must be integers, got dtype "
                        f"{counters.dtype}")
    if counters.size and (counters.min() < 0
                          or int(counters.max()) >= SEED_LIMIT):
        raise ValueError("counters must be in [0, 2**63), got "
                         f"[{counters.min()}, {counters.max()}]")
    x = _philox(seed, counters.astype(np.uint64)).view(np.int32)
    x = np.where(x < 0, ~x, x)                        # int32: x < 0 -> ~x
    return x.astype(np.float32) * _TO_UNIFORM


def keep_mask(seed, offset, shape, p, *, rows=None, cols=None) -> np.ndarray:
    """Dropout's keep mask Z of a call: True where element
    ``(..., i, j)`` of the ``shape = (..., Nq, Nk)`` probabilities is kept,
    i.e. where ``u >= p`` for its counter ``offset + flat index``.

    Args:
        seed, offset: the call's ints (``0 <= seed < 2**63``,
            ``0 <= offset < 2**62``), ``dropout_seed=(seed, offset)``.
        shape: the full ``(..., Nq, Nk)`` (``(B, H, Nq, Nk)`` for the torch
            API): it fixes every element's counter.
        p: the dropout probability, in ``[0, 1)``.
        rows, cols: optional ``(start, stop)`` of queries / keys: only that
            tile of Z is drawn (a kernel's tile, same bits as the whole).

    Returns:
        bool array ``(..., rows, cols)``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_dropout.py.
    """
    seed = check_seed(seed, "seed", SEED_LIMIT)
    offset = check_seed(offset, "offset", OFFSET_LIMIT)
    shape, p = _check_shape(shape), _check_p(p)
    nq, nk = shape[-2:]
    i0, i1 = _check_range(rows, nq, "rows")
    j0, j1 = _check_range(cols, nk, "cols")
    lead = np.arange(int(np.prod(shape[:-2], dtype=np.int64)), dtype=np.uint64)
    i = np.arange(i0, i1, dtype=np.uint64)
    j = np.arange(j0, j1, dtype=np.uint64)
    # c = offset + ((lead * Nq) + i) * Nk + j   (lead, rows, cols)
    c = (np.uint64(offset) + (lead[:, None, None] * np.uint64(nq)
                              + i[:, None]) * np.uint64(nk) + j)
    u = philox_uniform(seed, c)
    # p as the float32 a kernel receives
    return (u >= np.float32(p)).reshape(*shape[:-2], i1 - i0, j1 - j0)


def check_seed(value, name: str, limit: int = SEED_LIMIT) -> int:
    """``value`` as an int in ``[0, limit)`` (not a bool), else a TypeError or
    ValueError naming ``name``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_dropout.py.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got "
                        f"{type(value).__name__} {value!r}")
    if not 0 <= value < limit:
        raise ValueError(f"{name} must be an int in [0, {limit}), "
                         f"got {value}")
    return int(value)


def _check_shape(shape) -> tuple[int, ...]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints (..., Nq, Nk), got "
                        f"{type(shape).__name__}") from None
    if len(shape) < 2 or not all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool)
            and n >= 0 for n in shape):
        raise ValueError(f"shape must be (..., Nq, Nk) of ints >= 0, "
                         f"got {shape!r}")
    total = int(np.prod(shape, dtype=object))
    if total >= SEED_LIMIT:
        raise ValueError(f"shape {shape} has more than 2**63 elements")
    return tuple(int(n) for n in shape)


def _check_p(p) -> float:
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"p must be a float in [0, 1), got "
                        f"{type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p must be in [0, 1), got {p}")
    return float(p)


def _check_range(bounds, n: int, name: str) -> tuple[int, int]:
    if bounds is None:
        return 0, n
    try:
        start, stop = bounds
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be (start, stop), got {bounds!r}") \
            from None
    start = check_seed(start, f"{name}[0]", n + 1)
    stop = check_seed(stop, f"{name}[1]", n + 1)
    if stop < start:
        raise ValueError(f"{name} must have start <= stop, got {bounds!r}")
    return start, stop
