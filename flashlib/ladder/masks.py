"""Which keys a query sees: the causal mask, the sliding window, and the
classification of a tile of the score matrix as full, partial or empty.

Bottom-right alignment (flash-attn >= 2.1), with ``off = Nk - Nq``: query ``i``
sees key ``j`` iff every rule in force holds::

    causal:          j <= i + off
    window (L, R):   i + off - L <= j <= i + off + R   (-1: unbounded side)

so the keys a query sees are one interval, the *band* around its diagonal key
``i + off`` (:func:`key_range`); when ``Nq > Nk`` the first ``Nq - Nk``
queries of a causal mask see no key at all. A tile of queries [q0, q1) and
keys [k0, k1) is *empty* when no query in it sees any of its keys (the tiled
algorithms skip it: nothing loaded, nothing computed), *full* when every query
sees every key (no mask needed), *partial* otherwise (:func:`tile_class`).
The tiled algorithms multiply ``P V`` with :func:`masked_matmul`, so that a
key a row does not see adds nothing to it, even a NaN.

Explained in: notebooks/01_naive_attention (the mask),
notebooks/03_flashattention1 (skipped tiles) and notebooks/09_real_models
(the window and the three tile classes).
"""
from __future__ import annotations

import numpy as np

from ._checks import check_count, check_flag, check_window_size

__all__ = ["causal_mask", "block_hidden", "band_mask", "tile_class",
           "key_range"]


def key_range(i, nq: int, nk: int, causal: bool = False,
              window=(-1, -1)):
    """``(first, last)``: the keys query ``i`` (an int or an int array) of
    ``nq`` sees are ``first <= j <= last``, within ``[0, nk)``; none when
    ``first > last``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_masks.py.
    """
    left, right = check_window_size(window, "window")
    causal = check_flag(causal, "causal")
    diag = np.asarray(i) + (nk - nq)             # the query's diagonal key
    first = np.maximum(diag - left, 0) if left >= 0 else np.zeros_like(diag)
    last = np.full_like(diag, nk - 1)
    if right >= 0:
        last = np.minimum(last, diag + right)
    if causal:
        last = np.minimum(last, diag)
    return first, last


def band_mask(q0: int, q1: int, k0: int, k1: int, nq: int, nk: int,
              causal: bool = False, window=(-1, -1)) -> np.ndarray:
    """Boolean ``(q1 - q0, k1 - k0)``: True where query i (of ``nq``) sees
    key j (of ``nk``) under ``causal`` and ``window = (left, right)``.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_masks.py.
    """
    _check_window(q0=q0, q1=q1, k0=k0, k1=k1, nq=nq, nk=nk)
    first, last = key_range(np.arange(q0, q1)[:, None], nq, nk, causal,
                            window)
    j = np.arange(k0, k1)[None, :]
    return (first <= j) & (j <= last)


def tile_class(q0: int, q1: int, k0: int, k1: int, nq: int, nk: int,
               causal: bool = False, window=(-1, -1)) -> str:
    """``"empty"`` when no query of [q0, q1) sees a key of [k0, k1),
    ``"full"`` when each sees every one, else ``"partial"``.

    The band's edges grow with the query, so the first and last query decide:
    empty iff the last query's band ends before k0 or the first query's band
    starts after k1 - 1; full iff the last query's band starts at or before
    k0 and the first query's band ends at or after k1 - 1. A tile with no
    query or no key is empty.

    Explained in: notebooks/09_real_models.
    Tested in: tests/ladder/test_masks.py.
    """
    _check_window(q0=q0, q1=q1, k0=k0, k1=k1, nq=nq, nk=nk)
    if q0 == q1 or k0 == k1:
        return "empty"
    first_lo, last_lo = key_range(q0, nq, nk, causal, window)     # first row
    first_hi, last_hi = key_range(q1 - 1, nq, nk, causal, window)  # last row
    if last_hi < k0 or first_lo > k1 - 1:
        return "empty"
    if first_hi <= k0 and last_lo >= k1 - 1:
        return "full"
    return "partial"


def causal_mask(q0: int, q1: int, k0: int, k1: int, nq: int,
                nk: int) -> np.ndarray:
    """Boolean ``(q1 - q0, k1 - k0)``: True where query i (of ``nq``) may see
    key j (of ``nk``).

    Bottom-right alignment (flash-attn >= 2.1): query i sees key j iff
    ``j <= i + nk - nq``. It is ``band_mask(..., causal=True)``.
    Explained in: notebooks/01_naive_attention.
    Tested in: tests/ladder/test_masks.py.
    """
    return band_mask(q0, q1, k0, k1, nq, nk, causal=True)


def distance(q0: int, q1: int, k0: int, k1: int, nq: int,
             nk: int) -> np.ndarray:
    """``|i + nk - nq - j|`` ``(q1 - q0, k1 - k0)``: how far key j is from
    query i's diagonal key (ALiBi's bias is ``-slope`` times it). float32
    (exact below 2**24), so that it does not widen a float32 computation."""
    i = np.arange(q0, q1)[:, None] + (nk - nq)
    return np.abs(i - np.arange(k0, k1)[None, :]).astype(np.float32)


def block_hidden(q0: int, q1: int, k0: int, nq: int, nk: int) -> bool:
    """True when the causal mask hides every key of a block starting at ``k0``
    from queries [q0, q1).

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/ladder/test_masks.py.
    """
    _check_window(q0=q0, q1=q1, k0=k0, nq=nq, nk=nk)
    return k0 > (q1 - 1) + (nk - nq)


def masked_matmul(p, v, visible=None):
    """``P V`` over the keys each row sees: where ``visible`` ``(Br, Bc)`` is
    False, key j adds nothing to row i, even a NaN or inf in ``v[j]`` (the
    plain product would add ``0 * NaN = NaN``). ``visible`` None: every row
    sees every key. This is SDPA's NaN rule: a NaN behind the mask changes
    nothing (a row that does not see it gets exactly the product it would get
    without it)."""
    if visible is None or visible.all() or np.isfinite(v).all():
        return p @ v            # hidden keys have p = 0, and 0 * finite = 0
    bad = ~np.isfinite(v)       # NaN/inf values, added only where they are seen
    # terms (..., Br, Bc, dv), summed over the keys
    with np.errstate(invalid="ignore"):
        terms = p[..., None] * np.where(bad, v, 0.0)[..., None, :, :]
        seen_bad = np.where(visible[..., None], terms, 0.0).sum(axis=-2)
    return p @ np.where(bad, 0.0, v) + seen_bad


def _check_window(**bounds) -> None:
    """Queries [q0, q1) of nq and keys [k0, k1) of nk: ints with
    0 <= q0 <= q1 <= nq and 0 <= k0 <= k1 <= nk. Without k1 (a key block from
    k0 on): 0 <= q0 < q1 <= nq and k0 <= nk."""
    c = {name: check_count(x, name) for name, x in bounds.items()}
    if "k1" in c:
        ok = c["q0"] <= c["q1"] and c["k0"] <= c["k1"] <= c["nk"]
        rule = "q0 <= q1 <= nq and k0 <= k1 <= nk"
    else:
        ok = c["q0"] < c["q1"] and c["k0"] <= c["nk"]
        rule = "q0 < q1 <= nq and k0 <= nk"
    if not (ok and c["q1"] <= c["nq"]):
        got = ", ".join(f"{n}={x}" for n, x in c.items())
        raise ValueError(f"need {rule}, got " + got)
