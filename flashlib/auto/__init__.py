"""Route ``torch.nn.functional.scaled_dot_product_attention`` to flashlib where flashlib supports it.

Importing this module changes nothing. :func:`enable` replaces the function in
``torch.nn.functional`` with a router; :func:`disable` puts the original function object back;
:func:`enabled` does both around a block of code. ``import flashlib.auto.on`` enables it in one line
(the switch flash-attention-ipu offers).

A call is routed to :func:`flashlib.attention` only when flashlib computes exactly what SDPA computes:
4-D ``(B, H, N, d)`` tensors on a CPU or CUDA device, fp16/bf16/fp32, one dtype, ``attn_mask=None``,
``dropout_p`` a Python number equal to 0, ``is_causal`` and ``enable_gqa`` Python bools (SDPA refuses
anything else, ``np.bool_`` and ``1`` included), ``scale`` None or a Python number (not a bool, which
SDPA reads as 1.0 or 0.0) finite in float32, the same head dim for q, k and v (at most 256), equal
head counts or ``enable_gqa=True`` with ``H % Hkv == 0``, and on a GPU a backend that can run there
(not where Triton is missing or older than flashlib supports: :func:`flashlib.backends.auto_choice`).
Everything else goes to the original function, unchanged, so an unsupported or malformed call gives
SDPA's own result or SDPA's own error: routing never changes what SDPA accepts or refuses. The router
has SDPA's signature (``scale`` and ``enable_gqa`` keyword-only).

SDPA's ``is_causal`` is **top-left** aligned (query i sees key j iff ``j <= i``), unlike flashlib's
bottom-right ``causal``. The router reproduces SDPA: with ``Nq < Nk`` the keys past ``Nq`` are never
visible, so it attends to the first ``Nq`` keys; with ``Nq > Nk`` the first ``Nk`` queries form a square
causal problem and the rest see every key.

A routed call that is decode-shaped (:func:`decode_shaped`: no gradient needed, no causal mask, at most
16 queries against at least 4 keys per query) goes to :func:`flashlib.decode` (Flash-Decoding's split-KV)
instead of :func:`flashlib.attention`: the token-by-token steps of generation with a KV cache, which
Hugging Face models run as SDPA calls with one query and ``is_causal=False``.

:data:`stats` counts the calls: ``"routed"`` every call flashlib computed (by attention or decode),
``"decode"`` those of them that went to decode, ``"fallback"`` those the original SDPA computed.

Explained in: notebooks/11_models.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

__all__ = ["enable", "disable", "enabled", "is_enabled", "stats", "route_reason", "scaled_dot_product_attention",
           "top_left_causal", "decode_shaped", "DECODE_MAX_QUERIES", "DECODE_MIN_KEYS_PER_QUERY"]

_original = None            # the function object enable() replaced; None while disabled
stats = {"routed": 0, "decode": 0, "fallback": 0}   # routed: flashlib computed it; decode: of those, decode did
DECODE_MAX_QUERIES = 16         # decode_shaped: at most this many queries ...
DECODE_MIN_KEYS_PER_QUERY = 4   # ... against at least this many keys per query
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)     # a larger scale overflows flashlib's fp32 math


def route_reason(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False) -> str | None:
    """``None`` when flashlib can take this SDPA call, else why it falls back to the original.

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    ts = (query, key, value)
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return "query, key and value must all be tensors"
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if type(flag) is not bool:                    # SDPA's own rule: np.bool_, 1 or "yes" is refused
            return f"{name} must be a bool (SDPA refuses anything else), got {type(flag).__name__}"
    if attn_mask is not None:
        return "attn_mask is not supported"
    if not isinstance(dropout_p, (int, float)) or dropout_p != 0.0:   # a tensor, True, 0.1, nan, "0"
        return "dropout_p must be 0 (a Python number): dropout is not supported"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or abs(scale) > _FLOAT32_MAX or not math.isfinite(scale)):
        return ("scale must be None or a Python number finite in float32 (a bool, a tensor, nan or "
                "inf is SDPA's to read)")
    if any(t.dim() != 4 for t in ts):
        return "only 4-D (B, H, N, d) tensors are routed"
    if len({t.dtype for t in ts}) != 1 or query.dtype not in _DTYPES:
        return "dtypes must be one of fp16, bf16, fp32 and equal"
    if len({t.device for t in ts}) != 1 or query.device.type not in ("cpu", "cuda"):
        return "tensors must share one CPU or CUDA device"
    (b, h, nq, d), (bk, hk, nk, dk), (bv, hv, nv, dv) = query.shape, key.shape, value.shape
    if not (b == bk == bv and hk == hv and nk == nv and d == dk == dv) or 0 in (b, h, nq, nk, d):
        return "shapes are not (B, H, Nq, d), (B, Hkv, Nk, d), (B, Hkv, Nk, d) with nothing empty"
    if d > 256:
        return "head dim > 256"
    if hk != h and not (enable_gqa and h % hk == 0):
        return "different head counts need enable_gqa=True and H % Hkv == 0"
    if query.dtype == torch.bfloat16 and query.is_cuda \
            and torch.cuda.get_device_capability(query.device) < (8, 0):
        return "bf16 needs sm_80 or newer"
    if query.is_cuda:                # the backend flashlib.attention's "auto" would run must be a GPU's
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
        return _gpu_backend_reason(query, grad)
    return None


def _gpu_backend_reason(query, grad: bool = False) -> str | None:
    """Why flashlib's ``backend="auto"`` has no GPU backend for this CUDA query (triton missing, or
    older than flashlib supports: flashlib.backends.auto_choice), or, with ``grad``, why its backward
    would be refused (flashlib.kernels.triton.configs.refusal: fp16 at d > 128 on a T4 with triton
    3.3); else None. SDPA beats the CPU reference."""
    from ..backends import auto_choice
    try:
        name, why = auto_choice(query)
    except (ValueError, TypeError) as exc:      # the backend refuses this input
        return str(exc)
    if why is not None:
        return f"no GPU backend here ({why})"
    if grad and name == "triton":
        from ..hardware import device_facts
        from ..kernels.triton import configs, kit
        facts = device_facts(query.device)
        if facts is not None:
            return configs.refusal("bwd_dkdv", facts.arch, kit.block_d(query.shape[-1]),
                                   str(query.dtype).removeprefix("torch."))
    return None


def top_left_causal(q, k, v, scale):
    """SDPA's top-left ``is_causal`` (query i sees key j iff j <= i) from
    flashlib's bottom-right ``causal``, for ``(B, H, Nq, d)`` tensors: keys
    past Nq are cut off when Nq <= Nk; when Nq > Nk the first Nk queries are a
    square causal problem and the rest see every key.

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    from .. import attention
    nq, nk = q.shape[-2], k.shape[-2]
    if nq <= nk:
        # keys >= Nq are in every query's future: a square problem
        return attention(q, k[..., :nq, :], v[..., :nq, :], causal=True,
                         scale=scale)
    # the square part, then the queries that see every key
    head = attention(q[..., :nk, :], k, v, causal=True, scale=scale)
    tail = attention(q[..., nk:, :], k, v, causal=False, scale=scale)
    return torch.cat([head, tail], dim=-2)


def decode_shaped(query, key, value, is_causal=False) -> bool:
    """Whether an SDPA call that :func:`route_reason` accepts goes to
    :func:`flashlib.decode` (True) rather than :func:`flashlib.attention`
    (False). ``(B, H, Nq, d)`` query, ``(B, Hkv, Nk, d)`` key and value; GQA
    goes to decode as it is (``H % Hkv == 0``, no copies). All three must
    hold:

    * **No gradient**: decode is inference only. Grad mode is off, or none of
      q, k, v requires grad.
    * **The same mask**: decode lets every query see every key, which is
      SDPA's ``is_causal=False``. SDPA's ``is_causal=True`` is top-left:
      query 0 sees key 0 only, so it means "every key" only when ``Nk == 1``,
      where there is no cache to split. Causal calls never go to decode (a
      Hugging Face prefill passes ``is_causal=True``; its token-by-token steps
      pass one query and ``is_causal=False``).
    * **Few queries, a long cache**: ``Nq <= DECODE_MAX_QUERIES`` (16) and
      ``Nk >= DECODE_MIN_KEYS_PER_QUERY * Nq`` (4). The attention forward
      gives each (batch, head) one program per block of 32 to 128 query
      rows; with 16 rows or fewer that block is at least half empty, only
      B·H programs run, and each walks the whole cache alone. Flash-Decoding
      stacks the query rows of a GQA group (16 rows: its smallest tile) and
      splits the cache over more programs. With fewer than 4 keys per query
      the call is no cache but a small, nearly square problem, which the
      forward does in one launch where decode needs two (split, then
      combine).

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    nq, nk = query.shape[-2], key.shape[-2]
    if is_causal or nq > DECODE_MAX_QUERIES:
        return False
    if nk < DECODE_MIN_KEYS_PER_QUERY * nq:
        return False
    grads = any(t.requires_grad for t in (query, key, value))
    return not (torch.is_grad_enabled() and grads)


def scaled_dot_product_attention(query, key, value, attn_mask=None,
                                 dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """What :func:`enable` puts in the place of
    ``torch.nn.functional.scaled_dot_product_attention``: SDPA's signature
    and semantics (top-left ``is_causal``), computed by
    :func:`flashlib.attention` when :func:`route_reason` finds nothing
    against it (by :func:`flashlib.decode` when the call is
    :func:`decode_shaped`), else by the original SDPA (counted in
    :data:`stats`).

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    if route_reason(query, key, value, attn_mask, dropout_p, is_causal, scale,
                    enable_gqa):
        stats["fallback"] += 1
        return _original(query, key, value, attn_mask=attn_mask,
                         dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)
    stats["routed"] += 1
    if decode_shaped(query, key, value, is_causal):
        stats["decode"] += 1
        from .. import decode
        # every query sees every key
        return decode(query, key, value, scale=scale)
    if is_causal:
        return top_left_causal(query, key, value, scale)
    from .. import attention
    return attention(query, key, value, causal=False, scale=scale)


def enable() -> None:
    """Route supported SDPA calls to flashlib (idempotent).

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    global _original
    if _original is None:
        _original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = scaled_dot_product_attention


def disable() -> None:
    """Restore the original ``torch.nn.functional.scaled_dot_product_attention`` object (idempotent).

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    global _original
    if _original is not None:
        F.scaled_dot_product_attention = _original
        _original = None


def is_enabled() -> bool:
    """Whether SDPA is currently routed.

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    return _original is not None


@contextlib.contextmanager
def enabled():
    """Route SDPA inside a ``with`` block; the state before the block is restored after it.

    Explained in: notebooks/11_models.
    Tested in: tests/auto/test_auto.py.
    """
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
