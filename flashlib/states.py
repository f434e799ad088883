"""Attention states and their one merge (FlashInfer's "attention state" algebra).

An attention state is the pair ``(o, lse)`` that attending a query to a set of keys leaves:
``o``, the softmax-weighted average of their values, and ``lse``, the natural-log log-sum-exp of
their scores. Two states over disjoint key sets merge into the state over their union:

    lse = logaddexp(lse_a, lse_b),   o = exp(lse_a - lse) · o_a + exp(lse_b - lse) · o_b.

The merge is associative and commutative, and the empty state (``o = 0``, ``lse = -inf``: no key)
is its identity, so any split of the keys, merged in any order, gives the same attention. It is the
one operator behind chapter 2's online softmax (a state grows key by key), chapter 6's
Flash-Decoding combine (splits of the cache), chapter 12's ring step (blocks from other GPUs) and
chapter 10's cascade decoding (a shared prompt prefix attended once, merged with each sequence's
own suffix). flashlib.ladder.serving holds the NumPy form; this is the torch one, any device.

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

__all__ = ["merge_states", "merge_states_many"]


def _check_state(o, lse, o_name: str, lse_name: str, shape=None) -> None:
    import torch
    for name, t in ((o_name, o), (lse_name, lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if o.dim() < 1:
        raise ValueError(f"{o_name} must have shape (..., d), at least 1 dim, got {tuple(o.shape)}")
    if shape is not None and o.shape != shape:
        raise ValueError(f"{o_name} must have the shape of o_a {tuple(shape)}, got {tuple(o.shape)}")
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"{lse_name} must have shape {tuple(o.shape[:-1])} ({o_name}'s shape "
                         f"without d), got {tuple(lse.shape)}")
    if lse.device != o.device:
        raise ValueError(f"{lse_name} must be on the device of {o_name} ({o.device}), got {lse.device}")


def merge_states(o_a, lse_a, o_b, lse_b):
    """Merge two attention states over disjoint keys: ``(o, lse)`` over both.

    ``o_*`` ``(..., d)``, ``lse_*`` ``(...)``: o's shape without d (for
    flashlib's varlen outputs pass ``lse.T``; dense ones as they come).
    ``lse``: ``logaddexp``; ``o``: each state weighted by
    ``exp(lse_* - lse)``, in float32 (float64 stays). An empty state
    (``lse = -inf``) weighs 0; two give ``o = 0``, ``lse = -inf``, never
    NaN. Returns ``o`` in ``o_a``'s dtype, ``lse`` float32 (or float64).

    Explained in: notebooks/10_serving.
    Tested in: tests/test_states.py.
    """
    import torch
    _check_state(o_a, lse_a, "o_a", "lse_a")
    _check_state(o_b, lse_b, "o_b", "lse_b", shape=o_a.shape)
    dtype = torch.promote_types(lse_a.dtype, torch.float32)
    la, lb = lse_a.to(dtype), lse_b.to(dtype)
    lse = torch.logaddexp(la, lb)                       # (...)
    # both empty: lse = -inf, and the weights exp(-inf - 0) are 0
    safe = torch.where(torch.isneginf(lse), 0.0, lse)
    w_a = torch.exp(la - safe)[..., None]               # (..., 1)
    w_b = torch.exp(lb - safe)[..., None]
    o = w_a * o_a.to(dtype) + w_b * o_b.to(dtype)       # (..., d)
    return o.to(o_a.dtype), lse


def merge_states_many(o, lse):
    """Merge S attention states at once: ``o`` ``(S, ..., d)``, ``lse``
    ``(S, ...)``, over dim 0 — folding :func:`merge_states` over them in any
    order (Flash-Decoding's combine of S splits). Empty states weigh 0; all
    empty give ``o = 0``, ``lse = -inf``.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_states.py.
    """
    import torch
    _check_state(o, lse, "o", "lse")
    if o.dim() < 2:
        raise ValueError(f"o must have shape (S, ..., d), at least 2 dims, "
                         f"got {tuple(o.shape)}")
    dtype = torch.promote_types(lse.dtype, torch.float32)
    ls = lse.to(dtype)
    total = torch.logsumexp(ls, dim=0)                  # (...)
    safe = torch.where(torch.isneginf(total), 0.0, total)
    w = torch.exp(ls - safe)[..., None]                 # (S, ..., 1)
    return (w * o.to(dtype)).sum(dim=0).to(o.dtype), total
