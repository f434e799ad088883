"""The float64 oracle and the checker that tests and notebooks share.

``reference`` is attention written as plainly as possible, in float64, with the project's semantics:
default scale ``d ** -0.5``; causal masks bottom-right aligned (query i sees key j iff
``j <= i + Nk - Nq``); a query that sees no key outputs 0 and has ``lse = -inf``. NaN follows the rule
every flashlib backend follows: a NaN in ``q[i]``, or in ``k[j]`` / ``v[j]`` at a key j that query i sees,
makes row i's output NaN (and its lse, unless the NaN is only in v); a NaN at a key that query i does not
see (the causal mask) changes nothing in row i. (Gradients of a NaN row are not specified.)
``reference_backward`` is its analytic gradient. Every algorithm and kernel in flashlib is checked
against these two. :mod:`flashlib.testing.ring` checks ring attention, rank by rank, against
single-process attention (it imports torch, so it is not imported here).

Explained in: notebooks/01_naive_attention.
"""
from __future__ import annotations

import numpy as np

from ..ladder._checks import check_qkv, check_scale

__all__ = ["reference", "reference_backward", "reference_varlen", "random_qkv", "max_error", "assert_close",
           "reference_gqa", "plain_torch_attention", "assert_fa_rule", "assert_attention_right",
           "rounding_floor", "ROUNDING", "ADVERSARIAL_SHAPES"]

# (Nq, Nk, d): lengths that are multiples of no block, Nq != Nk both ways, N = 1, odd head dims,
# and causal cases with fully-masked rows (Nq > Nk).
ADVERSARIAL_SHAPES = [
    (1, 1, 1), (1, 37, 40), (37, 1, 59), (17, 45, 40), (45, 17, 59), (33, 33, 111),
    (70, 130, 16), (130, 70, 24), (3, 257, 8),
]


def _visible(nq: int, nk: int, causal: bool, window) -> np.ndarray:
    """Boolean ``(Nq, Nk)``: query i sees key j. Bottom-right aligned (offset ``Nk - Nq``): ``causal``
    is ``j <= i + off``; ``window = (left, right)`` (-1: unbounded) is
    ``i + off - left <= j <= i + off + right`` (flash-attn's sliding window); they combine."""
    i = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    left, right = window
    seen = np.ones((nq, nk), dtype=bool)
    if causal:
        seen &= j <= i
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    return seen


def _distance(nq: int, nk: int) -> np.ndarray:
    """``|i + Nk - Nq - j|`` ``(Nq, Nk)``: how far key j is from query i's diagonal key (ALiBi's)."""
    return np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :])


def _check_variants(q, window, softcap, alibi_slopes, sinks, dropout_p, dropout_mask):
    """The variants' arguments checked (ValueError/TypeError naming the argument); returned as
    float64 arrays broadcast over q's leading dims where they are per head."""
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window!r}")
    if any(w < -1 for w in window):
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded, got {tuple(window)}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not np.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    lead = q.shape[:-2]
    per_head = {}
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            x = np.asarray(_np64(x))
            try:
                per_head[name] = np.broadcast_to(x, lead)[..., None, None]       # (..., 1, 1)
            except ValueError:
                raise ValueError(f"{name} must broadcast to q's leading dims {lead}, got shape "
                                 f"{x.shape}") from None
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("dropout_p > 0 needs dropout_mask, the keep mask Z (..., Nq, Nk) of the call")
    return per_head.get("alibi_slopes"), per_head.get("sinks")


def _scores(q, k, causal, scale, window=(-1, -1), softcap=0.0, slopes=None):
    """The final scores ``(..., Nq, Nk)``: scaled, softcapped, ALiBi-biased,
    masked to -inf."""
    s = scale * (q @ np.swapaxes(k, -1, -2))              # (..., Nq, Nk)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    nq, nk = q.shape[-2], k.shape[-2]
    if slopes is not None:                    # -slope * |i + Nk - Nq - j|
        s = s - slopes * _distance(nq, nk)
    if causal or tuple(window) != (-1, -1):
        s = np.where(_visible(nq, nk, causal, window), s, -np.inf)
    return s


def _values(p, v, seen=None):
    """``p @ v`` under the NaN rule: a NaN in ``v[j, c]`` reaches ``o[i, c]`` only if query i sees key j
    (``seen``: None when every query sees every key), as in an unmasked product. (A plain ``p @ v``
    would spread it through the masked zeros of P too: 0 * NaN = NaN.)"""
    nan = np.isnan(v)
    if not nan.any():
        return p @ v
    nq, nk = p.shape[-2], p.shape[-1]
    seen = np.ones((nq, nk), dtype=bool) if seen is None else seen
    hit = (seen.astype(np.float64) @ nan.astype(np.float64)) > 0       # (..., Nq, dv): a seen NaN
    return np.where(hit, np.nan, p @ np.where(nan, 0.0, v))


def _softmax_rows(s, sinks=None):
    """``(P, lse)`` of the scores; a sink joins the denominator only (``lse = logaddexp(lse, sink)``)."""
    m = s.max(axis=-1, keepdims=True)                               # (..., Nq, 1)
    if sinks is not None:
        m = np.maximum(m, sinks)
    m_safe = np.where(np.isneginf(m), 0.0, m)                       # rows with no visible key; NaN stays
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sinks - m_safe)
    p = np.divide(e, l, out=np.zeros_like(e), where=l != 0)
    with np.errstate(divide="ignore"):
        lse = np.where(l == 0, -np.inf, m_safe + np.log(l))[..., 0]  # -inf where l == 0
    return p, lse


def _forward(q, k, v, causal, scale, window, softcap, alibi_slopes, sinks,
             dropout_p, dropout_mask):
    """Checked float64 inputs and ``(P, lse, P~, seen)``: P the softmax, P~
    what multiplies V (P after dropout), seen the mask (None: no mask)."""
    q, k, v = check_qkv(q, k, v)
    scale = check_scale(scale, q.shape[-1])
    slopes, sink = _check_variants(q, window, softcap, alibi_slopes, sinks,
                                   dropout_p, dropout_mask)
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = _scores(q, k, causal, scale, window, softcap, slopes)
    p, lse = _softmax_rows(s, sink)
    kept = p
    if dropout_p > 0:                             # P~ = P * Z / (1 - p)
        kept = p * np.asarray(dropout_mask, dtype=bool) / (1.0 - dropout_p)
    nq, nk = q.shape[-2], k.shape[-2]
    masked = causal or tuple(window) != (-1, -1)
    seen = _visible(nq, nk, causal, window) if masked else None
    return q, k, v, scale, p, lse, kept, seen, sink


def reference(q, k, v, *, causal=False, scale=None, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, sinks=None, dropout_p=0.0,
              dropout_mask=None):
    """Float64 attention: returns ``(o, lse)`` with ``o (..., Nq, dv)`` and
    ``lse (..., Nq)``; NaN inputs follow the module's NaN rule.

    The variants real models use, flash-attn's definitions: ``window_size``
    ``(left, right)`` (-1: unbounded), ``softcap`` (the score is
    ``softcap * tanh(score / softcap)``, before the mask), ``alibi_slopes``
    (``-slope * |i + Nk - Nq - j|`` added), ``sinks`` (one logit per head in
    the denominator only), dropout with the keep mask ``dropout_mask`` Z
    (``P * Z / (1 - dropout_p)``; lse is the undropped one's). Per-head
    arguments broadcast over q's leading dims.

    Explained in: notebooks/01_naive_attention.

    Tested in: tests/testing/test_testing_ring.py.
    """
    q, k, v, scale, p, lse, kept, seen, sink = _forward(
        q, k, v, causal, scale, window_size, softcap, alibi_slopes, sinks,
        dropout_p, dropout_mask)
    return _values(kept, v, seen), lse


def reference_backward(q, k, v, do, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_mask=None):
    """Float64 analytic gradients ``(dq, dk, dv)`` of ``sum(o * do)`` for ``o = reference(...)[0]``,
    and ``dsinks`` (shaped like q's leading dims: sum over batches yourself) as a fourth when
    ``sinks`` is given.

    Uses ``dS = P * (dP - rowsum(dO * O))`` (the softmax Jacobian); dropout scales dP by Z / (1 - p);
    softcap multiplies dS by ``1 - tanh^2``; a sink's gradient is ``-sum_i exp(sink - lse_i) D_i``.
    Rows that see no key have P = 0, so they contribute nothing and their gradients are 0, never NaN.

    Explained in: notebooks/05_backward.

    Tested in: tests/ladder/test_ladder_backward.py.
    """
    q, k, v, scale, p, lse, kept, _, sink = _forward(q, k, v, causal, scale, window_size, softcap,
                                                     alibi_slopes, sinks, dropout_p, dropout_mask)
    do = np.asarray(do, dtype=np.float64)
    o = kept @ v
    dv = np.swapaxes(kept, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    if dropout_p > 0:
        dp = dp * np.asarray(dropout_mask, dtype=bool) / (1.0 - dropout_p)
    delta = (do * o).sum(axis=-1, keepdims=True)                    # D_i (..., Nq, 1)
    ds = p * (dp - delta)
    if softcap:
        raw = scale * (q @ np.swapaxes(k, -1, -2))
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    grads = (scale * ds @ k, scale * np.swapaxes(ds, -1, -2) @ q, dv)
    if sink is None:
        return grads
    with np.errstate(invalid="ignore"):
        share = np.where(np.isneginf(lse), 0.0, np.exp(sink[..., 0] - lse))   # exp(sink - lse_i)
    return (*grads, -(share * delta[..., 0]).sum(axis=-1))


def random_qkv(nq, nk, d, *, lead=(), dv=None, dtype=np.float64, seed=0):
    """Random ``q (*lead, nq, d)``, ``k (*lead, nk, d)``, ``v (*lead, nk, dv)`` from a seeded generator.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/ladder/test_checks.py.
    """
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    q = rng.standard_normal((*lead, nq, d)).astype(dtype)
    k = rng.standard_normal((*lead, nk, d)).astype(dtype)
    v = rng.standard_normal((*lead, nk, dv)).astype(dtype)
    return q, k, v


def max_error(actual, expected) -> float:
    """Largest absolute difference, treating matching infinities as equal and NaN as infinitely wrong.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/testing/test_testing_ring.py.
    """
    a, e = _np64(actual), _np64(expected)
    if a.shape != e.shape:
        raise ValueError(f"shapes differ: actual {a.shape}, expected {e.shape}")
    if np.isnan(a).any() or np.isnan(e).any():
        return float("inf")
    same_inf = np.isinf(a) & (a == e)
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(a - e))
    return float(diff.max()) if diff.size else 0.0


def assert_close(actual, expected, *, atol=1e-10, rtol=1e-10, name="value"):
    """Assert ``|actual - expected| <= atol + rtol * |expected|`` elementwise; no NaN anywhere.

    Infinities must match exactly (``lse = -inf`` for rows that see nothing). The message gives the
    worst element and its index. Takes arrays or torch tensors (on any device, with or without grad).

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/testing/test_testing.py.
    """
    a, e = _np64(actual), _np64(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {a.shape}, expected {e.shape}")
    if np.isnan(a).any():
        raise AssertionError(f"{name}: contains NaN at {np.argwhere(np.isnan(a))[:5].tolist()}")
    inf_mismatch = (np.isinf(a) | np.isinf(e)) & (a != e)
    if inf_mismatch.any():
        idx = tuple(np.argwhere(inf_mismatch)[0])
        raise AssertionError(f"{name}: infinity mismatch at {idx}: {a[idx]} vs {e[idx]}")
    finite = np.isfinite(e)
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(a - e), 0.0)
    bound = atol + rtol * np.abs(np.where(finite, e, 0.0))
    if (err > bound).any():
        idx = tuple(np.unravel_index(np.argmax(err - bound), err.shape))
        raise AssertionError(f"{name}: max abs error {err.max():.3e} (worst at {idx}: {a[idx]!r} vs "
                             f"{e[idx]!r}; atol={atol}, rtol={rtol})")


# --------------------------------------------------------------------------------------------------
# SDPA-layout helpers for the torch-facing kernels (Triton, CUDA, the CLI self-check).
# --------------------------------------------------------------------------------------------------

def _np64(x) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def reference_gqa(q, k, v, *, causal=False, scale=None, do=None, **variants):
    """The float64 oracle for ``(B, H, N, d)`` tensors with GQA (kv head ``h // (H // Hkv)``).

    Takes torch tensors or arrays. Returns NumPy float64 ``(o, lse)``, or ``(o, lse, (dq, dk, dv))``
    when ``do`` is given (dk, dv summed over each GQA group, shaped like k and v). ``variants``:
    :func:`reference`'s (``window_size``, ``softcap``, ``alibi_slopes`` ``(H,)`` or ``(B, H)``,
    ``sinks`` ``(H,)``, ``dropout_p`` with ``dropout_mask`` ``(B, H, Nq, Nk)``), per query head;
    with ``sinks`` the gradients add ``dsinks`` ``(H,)``, summed over the batch.
    Explained in: notebooks/07_triton.

    Tested in: tests/test_api_packed_blocks.py.
    """
    q, k, v = _np64(q), _np64(k), _np64(v)
    if q.ndim != 4 or k.ndim != 4 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k must be (B, H, N, d) with H % Hkv == 0, got {q.shape} and {k.shape}")
    group = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    o, lse = reference(q, kk, vv, causal=causal, scale=scale, **variants)
    if do is None:
        return o, lse
    dq, dk, dv, *dsinks = reference_backward(q, kk, vv, _np64(do), causal=causal, scale=scale, **variants)
    b, hkv, nk = k.shape[:3]
    grads = (dq, dk.reshape(b, hkv, group, nk, -1).sum(2), dv.reshape(b, hkv, group, nk, -1).sum(2))
    return o, lse, grads + tuple(d.sum(0) for d in dsinks)


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, do=None,
                     alibi_slopes=None, dropout_masks=None, dropout_seed=None, max_seqlens=None,
                     **variants):
    """The float64 oracle for a ragged batch (:func:`flashlib.attention_varlen`'s layout): q
    ``(total_q, H, d)``, k, v ``(total_k, Hkv, d)``, sequence b = rows ``cu[b]:cu[b+1]``, each
    attended alone by :func:`reference_gqa` (masks bottom-right per sequence).

    Returns NumPy float64 ``(o (total_q, H, d), lse (H, total_q))``, or with ``do`` also
    ``(dq, dk, dv)`` shaped like q, k, v (and ``dsinks (H,)`` with sinks). A sequence with queries
    but no key outputs 0 with ``lse = -inf`` (or the sink) and gradients 0. ``alibi_slopes``:
    ``(H,)`` or ``(B, H)``; with ``dropout_p``, ``dropout_masks`` (one ``(H, nq_b, nk_b)`` keep mask
    per sequence) or ``dropout_seed=(seed, offset)``, which draws them as every backend does: sequence
    b's own dense counters from ``offset + b·H·max_q·max_k`` (``max_seqlens=(max_q, max_k)``, default
    the longest lengths); the other variants as :func:`reference`.
    Explained in: notebooks/10_serving.

    Tested in: tests/test_api_serving.py.
    """
    q, k, v = _np64(q), _np64(k), _np64(v)
    cq, ck = (np.asarray(c.tolist() if hasattr(c, "tolist") else c, dtype=np.int64)
              for c in (cu_seqlens_q, cu_seqlens_k))
    H, B = q.shape[1], len(cq) - 1
    o, lse = np.zeros(q.shape[:2] + v.shape[2:]), np.full((H, q.shape[0]), -np.inf)
    grads = [np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape), np.zeros(H)]
    sinks = variants.get("sinks")
    if dropout_masks is None and dropout_seed is not None and variants.get("dropout_p"):
        from ..ladder.dropout import keep_mask
        mq, mk = max_seqlens or (int(np.diff(cq).max()), int(np.diff(ck).max()))
        seed, offset = dropout_seed
        dropout_masks = [keep_mask(seed, offset + b * H * mq * mk, (H, cq[b + 1] - cq[b], ck[b + 1] - ck[b]),
                                   variants["dropout_p"]) for b in range(B)]
    for b in range(B):
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue                                            # no query: nothing to compute
        if ck[b + 1] == ck[b]:                                  # queries, no key: o = 0
            if sinks is not None:
                lse[:, rq] = _np64(sinks)[:, None]
            continue
        var = dict(variants)
        if alibi_slopes is not None:
            slopes = _np64(alibi_slopes)
            var["alibi_slopes"] = slopes[b] if slopes.ndim == 2 else slopes
        if dropout_masks is not None:
            var["dropout_mask"] = np.asarray(dropout_masks[b])[None]
        qb, kb, vb = (x[r].transpose(1, 0, 2)[None] for x, r in ((q, rq), (k, rk), (v, rk)))
        dob = None if do is None else _np64(do)[rq].transpose(1, 0, 2)[None]
        out = reference_gqa(qb, kb, vb, causal=causal, scale=scale, do=dob, **var)
        o[rq], lse[:, rq] = out[0][0].transpose(1, 0, 2), out[1][0]
        if do is not None:
            for g, x, r in zip(grads, out[2], (rq, rk, rk, slice(None))):
                g[r] += x[0].transpose(1, 0, 2) if x.ndim == 4 else x
    if do is None:
        return o, lse
    return o, lse, tuple(grads[:3]) + ((grads[3],) if sinks is not None else ())


def plain_torch_attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0,
                          alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_mask=None):
    """Attention written plainly in torch, in the inputs' own dtype: the baseline of FlashAttention's
    error rule (a kernel may err at most 2x — 3x for gradients — what this errs against the oracle).

    ``(B, H, Nq, d)`` / ``(B, Hkv, Nk, d)``, bottom-right causal, rows that see nothing give 0. The
    variants as :func:`reference` takes them (``alibi_slopes`` ``(H,)`` or ``(B, H)`` and ``sinks``
    ``(H,)`` per query head, ``dropout_mask`` ``(B, H, Nq, Nk)``); a ``sinks`` tensor that requires
    grad gets its gradient.
    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """
    import torch
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale                          # (B, H, Nq, Nk) in q's dtype
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = q.shape[-2], k.shape[-2]
    if alibi_slopes is not None:                                   # -slope * |i + Nk - Nq - j|
        dist = torch.as_tensor(_distance(nq, nk), device=q.device, dtype=s.dtype)
        slopes = torch.as_tensor(alibi_slopes, device=q.device).to(s.dtype)
        s = s - slopes.expand(q.shape[:2])[..., None, None] * dist
    masked = causal or tuple(window_size) != (-1, -1)
    visible = torch.as_tensor(_visible(nq, nk, causal, window_size), device=q.device)
    seen = visible.any(-1, keepdim=True)                           # (Nq, 1): rows that see a key
    # A row that sees nothing softmaxes over all its keys and is then multiplied by 0: its output
    # and its gradients are 0, never NaN (softmax of an all -inf row would poison the backward).
    if masked:
        s = s.masked_fill(~(visible | ~seen), float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:                                                          # the sink joins the softmax only
        sink = sinks.to(s.dtype).expand(q.shape[:2])[..., None, None].expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1]
    if masked:
        p = p * seen
    if dropout_p:
        p = p * torch.as_tensor(dropout_mask, device=q.device) / (1.0 - dropout_p)
    return p @ v


ROUNDING = "rounding"     # a floor of assert_fa_rule: flash-attn's own atol, see rounding_floor


def rounding_floor(expected, dtype) -> float:
    """The absolute slack flash-attn's test suite adds to its rule (``tests/test_flash_attn.py``:
    ``2 * (ref + 0.3 - 0.3 - ref).abs().max()`` with ``ref`` in the inputs' dtype): twice the rounding
    error of values of ``expected``'s magnitude in ``dtype``, each operation rounded to ``dtype``.
    It grows with the values, as rounding does: a gradient of magnitude 3 in bfloat16 carries errors
    near 2^-6 that no implementation avoids (FlashAttention-2's D = rowsum(dO * O) reads the rounded O).
    Explained in: notebooks/07_triton.

    Tested in: tests/testing/test_testing.py.
    """
    import torch
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"rounding_floor: dtype must be a torch floating dtype (e.g. torch.bfloat16), got {dtype!r}")

    def rounded(x):                                     # x (float64) rounded to dtype, back in float64
        return x.to(dtype).double()
    # Each step exact in float64, then rounded: the same on every device (a CPU kernel would round the
    # scalar 0.3 to dtype first, where CUDA keeps it in float32).
    ref = rounded(torch.as_tensor(_np64(expected)))
    return 2 * rounded(rounded(rounded(ref + 0.3) - 0.3) - ref).abs().max().item()


def assert_fa_rule(actual, baseline, expected, *, factor=2.0, floor=0.0, name="value"):
    """FlashAttention's rule: ``max|actual - expected| <= factor * max|baseline - expected| + floor``.

    ``baseline`` is a plain same-dtype implementation (:func:`plain_torch_attention`), ``expected``
    the float64 oracle; ``floor`` a number, or :data:`ROUNDING` for flash-attn's own slack
    (:func:`rounding_floor` of ``expected`` in ``actual``'s dtype). Returns ``(error, baseline_error)``.
    Explained in: notebooks/07_triton.

    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """
    if isinstance(floor, str):
        if floor != ROUNDING:
            raise ValueError(f"floor must be a number or {ROUNDING!r}, got {floor!r}")
        floor = rounding_floor(expected, actual.dtype)
    err, base = max_error(_np64(actual), expected), max_error(_np64(baseline), expected)
    if not err <= factor * base + floor:
        raise AssertionError(f"{name}: max error {err:.3e} exceeds {factor}x the plain same-dtype "
                             f"implementation's {base:.3e} (+{floor:.1e})")
    return err, base


def assert_attention_right(q, k, v, do, *, causal=False, o=None, lse=None, grads=None, floor=0.0,
                           **variants):
    """The project's accuracy standard for a torch attention result against the float64 oracle.

    ``q (B, H, Nq, d)``, ``k, v (B, Hkv, Nk, d)``, ``do`` like q, any device; ``o``, ``lse`` and
    ``grads = (dq, dk, dv)`` are what the implementation returned (None: not checked). float32: o and
    lse within 2e-5, gradients within 1e-4 (absolute and relative). float16/bfloat16: FlashAttention's
    rule — at most 2x (o) or 3x (gradients) the error of :func:`plain_torch_attention` in the same
    dtype, plus ``floor`` (for baselines that are exact, e.g. dQ = 0 at Nq = Nk = 1; :data:`ROUNDING`:
    flash-attn's own slack, per quantity) — and lse (float32
    sums of 16-bit products) within 2e-2. ``variants``: :func:`reference`'s (window_size, softcap,
    alibi_slopes, sinks, dropout_p with dropout_mask); with ``sinks``, ``grads`` may hold a fourth,
    dsinks ``(H,)``. Returns a one-line note; raises AssertionError naming the first quantity out of
    bounds. Explained in: notebooks/07_triton.

    Tested in: tests/kernels/triton/test_triton_decode_v3.py.
    """
    import torch
    o_ref, lse_ref, g_ref = reference_gqa(q, k, v, causal=causal, do=do, **variants)
    names = ("dq", "dk", "dv", "dsinks")
    if q.dtype == torch.float32:
        if o is not None:
            assert_close(o, o_ref, atol=2e-5, rtol=2e-5, name="o")
        if lse is not None:
            assert_close(lse, lse_ref, atol=2e-5, rtol=2e-5, name="lse")
        for got, want, n in zip(grads or (), g_ref, names):
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=n)
        return "fp32 within 2e-5 (grads 1e-4) of the float64 oracle"
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base_variants = dict(variants)
    if variants.get("sinks") is not None:                    # the baseline's dsinks, in q's dtype
        base_variants["sinks"] = torch.as_tensor(variants["sinks"], device=q.device).to(q.dtype)
        base_variants["sinks"].requires_grad_()
        leaves_all = leaves + [base_variants["sinks"]]
    else:
        leaves_all = leaves
    base = plain_torch_attention(*leaves, causal=causal, **base_variants)
    if o is not None:
        assert_fa_rule(o, base, o_ref, factor=2.0, floor=floor, name="o")
    if lse is not None:
        assert_close(lse, lse_ref, atol=2e-2, rtol=2e-2, name="lse")
    if grads is not None:
        for got, bg, want, n in zip(grads, torch.autograd.grad(base, leaves_all, do), g_ref, names):
            assert_fa_rule(got, bg, want, factor=3.0, floor=floor, name=n)
    return "within FlashAttention's rule (2x / 3x a plain same-dtype implementation)"
