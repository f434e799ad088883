"""The "reference" backend: the ladder's NumPy algorithms on a CPU copy — any device, any float dtype.

:func:`flashlib.ladder.fa2.forward` / :func:`~flashlib.ladder.fa2.backward` for attention and
:func:`flashlib.ladder.decoding.forward` for decode, GQA expanded on the CPU (and its gradients summed
back per group). Slow, and the slowness is the point: it is the readable algorithm of chapters 4–6
behind the same interface as the kernels.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import numpy as np

DESCRIPTION = "the ladder's NumPy fa2/decoding on a CPU copy (slow; any device)"
KERNELS: dict = {}      # one algorithm per role: no versions to choose (kernel= must be None)
VARIANTS = {"attention": frozenset({"window_size", "softcap", "alibi_slopes", "sinks", "dropout_p"}),
            "decode": frozenset({"window_size", "softcap", "alibi_slopes", "sinks", "block_table"})}
VARIANTS["varlen"] = VARIANTS["attention"]            # packed batches take every attention variant


def _to_numpy(x) -> np.ndarray:
    """A CPU NumPy copy; float16/bfloat16 go to float32 (NumPy has no bfloat16; the ladder
    accumulates half precision in float32 anyway)."""
    import torch
    return x.detach().to(device="cpu", dtype=torch.promote_types(x.dtype, torch.float32)).numpy()


def _to_torch(a: np.ndarray, like, dtype=None):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=like.device, dtype=dtype or like.dtype)


def _lse_to_torch(lse: np.ndarray, q):
    import torch
    return _to_torch(lse, q, torch.promote_types(q.dtype, torch.float32))   # float32; float64 stays


def _ladder_variants(variants, lead=None):
    """The variants as the ladder takes them: NumPy slopes and sinks broadcast over the ladder's
    leading dims (B, H) (``lead`` = b: one sequence's (H,))."""
    out = dict(variants)
    for name in ("alibi_slopes", "sinks"):
        if name in out:
            x = _to_numpy(out[name])                   # alibi (B, H); sinks (H,)
            if name == "alibi_slopes" and lead is not None:
                x = x[lead]
            out[name] = x if (name == "alibi_slopes" or lead is not None) else x[None, :]
    return out


def forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None), kernel=None, **variants):
    """Backend.forward: the ladder's :func:`flashlib.ladder.fa2.forward` on a CPU copy, GQA expanded,
    with the attention variants (:func:`flashlib.validation.check_variants`).
    Explained in: notebooks/07_triton."""
    from ..ladder import fa2
    group = q.shape[1] // k.shape[1]
    kk = np.repeat(_to_numpy(k), group, axis=1)        # GQA: kv head h // group, expanded on the CPU
    vv = np.repeat(_to_numpy(v), group, axis=1)
    o, lse = fa2.forward(_to_numpy(q), kk, vv, causal=causal, scale=scale, block_q=blocks[0],
                         block_k=blocks[1], **_ladder_variants(variants))
    return _to_torch(o, q), _lse_to_torch(lse, q)


def backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None), kernel=None,
             **variants):
    """Backend.backward: :func:`flashlib.ladder.fa2.backward`; dk, dv summed back per GQA group;
    with sinks, ``dsinks`` ``(H,)`` summed over the batch as a fourth gradient.
    Explained in: notebooks/07_triton."""
    from ..ladder import fa2
    B, HKV, NK, D = k.shape
    group = q.shape[1] // HKV
    kk = np.repeat(_to_numpy(k), group, axis=1)
    vv = np.repeat(_to_numpy(v), group, axis=1)
    dq, dk, dv, *dsinks = fa2.backward(_to_numpy(q), kk, vv, _to_numpy(o), _to_numpy(lse), _to_numpy(do),
                                       causal=causal, scale=scale, block_q=blocks[0], block_k=blocks[1],
                                       **_ladder_variants(variants))
    dk = dk.reshape(B, HKV, group, NK, D).sum(axis=2)  # sum each group's gradients back onto its kv head
    dv = dv.reshape(B, HKV, group, NK, v.shape[-1]).sum(axis=2)
    grads = (_to_torch(dq, q), _to_torch(dk, k), _to_torch(dv, v))
    if dsinks:                                         # (B, H) -> (H,): one sink per head
        grads += (_to_torch(dsinks[0].sum(axis=0), q, _lse_to_torch(lse, q).dtype),)
    return grads


def _numpy_variants(variants):
    """The variants with NumPy slopes ``(B, H)`` and sinks ``(H,)``, as :mod:`flashlib.ladder.serving`
    takes them (it picks each sequence's row itself)."""
    return {name: _to_numpy(x) if name in ("alibi_slopes", "sinks") else x for name, x in variants.items()}


def _cu(cu):
    """An int32 tensor (cu_seqlens, a block table) as a CPU int64 NumPy array."""
    import torch
    return cu.detach().to("cpu", torch.int64).numpy()


def forward_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal, scale, allow_tf32=False, **variants):
    """Backend.forward_varlen: :func:`flashlib.ladder.serving.varlen_forward` on a CPU copy (one
    :func:`flashlib.ladder.fa2.forward` per sequence, GQA expanded): ``o (total_q, H, d)``,
    ``lse (H, total_q)``.
    Explained in: notebooks/10_serving."""
    from ..ladder import serving
    o, lse = serving.varlen_forward(_to_numpy(q), _to_numpy(k), _to_numpy(v), _cu(cu_q), _cu(cu_k),
                                    int(max_q), int(max_k), causal=causal, scale=scale,
                                    **_numpy_variants(variants))
    return _to_torch(o, q), _lse_to_torch(lse, q)


def backward_varlen(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, *, causal, scale, allow_tf32=False,
                    **variants):
    """Backend.backward_varlen: :func:`flashlib.ladder.serving.varlen_backward`; dk, dv summed back
    per GQA group; with sinks, ``dsinks`` ``(H,)`` summed over the sequences as a fourth gradient.
    Explained in: notebooks/10_serving."""
    from ..ladder import serving
    dq, dk, dv, *dsinks = serving.varlen_backward(
        _to_numpy(q), _to_numpy(k), _to_numpy(v), _to_numpy(o), _to_numpy(lse), _to_numpy(do),
        _cu(cu_q), _cu(cu_k), int(max_q), int(max_k), causal=causal, scale=scale,
        **_numpy_variants(variants))
    grads = (_to_torch(dq, q), _to_torch(dk, k), _to_torch(dv, v))
    if dsinks:
        grads += (_to_torch(dsinks[0], q, _lse_to_torch(lse, q).dtype),)
    return grads


def _gather_paged(k_cache, v_cache, cache_seqlens, block_table):
    """A paged cache as the dense ``(B, Hkv, capacity, d)`` arrays and the lengths to attend (clamped
    into ``[0, capacity]``; page indices clamped into ``[0, num_pages - 1]``, as the kernels do):
    each sequence's first ``len_b`` tokens gathered through its block-table row."""
    from ..ladder import serving
    kn, vn = _to_numpy(k_cache), _to_numpy(v_cache)       # (num_pages, page_size, Hkv, d)
    table = _cu(block_table)                               # (B, max_pages)
    B, capacity = table.shape[0], table.shape[1] * kn.shape[1]
    if cache_seqlens is None:
        lens = [capacity] * B
    else:
        lens = cache_seqlens.detach().clamp(0, capacity).cpu().tolist()
    dense_k = np.zeros((B, kn.shape[2], capacity, kn.shape[3]), dtype=kn.dtype)
    dense_v = np.zeros((B, vn.shape[2], capacity, vn.shape[3]), dtype=vn.dtype)
    for b, n in enumerate(lens):                           # (len_b, Hkv, d) -> (Hkv, len_b, d)
        dense_k[b, :, :n] = serving.gather_pages(kn, table[b], n).swapaxes(0, 1)
        dense_v[b, :, :n] = serving.gather_pages(vn, table[b], n).swapaxes(0, 1)
    return dense_k, dense_v, lens


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale, kernel=None, block_table=None,
           **variants):
    """Backend.decode: :func:`flashlib.ladder.decoding.forward`, sequence by sequence
    (``cache_seqlens`` None: every sequence uses the whole cache), with the variants. With
    ``block_table`` the caches are paged ``(num_pages, page_size, Hkv, d)``: each sequence's tokens
    are first gathered into a dense cache (:func:`flashlib.ladder.serving.gather_pages`).
    Explained in: notebooks/07_triton and notebooks/10_serving."""
    from ..ladder import decoding
    B, H, NQ, D = q.shape
    qn = _to_numpy(q)
    if block_table is not None:                        # paged: gather, then the dense path
        kn, vn, lens = _gather_paged(k_cache, v_cache, cache_seqlens, block_table)
    else:
        kn, vn, nmax = _to_numpy(k_cache), _to_numpy(v_cache), k_cache.shape[2]
        if cache_seqlens is None:
            lens = [nmax] * B
        else:
            lens = cache_seqlens.detach().clamp(0, nmax).cpu().tolist()      # as the kernels clamp
    group = H // kn.shape[1]
    o = np.zeros(qn.shape, dtype=qn.dtype)
    lse = np.full(qn.shape[:-1], -np.inf, dtype=qn.dtype)
    for b in range(B):                                 # ragged: each sequence its own valid length
        if lens[b] == 0:
            if "sinks" in variants:                    # nothing to see but the sink: o = 0, lse = sink
                lse[b] = _to_numpy(variants["sinks"])[:, None]
            continue                                   # nothing to see: o = 0, lse = -inf
        kb = np.repeat(kn[b, :, :lens[b]], group, axis=0)
        vb = np.repeat(vn[b, :, :lens[b]], group, axis=0)
        o[b], lse[b] = decoding.forward(qn[b], kb, vb, num_splits=num_splits, scale=scale,
                                        **_ladder_variants(variants, lead=b))
    return _to_torch(o, q), _lse_to_torch(lse, q)


def check(q, op):
    """Backend.check: the reference runs everywhere (never raises).
    Explained in: notebooks/07_triton."""
    return None                                        # NumPy on a CPU copy: runs everywhere
