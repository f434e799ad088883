"""The causal mask, as every ladder algorithm (and the float64 oracle) applies
it.

Bottom-right alignment (flash-attn >= 2.1): query ``i`` sees key ``j`` iff
``j <= i + Nk - Nq``; when ``Nq > Nk`` the first ``Nq - Nk`` queries see no key
at all. The tiled algorithms skip a whole tile of keys when
:func:`block_hidden` says every one of them is in the queries' future, and
multiply ``P V`` with :func:`masked_matmul`, so that a key a row does not see
adds nothing to it, even a NaN.

Explained in: notebooks/01_naive_attention (the mask) and
notebooks/03_flashattention1 (skipped tiles).
"""
from __future__ import annotations

import numpy as np

from ._checks import check_count

__all__ = ["causal_mask", "block_hidden"]


def causal_mask(q0: int, q1: int, k0: int, k1: int, nq: int,
                nk: int) -> np.ndarray:
    """Boolean ``(q1 - q0, k1 - k0)``: True where query i (of ``nq``) may see
    key j (of ``nk``).

    Bottom-right alignment (flash-attn >= 2.1): query i sees key j iff
    ``j <= i + nk - nq``.
    Explained in: notebooks/01_naive_attention.
    Tested in: tests/ladder/test_masks.py.
    """
    _check_window(q0=q0, q1=q1, k0=k0, k1=k1, nq=nq, nk=nk)
    i = np.arange(q0, q1)[:, None]
    j = np.arange(k0, k1)[None, :]
    return j <= i + (nk - nq)


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
