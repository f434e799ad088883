"""The causal mask, as every ladder algorithm (and the float64 oracle) applies it.

Bottom-right alignment (flash-attn >= 2.1): query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``; when
``Nq > Nk`` the first ``Nq - Nk`` queries see no key at all. The tiled algorithms skip a whole tile
of keys when :func:`block_hidden` says every one of them is in the queries' future.

Explained in: notebooks/01_naive_attention (the mask) and notebooks/03_flashattention1 (skipped tiles).
"""
from __future__ import annotations

import numpy as np

__all__ = ["causal_mask", "block_hidden"]


def causal_mask(q0: int, q1: int, k0: int, k1: int, nq: int, nk: int) -> np.ndarray:
    """Boolean ``(q1 - q0, k1 - k0)``: True where query i (of ``nq``) may see key j (of ``nk``).

    Bottom-right alignment (flash-attn >= 2.1): query i sees key j iff ``j <= i + nk - nq``.
    Explained in: notebooks/01_naive_attention.
    Tested in: tests/ladder/test_masks.py.
    """
    i = np.arange(q0, q1)[:, None]
    j = np.arange(k0, k1)[None, :]
    return j <= i + (nk - nq)


def block_hidden(q0: int, q1: int, k0: int, nq: int, nk: int) -> bool:
    """True when the causal mask hides every key of a block starting at ``k0`` from queries [q0, q1).

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/ladder/test_masks.py.
    """
    return k0 > (q1 - 1) + (nk - nq)
