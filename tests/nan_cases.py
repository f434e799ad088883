"""The NaN rule's cases, its expectations and its checker, shared by tests/test_nan.py (CPU: the
reference, Triton's interpreter, the CUDA emulator) and tests/gpu/test_nan_gpu.py (CUDA tensors).

The rule (issue 23; every backend, forward o and lse): a NaN in ``q[i]`` makes row i's o and lse NaN; a
NaN in ``k[j]`` at a key j that row i sees makes row i's o and lse NaN; a NaN in ``v[j]`` at a key j that
row i sees makes row i's o NaN (lse depends on q and k only); a NaN at a key row i does not see (causal
mask, past ``cache_seqlens``, memory past the end of a view) changes nothing in row i; a row that sees
no key outputs 0 with lse = -inf. "Row i's o is NaN" means some element of it is: a backend may make the
whole row NaN or only the columns that hold the NaN.

It imports no ``conftest`` (tests/gpu loads its own as ``conftest``). Cases are built on the CPU from a
seeded generator and moved to ``device``.
"""
from __future__ import annotations

import numpy as np
import torch

from flashlib.ladder.masks import causal_mask
from flashlib.testing import reference_gqa

NAN = float("nan")
TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}
PAD = 5            # rows of memory past Nk (keys) in every k, v view: all NaN, never part of the input


def seen_keys(nq, nk, causal, lengths=None, batch=1):
    """(B, Nq, Nk) bool: query i of sequence b sees key j (bottom-right causal; j < lengths[b])."""
    seen = causal_mask(0, nq, 0, nk, nq, nk) if causal else np.ones((nq, nk), dtype=bool)
    seen = np.broadcast_to(seen, (batch, nq, nk)).copy()
    if lengths is not None:
        for b, n in enumerate(lengths):
            seen[b, :, n:] = False
    return seen


def rule_rows(q, k, v, seen):
    """The rule, written out: ``(o_nan, lse_nan, empty)``, each (B, H, Nq) bool. ``seen`` (B, Nq, Nk)."""
    q, k, v = (x.detach().float().cpu().numpy() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    nan_q = np.isnan(q).any(-1)                                           # (B, H, Nq)
    nan_k = np.repeat(np.isnan(k).any(-1), group, axis=1)[:, :, None, :]  # (B, H, 1, Nk)
    nan_v = np.repeat(np.isnan(v).any(-1), group, axis=1)[:, :, None, :]
    s = seen[:, None]                                                     # (B, 1, Nq, Nk)
    empty = np.broadcast_to(~s.any(-1), nan_q.shape)
    lse_nan = ~empty & (nan_q | (s & nan_k).any(-1))
    return lse_nan | (~empty & (s & nan_v).any(-1)), lse_nan, empty


def assert_rule(o, lse, q, k, v, seen, o_ref, lse_ref, what):
    """``o``, ``lse`` follow the rule (NaN exactly where it says, 0 and -inf for empty rows) and match
    the oracle's ``o_ref``, ``lse_ref`` on every row the rule leaves finite."""
    o_nan, lse_nan, empty = rule_rows(q, k, v, seen)
    o64, lse64 = o.detach().double().cpu().numpy(), lse.detach().double().cpu().numpy()
    got_o, got_lse = np.isnan(o64).any(-1), np.isnan(lse64)
    for name, got, want in (("o", got_o, o_nan), ("lse", got_lse, lse_nan)):
        wrong = np.argwhere(got != want)
        assert wrong.size == 0, (f"{what}: {name} of (b, h, i) = {tuple(wrong[0])} is "
                                 f"{'NaN' if got[tuple(wrong[0])] else 'not NaN'}; the rule says "
                                 f"{'NaN' if want[tuple(wrong[0])] else 'finite'} ({len(wrong)} rows wrong)")
    assert (o64[empty] == 0).all() and (lse64[empty] == -np.inf).all(), f"{what}: a row that sees no key"
    # the oracle follows the rule too (its own NaN pattern), and the finite rows agree with it
    assert (np.isnan(o_ref).any(-1) == o_nan).all() and (np.isnan(lse_ref) == lse_nan).all(), what
    tol = TOL[o.dtype]
    ok = ~o_nan & ~empty
    np.testing.assert_allclose(o64[ok], o_ref[ok], atol=tol, rtol=tol, err_msg=f"{what}: o")
    ok = ~lse_nan & ~empty
    np.testing.assert_allclose(lse64[ok], lse_ref[ok], atol=tol, rtol=tol, err_msg=f"{what}: lse")


def padded(x, pad=PAD):
    """A view of ``x`` whose storage holds ``pad`` more rows past its last one, all NaN."""
    full = torch.full((*x.shape[:2], x.shape[2] + pad, x.shape[3]), NAN, dtype=x.dtype, device=x.device)
    full[:, :, :x.shape[2]] = x
    return full[:, :, :x.shape[2]]


def attention_case(nq, nk, causal, dtype, d=16, seed=0, device="cpu"):
    """q (5, 2, Nq, d), k, v (5, 1, Nk, d) (GQA 2:1), views with NaN rows past Nk, and one NaN
    placement per batch entry: 0 q (head 1, a middle row); 1 k at key j; 2 v at key j; 3 k and v at
    the last key; 4 v at key j + 1 (the other parity: fragments hold keys in pairs). Causal, key j is
    hidden from the rows above the middle one and seen from it on."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(5, h, n, d, generator=g).to(dtype) for h, n in ((2, nq), (1, nk), (1, nk)))
    offset = nk - nq
    j = min(max(offset + nq // 2, 0), nk - 2) if causal else nk // 2
    q[0, 1, nq // 2, 3] = NAN
    k[1, 0, j, 5] = NAN
    v[2, 0, j, 7] = NAN
    k[3, 0, nk - 1, 0] = NAN
    v[3, 0, nk - 1, d - 1] = NAN
    v[4, 0, j + 1, 2] = NAN
    return q.to(device), padded(k.to(device)), padded(v.to(device))


LENGTHS = [40, 23, 0, 9]


def decode_case(dtype, nq, d=16, lengths=LENGTHS, nmax=40, seed=1, device="cpu"):
    """q (4, 4, Nq, d), caches (4, 2, Nmax, d) (GQA 2:1), ragged ``lengths`` (L0 = Nmax, L1, 0, L3; the
    default LENGTHS), and per sequence: 0 q NaN in head 1; 1 k NaN at key L1 // 2 of kv head 0, and NaN
    past L1 in both caches of kv head 1; 2 (no key) q NaN in head 0, and every cache entry NaN; 3 v NaN
    at its last key (L3 - 1) of kv head 1, and NaN in both caches past L3."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(4, 4, nq, d, generator=g).to(dtype)
    k, v = (torch.randn(4, 2, nmax, d, generator=g).to(dtype) for _ in range(2))
    _, l1, _, l3 = lengths
    q[0, 1, nq - 1, 4] = NAN
    k[1, 0, l1 // 2, 3] = NAN
    k[1, 1, l1:] = NAN
    v[1, 1, l1:] = NAN
    q[2, 0, 0, 0] = NAN
    k[2] = NAN
    v[2] = NAN
    v[3, 1, l3 - 1, 5] = NAN
    k[3, :, l3:] = NAN
    v[3, :, l3:] = NAN
    return q.to(device), k.to(device), v.to(device)


def decode_oracle(q, k, v, lengths):
    """Per sequence, the oracle on its valid keys; o = 0 and lse = -inf where there are none."""
    B, H, nq, d = q.shape
    o, lse = np.zeros((B, H, nq, d)), np.full((B, H, nq), -np.inf)
    for b, n in enumerate(lengths):
        if n:
            o[b], lse[b] = (x[0] for x in reference_gqa(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n]))
    return o, lse
