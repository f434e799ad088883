"""flashlib's public torch API: :func:`attention`, :func:`attention_qkvpacked` and :func:`decode`.

Three thin layers, as in flash-attn's interface:

1. the backends (:mod:`flashlib.backends`): a registry of named ways to compute attention — "triton"
   (:mod:`flashlib.kernels.triton`), "cuda" (:mod:`flashlib.kernels.cuda`) and "reference" (the
   ladder's NumPy :mod:`flashlib.ladder.fa2` and :mod:`flashlib.ladder.decoding` on a CPU copy);
2. the ops (:mod:`flashlib._ops`): the custom ops ``flashlib::attention_fwd`` /
   ``flashlib::attention_bwd`` (with attention's autograd) and ``flashlib::decode`` (:mod:`torch.library`,
   with fake implementations, so torch.compile needs no graph break) that call a backend's forward,
   backward and decode;
3. this module: the public functions, which check every argument with the one validator
   (:mod:`flashlib.validation`), pick the backend (:func:`flashlib.backends.resolve`) and call it the
   cheapest way that is still correct (:func:`flashlib._ops.path`): the backend itself for eager
   inference, the autograd Function when only autograd needs a backward, the op for torch.compile.

From ``flashlib.attention`` to a Triton kernel's launch there are at most 6 flashlib frames, with or
without grad: this function, the autograd Function's forward (with grad) or ``_ops.forward_impl``
(without), the backend's forward, the kernel's launcher, :meth:`KernelSpec.launch <flashlib.kernels.triton.spec.KernelSpec.launch>` and the
launch itself (tests/test_frames.py counts them).

Importing this module imports neither torch nor triton; both are imported when first used.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

from . import backends
from .backends.variants import check_decode_kernel, check_kernel
from .validation import (MAX_HEAD_DIM, check_block, check_block_table, check_cache_seqlens, check_capacity,
                         check_cu_seqlens, check_dropout_seed, check_flag, check_max_seqlen, check_new_tokens,
                         check_num_splits, check_paged_cache, check_scale, check_tensors, check_variants,
                         check_varlen_tensors)

__all__ = ["attention", "attention_qkvpacked", "attention_varlen", "decode", "append_kv", "default_num_splits",
           "dropout_mask", "MAX_HEAD_DIM"]

CPU_SPLIT_SMS = 4       # decode's split heuristic on a CPU: pretend to fill 4 "SMs" (a fixed rule)


def attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              sinks=None, dropout_p=0.0, dropout_seed=None, return_lse=False, backend="auto",
              allow_tf32=False, block_q=None, block_k=None, kernel=None):
    """Exact attention ``softmax(scale · q kᵀ) v``, FlashAttention-2 style, differentiable.

    Args:
        q: ``(B, H, Nq, d)`` queries. float16, bfloat16, float32 (float64: backend "reference" only).
        k: ``(B, Hkv, Nk, d)`` keys, same dtype and device as q. ``H % Hkv == 0``: GQA (MQA when
            Hkv = 1) — query head ``h`` reads kv head ``h // (H // Hkv)``; K/V are never copied by
            the Triton kernels.
        v: ``(B, Hkv, Nk, d)`` values, the shape of k.
        causal: bottom-right aligned mask: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``
            (flash-attn >= 2.1). A query that sees no key outputs 0 with ``lse = -inf``; its gradients
            are 0, never NaN.

    NaN, on every backend: a NaN in query row ``i``, or in a key row ``i`` sees, makes row ``i``'s
    ``o`` and ``lse`` NaN; a NaN in a value row ``i`` sees makes its ``o`` NaN. A NaN at a key that row
    ``i`` does not see (hidden by the causal mask) changes nothing in row ``i`` (torch's SDPA has no
    one rule here: its math backend spreads it to every row). A query that sees no key still outputs
    0 and ``-inf``. Gradients of a NaN row are not specified.
        scale: softmax scale, default ``d ** -0.5``.
        window_size: ``(left, right)``, -1 for unbounded (flash-attn's sliding window): query ``i``
            sees key ``j`` iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``; combines with
            ``causal`` (which is ``right = 0``). Default ``(-1, -1)``: no window.
        softcap: ``c > 0`` caps the scores, ``c · tanh(scale · q·k / c)`` before the mask (Gemma 2
            uses 50). 0.0: off.
        alibi_slopes: None, or float32 ``(H,)`` or ``(B, H)`` on q's device, one slope per query
            head: ``-slope · |i + Nk - Nq - j|`` is added to the (capped) scaled score. No gradient.
        sinks: None, or a float32 ``(H,)`` tensor on q's device: one logit per query head that
            joins the softmax's denominator only (gpt-oss, FlashInfer):
            ``P_ij = exp(S_ij) / (sum_j exp(S_ij) + exp(sink_h))``; ``lse`` includes it. A row that
            sees no key outputs 0 with ``lse = sink_h``. Differentiable.
        dropout_p: dropout on P after the softmax, ``P · Z / (1 - p)``; ``lse`` is undropped.
            Z is Philox's (:mod:`flashlib.ladder.dropout`), the same bits on every backend;
            :func:`dropout_mask` returns it. 0.0: off (pass 0.0 in evaluation).
        dropout_seed: None (a fresh ``(seed, offset)`` from torch's default generator, so
            ``torch.manual_seed`` reproduces the call) or a pair of ints ``(seed, offset)``.
        return_lse: also return ``lse``, the natural-log log-sum-exp of the scaled (masked) scores,
            float32 ``(B, H, Nq)`` (float64 for float64 inputs). It carries no gradient.
        backend: "triton" (flashlib.kernels.triton; on CPU tensors, Triton's interpreter — no environment
            variable needed), "reference" (the ladder's NumPy flashlib.ladder.fa2 on a CPU copy: slow, any
            device), "cuda" (flashlib.kernels.cuda), or "auto" (:data:`flashlib.backends.AUTO`:
            triton for CUDA tensors, reference for CPU ones).
        allow_tf32: let fp32 matmuls use TF32 tensor cores (Triton on sm_80+). Default False: fp32
            is computed in true fp32 (``input_precision="ieee"``).
        block_q, block_k: choose the chunking yourself (query rows and keys per tile, forward and
            backward): positive ints for "reference", powers of two >= 16 for "triton"; None lets
            the backend choose (Triton: per-architecture table; one of the two may be None).
            "cuda" sizes its own tiles.
        kernel: which version of the backend's kernels runs (:mod:`flashlib.backends.variants`):
            None (the backend's default, or the environment's: ``FLASHLIB_TRITON_FWD``,
            ``FLASHLIB_TRITON_BWD``), a forward version (``"v4"``: Triton's TMA forward; ``"v2"``:
            CUDA's WMMA forward), or a pair ``(forward, backward)`` of versions or None
            (``("v4", "v5")``). A named version that cannot run the inputs is a ValueError saying
            why. ``flashlib.backends.BACKENDS[name].kernels`` lists them; "reference" has none.

    Returns:
        ``o`` ``(B, H, Nq, d)`` in q's dtype, or ``(o, lse)`` if ``return_lse``. Gradients flow to
        q, k and v on every backend (dk, dv summed over each GQA group). As with torch's SDPA, an
        empty batch (B = 0, or H = 0) gives empty outputs and gradients (zeros for a non-empty k, v)
        without running a kernel, and meta tensors give the outputs' shapes and dtypes, computing
        nothing (:mod:`flashlib._ops`).

    Raises:
        TypeError: a non-tensor, a non-float dtype, q/k/v dtypes differ, a non-bool flag, a non-str
            backend, float64 on "triton".
        ValueError: q/k/v not 4-D, on different devices, batch or head dims disagree,
            ``H % Hkv != 0``, ``Nq`` or ``Nk`` < 1, head dim > 256, a non-finite scale, an unknown
            backend, bfloat16 on a GPU older than sm_80 (e.g. the T4).
        RuntimeError: the backend cannot run here (triton missing, or triton already imported in
            the other mode than these tensors need), with the reason.

    Explained in: notebooks/07_triton.
    Tested in: tests/test_api.py.
    """
    check_tensors(q, k, v)
    causal = check_flag(causal, "causal")
    return_lse = check_flag(return_lse, "return_lse")
    allow_tf32 = check_flag(allow_tf32, "allow_tf32")
    scale = check_scale(scale, q.shape[-1])
    used = check_variants(q, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed)
    chosen = backends.resolve(backend, q, "attention", used)
    bq = None if block_q is None else check_block(block_q, "block_q")   # None: the backend chooses
    bk = None if block_k is None else check_block(block_k, "block_k")
    kf, kb = check_kernel(kernel, chosen.name, chosen.kernels)
    from . import _ops# autograd and the custom ops (imports torch on first use)
    # The cheapest way that is still correct (_ops.path): the backend itself for eager inference, the
    # autograd Function when only autograd needs a backward, the custom op for torch.compile & co.
    way = _ops.path(q, k, v, used.get("sinks"))
    run = {"backend": _ops.forward_impl, "function": _ops.Attention.apply}.get(way, _ops.attention_op)
    o, lse = run(q, k, v, causal, scale, allow_tf32, chosen.name, bq, bk, kf, kb, *_op_variants(used))
    return (o, lse) if return_lse else o


def _op_variants(used: dict) -> tuple:
    """The ops' variant arguments (window_size, softcap, alibi_slopes, sinks, dropout_p,
    dropout_seed) from :func:`~flashlib.validation.check_variants`' dict."""
    return (list(used.get("window_size", (-1, -1))), used.get("softcap", 0.0), used.get("alibi_slopes"),
            used.get("sinks"), used.get("dropout_p", 0.0), list(used.get("dropout_seed", (0, 0))))


def dropout_mask(q, k, dropout_p, dropout_seed):
    """Z, the keep mask ``attention(q, k, v, dropout_p=dropout_p, dropout_seed=dropout_seed)`` applies:
    bool ``(B, H, Nq, Nk)`` on q's device, True where P is kept (and scaled by ``1 / (1 - p)``), as
    flash-attn's ``return_attn_probs`` exposes it. Drawn from the counter-based RNG every backend
    uses (:func:`flashlib.ladder.dropout.keep_mask`: Philox4x32-10, Triton's ``tl.rand``), so no mask
    is ever stored: the backward regenerates it. To see the mask of a call that drew its own seed,
    draw it first: ``seed = flashlib.validation.draw_dropout_seed()`` and pass it to both.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_api_variants.py.
    """
    import torch
    from .ladder.dropout import keep_mask
    check_tensors(q, k, k)
    check_variants(q, dropout_p=dropout_p)
    seed, offset = check_dropout_seed(dropout_seed)
    B, H, NQ, NK = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    z = keep_mask(seed, offset, (B, H, NQ, NK), float(dropout_p))
    return torch.from_numpy(z).to(q.device)


def attention_qkvpacked(qkv, *, causal=False, scale=None,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        sinks=None, dropout_p=0.0, dropout_seed=None,
                        return_lse=False, backend="auto", allow_tf32=False,
                        block_q=None, block_k=None, kernel=None):
    """:func:`attention` on a packed ``qkv`` ``(B, N, 3, H, d)`` — the layout
    a fused QKV projection produces (flash-attn's
    ``flash_attn_qkvpacked_func``; flash-attention-ipu's packed entry point).

    Q, K and V are strided views of ``qkv`` (no copy on "triton"). Returns
    ``o`` ``(B, N, H, d)`` (and ``lse`` ``(B, H, N)`` if ``return_lse``);
    gradients flow back into ``qkv``. ``block_q`` / ``block_k`` choose the
    query and key chunking, ``kernel`` the kernel version, and the variants
    (``window_size``, ``softcap``, ``alibi_slopes``, ``sinks``,
    ``dropout_p``, ``dropout_seed``) are as in :func:`attention`.

    Explained in: notebooks/11_models.
    Tested in: tests/test_api_packed_blocks.py.
    """
    import torch
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, "
                        f"got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(f"qkv must have shape (B, N, 3, H, d), "
                         f"got {tuple(qkv.shape)}")
    # (B, H, N, d) views
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out = attention(q, k, v, causal=causal, scale=scale,
                    window_size=window_size, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks,
                    dropout_p=dropout_p, dropout_seed=dropout_seed,
                    return_lse=return_lse, backend=backend,
                    allow_tf32=allow_tf32, block_q=block_q, block_k=block_k,
                    kernel=kernel)
    o, lse = out if return_lse else (out, None)
    o = o.transpose(1, 2)                                   # (B, N, H, d)
    return (o, lse) if return_lse else o


def default_num_splits(q, k_cache) -> int:
    """Decode's split count when ``num_splits=None``: fill the GPU about once.

    ``q`` ``(B, H, Nq, d)`` and ``k_cache`` ``(B, Hkv, Nmax, d)`` are checked as :func:`decode`
    checks them (TypeError/ValueError naming the argument). Work items without splitting:
    ``B · Hkv · ceil(group · Nq / 64)`` (a decode program takes up to 64 stacked query rows of one
    kv head). :func:`flashlib.ladder.decoding.choose_num_splits` then asks for ``ceil(SMs / items)``
    splits, each keeping at least 256 keys of the cache (Nmax), at most 128; 1 when there is no work
    item (B = 0 or H = 0). SMs: the CUDA device's count; on a CPU a fixed 4 (:data:`CPU_SPLIT_SMS`),
    or the rehearsed GPU's (:func:`flashlib.hardware.rehearse`).

    Explained in: notebooks/06_flash_decoding (``choose_num_splits``, the rule it applies).
    Tested in: tests/test_api.py.
    """
    check_tensors(q, k_cache, k_cache, k_name="k_cache", v_name="k_cache")
    return _default_num_splits(q, k_cache.shape[1], k_cache.shape[2])


def _band(q, nmax: int, window_size=(-1, -1)) -> int:
    """How many cache entries a decode call can read per sequence (at most): the keys some query of a
    full cache of ``nmax`` sees (:func:`flashlib.ladder.decoding.band_keys`; with a left window L,
    the last ``L + Nq``), at least 1."""
    if tuple(window_size) == (-1, -1):
        return nmax                               # no window: the whole cache (Nmax >= 1)
    from .ladder.decoding import band_keys
    lo, hi = band_keys(q.shape[2], nmax, window=tuple(window_size))
    return max(hi - lo, 1)


def _default_num_splits(q, hkv: int, nmax: int, window_size=(-1, -1)) -> int:
    """:func:`default_num_splits` of checked tensors (decode has checked them: no second check), for
    ``hkv`` kv heads and caches of ``nmax`` tokens per sequence (a paged cache's capacity); a
    sliding window counts its band, not the cache (:func:`_band`)."""
    from .ladder.decoding import choose_num_splits
    B, H, NQ, _ = q.shape
    row_blocks = -(-(H // hkv) * NQ // 64)
    if B * hkv * row_blocks == 0:
        return 1                                         # an empty batch: nothing to split
    from .hardware import device_facts
    facts = device_facts(q.device)                       # the driver's (once per device), or a rehearsed GPU's
    sms = facts.sms if facts is not None else CPU_SPLIT_SMS
    return choose_num_splits(B * hkv, row_blocks, _band(q, nmax, window_size), sms, block_k=256)


def decode(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None, causal=False,
           num_splits=None, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
           dropout_p=0.0, return_lse=False, backend="auto", kernel=None):
    """Attention of a few new queries to a KV cache, Flash-Decoding style (split-KV, then combine),
    with the new tokens appended to the cache in place and the cache dense or paged.

    Args:
        q: ``(B, H, Nq, d)``, Nq small (1 when generating token by token; several for speculative
            decoding or chunked prefill). float16, bfloat16, float32 (float64: "reference" only).
        k_cache, v_cache: the cache, same dtype and device as q; ``H % Hkv == 0`` (GQA). Dense
            ``(B, Hkv, Nmax, d)``; with ``block_table``, paged ``(num_pages, page_size, Hkv, d)``
            (flash-attn's, any ``page_size >= 1``).
        k, v: None, or the new tokens' keys and values, ``(B, Hkv, Nnew, d)`` for a dense cache,
            ``(B, Nnew, Hkv, d)`` for a paged one. They are written into the cache IN PLACE at
            positions ``[cache_seqlens[b], cache_seqlens[b] + Nnew)`` before attending
            (:func:`append_kv`), and attention covers ``cache_seqlens[b] + Nnew`` keys. The caller
            advances ``cache_seqlens`` (as with flash-attn). Needs ``cache_seqlens``.
        cache_seqlens: None (every sequence uses the whole cache: Nmax, or a paged sequence's
            ``max_pages · page_size``; no lengths tensor is made) or an integer tensor ``(B,)``
            (int32 or int64, on q's device) of valid lengths before the append: sequence b attends to
            its first ``len_b = cache_seqlens[b] (+ Nnew)`` tokens. A sequence of length 0 outputs 0
            with ``lse = -inf``. Entries past a sequence's length are never read: a NaN there
            (uninitialised cache memory) changes nothing; a NaN in q or in a valid entry follows
            :func:`attention`'s NaN rule. On a GPU the lengths are never read back by the host (that
            would make every decode step wait for the GPU, and forbid CUDA-graph capture): the
            kernels clamp each into ``[0, capacity]`` instead of raising (in 64 bits, before any
            narrowing: a length of 2**32 + 3 is the capacity, never 3), and an append never writes
            past the capacity.
        block_table: None (dense cache) or an int32 tensor ``(B, max_pages)``: token t of sequence b
            lives in page ``block_table[b, t // page_size]``, row ``t % page_size`` (vLLM's
            PagedAttention). Pages may be shared between sequences and in any order; only the pages
            holding a sequence's first ``len_b`` tokens are read (checked in ``[0, num_pages)`` on a
            CPU; clamped on a GPU).
        causal: query i of Nq sees key j iff ``j <= i + len_b - Nq`` (bottom-right: the new tokens
            are causal among themselves, each sees the whole cache before it); it is the window
            ``(left, 0)`` (flash-attn's rule), so it combines with ``window_size``'s left bound.
        num_splits: number of K/V chunks attended in parallel (int >= 1), or None for
            :func:`default_num_splits` (from the GPU's SM count; on a CPU a fixed rule). Clamped to
            what can be non-empty: a split holds at least one key, so more than Nmax splits act as
            Nmax (as :func:`flashlib.ladder.decoding.forward` takes more splits than keys); the
            "triton" backend's splits are whole key blocks of at least 16 keys, so it runs at most
            ``ceil(Nmax / 16)``. The splits dropped would be empty and add nothing: the answer is the
            same.
        scale: softmax scale, default ``d ** -0.5``.
        window_size, softcap, alibi_slopes, sinks: as for :func:`attention`, aligned at each
            sequence's own end: query ``i`` of sequence b sits at position ``i + len_b - Nq``
            (``len_b`` its cache length), so ``window_size=(W - 1, 0)`` sees the last W keys.
        dropout_p: must be 0.0 (decode is inference; a ValueError otherwise).
        return_lse: also return the float32 ``lse (B, H, Nq)`` (natural log).
        backend: "triton", "reference", "cuda" or "auto", as for :func:`attention` ("cuda" reads
            dense caches only, and computes no variant: it refuses a block table or ``causal`` by
            name).
        kernel: the decode kernel's version (None: the backend's; each backend has one today,
            "v3" for "triton", "v1" for "cuda"), as for :func:`attention`.

    Returns:
        ``o`` ``(B, H, Nq, d)`` in q's dtype, or ``(o, lse)``. Inference only: not differentiable.
        An empty batch (B = 0, or H = 0) and meta tensors are answered as :func:`attention` answers
        them (an append still happens).

    Raises:
        TypeError: as :func:`attention`; cache_seqlens not an integer tensor; block_table not int32;
            num_splits not an int.
        ValueError: as :func:`attention`; cache_seqlens of the wrong shape or device, or (CPU
            tensors) a length outside ``[0, capacity]``, or appended tokens past the capacity;
            ``k`` without ``cache_seqlens``, or ``k`` without ``v``; a block table of the wrong shape
            or (CPU) pointing past the pages; a page size of 0; num_splits < 1; inputs that require
            grad while grad is enabled.

    Explained in: notebooks/07_triton (dense), notebooks/10_serving (paged, append, causal).
    Tested in: tests/test_api.py and tests/test_api_serving.py.
    """
    import torch
    paged = block_table is not None
    if paged:
        check_tensors(q, q, q)
        check_paged_cache(q, k_cache, v_cache)
        block_table = check_block_table(block_table, q, k_cache.shape[0])
        hkv, capacity = k_cache.shape[2], block_table.shape[1] * k_cache.shape[1]
    else:
        check_tensors(q, k_cache, v_cache, k_name="k_cache", v_name="v_cache")
        hkv, capacity = k_cache.shape[1], k_cache.shape[2]
    n_new = 0
    if k is not None or v is not None:
        n_new = check_new_tokens(k, v, q, k_cache, paged)
        if cache_seqlens is None:
            raise ValueError("k and v (new tokens to append) need cache_seqlens: the positions they "
                             "are written at, [cache_seqlens[b], cache_seqlens[b] + Nnew)")
    if cache_seqlens is not None:                     # None travels down: no lengths tensor to fill
        cache_seqlens = check_cache_seqlens(cache_seqlens, q, capacity)
    check_capacity(cache_seqlens, n_new, capacity, block_table, k_cache.shape[1], k_cache.shape[0])
    causal = check_flag(causal, "causal")
    used = check_variants(q, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks, dropout_p=dropout_p, op="decode")
    if causal:                                        # flash-attn: causal is the window (left, 0)
        used["window_size"] = (used.get("window_size", (-1, -1))[0], 0)
    window = used.get("window_size", (-1, -1))
    num_splits = (_default_num_splits(q, hkv, capacity, window) if num_splits is None
                  else check_num_splits(num_splits))
    # a split of no key adds nothing (capacity >= 1); a window's band is all a sequence can read
    num_splits = min(num_splits, _band(q, capacity, window))
    return_lse = check_flag(return_lse, "return_lse")
    scale = check_scale(scale, q.shape[-1])
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k_cache, v_cache)):
        raise ValueError("decode is inference-only (not differentiable), but q, k_cache or v_cache "
                         "requires grad: call it under torch.no_grad(), or use flashlib.attention")
    if paged:
        used["block_table"] = block_table
    chosen = backends.resolve(backend, q, "decode", used)
    used.pop("block_table", None)
    kernel = check_decode_kernel(kernel, chosen.name, chosen.kernels)
    from . import _ops# the op torch.compile sees (first use only)
    way = _ops.path(q, k_cache, v_cache, cache_seqlens, block_table, k, v)
    if n_new:
        (_ops.append_op if way == "op" else _ops.append_impl)(k_cache, v_cache, k, v, cache_seqlens, block_table)
        cache_seqlens = cache_seqlens + n_new         # on its device: no read-back
    # the backend itself, or the op where torch.compile & co. need one (_ops.path; decode has no
    # autograd: "function" cannot arise, as inputs that need a gradient were refused above)
    run = _ops.decode_op if way == "op" else _ops.decode_impl
    o, lse = run(q, k_cache, v_cache, cache_seqlens, num_splits, scale, chosen.name, kernel,
                 *_op_variants(used)[:4], block_table=block_table)
    return (o, lse) if return_lse else o


def append_kv(k_cache, v_cache, k, v, cache_seqlens, block_table=None):
    """Write new tokens into a KV cache in place, as :func:`decode` does before attending.

    ``k_cache, v_cache`` dense ``(B, Hkv, Nmax, d)`` with ``k, v`` ``(B, Hkv, Nnew, d)``, or paged
    ``(num_pages, page_size, Hkv, d)`` with ``block_table`` int32 ``(B, max_pages)`` and ``k, v``
    ``(B, Nnew, Hkv, d)``: token i of sequence b goes to position ``cache_seqlens[b] + i`` (its
    page ``block_table[b, pos // page_size]``, row ``pos % page_size``). The caller then advances
    ``cache_seqlens``. A serving engine fills its pages from a prefill this way. On a CPU, positions
    past the capacity (or table entries past the pages) are a ValueError; on a GPU nothing is read
    back and such positions are not written (Triton's append kernel).

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    paged = block_table is not None
    q_like = k.transpose(1, 2) if paged and hasattr(k, "transpose") else k    # (B, Hkv, Nnew, d)
    if paged:
        check_tensors(q_like, q_like, q_like, k_name="k", v_name="k")
        check_paged_cache(q_like, k_cache, v_cache)
        block_table = check_block_table(block_table, q_like, k_cache.shape[0])
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        check_tensors(k, k_cache, v_cache, k_name="k_cache", v_name="v_cache")
        capacity = k_cache.shape[2]
    n_new = check_new_tokens(k, v, q_like, k_cache, paged)
    if cache_seqlens is None:
        raise ValueError("cache_seqlens must be a tensor (B,) of the positions to append at, got None")
    cache_seqlens = check_cache_seqlens(cache_seqlens, q_like, capacity)
    check_capacity(cache_seqlens, n_new, capacity, block_table, k_cache.shape[1], k_cache.shape[0])
    from . import _ops
    way = _ops.path(k_cache, v_cache, k, v, cache_seqlens, block_table)
    (_ops.append_op if way == "op" else _ops.append_impl)(k_cache, v_cache, k, v, cache_seqlens, block_table)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                     dropout_p=0.0, dropout_seed=None, return_lse=False, backend="auto", allow_tf32=False):
    """Exact attention over a ragged batch: sequences packed end to end, no padding (flash-attn's
    ``flash_attn_varlen_func``). Differentiable in q, k, v (and sinks).

    Args:
        q: ``(total_q, H, d)`` the packed queries (token-major, the layout packed tokens are
            stored in; any strides with a contiguous last dim pass as a view). float16, bfloat16,
            float32 (float64: backend "reference" only).
        k, v: ``(total_k, Hkv, d)``, same dtype and device; ``H % Hkv == 0`` (GQA).
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)`` on q's device, starting at 0, non-decreasing,
            ending at total_q / total_k: sequence b is query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
            and key rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``. Empty sequences are allowed. Checked
            where the host may read them (CPU tensors); on a GPU the kernels clamp.
        max_seqlen_q, max_seqlen_k: host ints, at least the longest query / key sequence: they size
            the kernels' grid, so the device is never read from the host.
        causal, window_size, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, scale: as for
            :func:`attention`, each mask aligned bottom-right PER SEQUENCE (query i of sequence b
            sees key j iff ``j <= i + nk_b - nq_b``). ``alibi_slopes`` ``(H,)`` or ``(B, H)``.
            Dropout's counters: sequence b uses those of its own ``(1, H, nq_b, nk_b)`` problem at
            offset ``offset + b · H · max_seqlen_q · max_seqlen_k``.
        return_lse: also return ``lse`` float32 ``(H, total_q)`` (flash-attn's varlen layout).
        backend: "triton", "reference" or "auto" ("cuda" has no ragged kernels: refused by name).

    Returns:
        ``o`` ``(total_q, H, d)`` in q's dtype, or ``(o, lse)``. A query row whose sequence has no
        visible key outputs 0 (``lse = -inf``, or the sink).

    Raises:
        TypeError/ValueError naming the argument: q/k/v not 3-D or mismatched; cu_seqlens not int32,
        not 1-D, of different lengths, not starting at 0, decreasing, or not ending at the tokens'
        count (CPU); a max_seqlen below the longest sequence (CPU); the variants as for
        :func:`attention`.

    Explained in: notebooks/10_serving.
    Tested in: tests/test_api_serving.py.
    """
    check_varlen_tensors(q, k, v)
    cu_q = check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0], q)
    cu_k = check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0], q, batch=cu_q.numel() - 1)
    max_q = check_max_seqlen(max_seqlen_q, "max_seqlen_q", cu_q)
    max_k = check_max_seqlen(max_seqlen_k, "max_seqlen_k", cu_k)
    causal = check_flag(causal, "causal")
    return_lse = check_flag(return_lse, "return_lse")
    allow_tf32 = check_flag(allow_tf32, "allow_tf32")
    scale = check_scale(scale, q.shape[-1])
    used = check_variants(q, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                          sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
                          batch_heads=(cu_q.numel() - 1, q.shape[1]))
    chosen = backends.resolve(backend, q, "varlen", used)
    from . import _ops
    way = _ops.path(q, k, v, used.get("sinks"))
    run = {"backend": _ops.varlen_impl, "function": _ops.Varlen.apply}.get(way, _ops.varlen_op)
    o, lse = run(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, allow_tf32, chosen.name, *_op_variants(used))
    return (o, lse) if return_lse else o
