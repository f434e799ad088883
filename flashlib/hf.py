"""Run Hugging Face transformers models' attention in flashlib.

transformers looks a model's attention up by name in two registries: its
``AttentionInterface`` (the function that computes attention) and its
``AttentionMaskInterface`` (the function that builds the mask that attention
function is given). :func:`register` puts flashlib into both, under one name::

    import flashlib.hf
    flashlib.hf.register()                  # name "FlashLib", backend "auto"
    model = AutoModelForCausalLM.from_pretrained(
        ..., attn_implementation="FlashLib")

The name is not "flashlib": transformers (5.24) takes every name that
contains "flash" for a flash-attn kernel it must load (from the package
flash-attn or the Hub), and fails; :func:`register` refuses such names.

Every model whose attention layers call ``ALL_ATTENTION_FUNCTIONS`` then runs
its attention in flashlib: the prompt (prefill) and training in
:func:`flashlib.attention`, each token-by-token generation step (one query
against the KV cache, no gradient) in :func:`flashlib.decode`
(Flash-Decoding). What a layer passes, and what flashlib receives
(:func:`flashlib_arguments`):

* ``query`` ``(B, H, Nq, d)``, ``key`` / ``value`` ``(B, Hkv, Nk, d)``: as they
  are. GQA is native (no ``repeat_kv`` copy). With a cache, ``Nk`` is the past
  plus the new tokens, and the new queries are the last ``Nq`` positions:
  flashlib's bottom-right aligned ``causal``.
* ``scaling`` -> ``scale``; ``dropout`` -> ``dropout_p`` (transformers passes
  0.0 outside training).
* ``sliding_window=W`` (Mistral, Gemma 2, gpt-oss; None on full-attention
  layers): a query sees itself and the ``W - 1`` keys before it ->
  ``window_size=(W - 1, 0)``. On a bidirectional layer, transformers' mask is
  ``|i - j| <= W`` -> ``window_size=(W, W)``.
* ``softcap`` (Gemma 2's ``attn_logit_softcapping``, 50.0) -> ``softcap``.
* ``s_aux`` (gpt-oss's learned sinks, one logit per query head, in the model's
  dtype) -> ``sinks``, as float32 (its gradient flows back through the cast).
* the mask (a :class:`Band`, below) -> ``causal`` and the window; without a
  mask, ``is_causal`` (or the layer's ``module.is_causal``) -> ``causal``.

The output is transposed to the ``(B, Nq, H, d)`` transformers expects, with
attention weights ``None`` (a fused kernel never forms them).

Masks: none is built. The mask function :func:`check_mask` recognises the
masks flashlib computes from its arguments alone (causal, bidirectional,
sliding windows; no padding) and hands the layers a small :class:`Band`
describing it instead of a tensor (as transformers' flex_attention hands them
a BlockMask). The Band, like the dense mask of "eager" and "sdpa", decides
causality and the window: so a layer gets what eager attention computes even
where its own ``is_causal`` says otherwise (Gemma 2 with
``use_bidirectional_attention`` keeps causal masks). Without a mask
(``attention_mask=None``) the layer's ``is_causal`` and ``sliding_window``
decide, as in transformers' flash-attention integration.

Anything else is a ValueError, never a silently wrong answer: a padded batch
(a 2-D ``attention_mask`` with a 0: padded batches come with varlen,
flashlib's ragged-batch API), packed sequences, image-token or other custom
overlays, chunked attention, and a static cache (whose empty slots need a
mask). A dense mask a caller passes in itself is accepted only if it is
exactly the band flashlib computes anyway (so a causal-only mask means "no
padding"), and refused otherwise.

Importing this module imports torch but not transformers; :func:`register`
imports transformers.

Explained in: notebooks/09_real_models.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from . import api

__all__ = ["register", "attention_forward", "check_mask", "Band",
           "flashlib_arguments", "tiny_model", "TINY_MODELS",
           "PADDING_MESSAGE"]

PADDING_MESSAGE = (
    "flashlib.hf does not take padded batches yet (padded batches come with "
    "varlen, flashlib's ragged-batch API): pass sequences of equal length "
    "without padding, one sequence at a time, or use another "
    "attn_implementation")

# The keyword arguments of a packed (flattened) batch: flashlib has no varlen
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_FUNCTIONS = {}   # backend -> the attention function registered for it


@dataclasses.dataclass(frozen=True)
class Band:
    """The mask :func:`check_mask` hands a model in place of a tensor: the
    pattern, which flashlib computes from its arguments.

    Attributes:
        causal: query ``i`` sees no key after it (bottom-right aligned).
        sliding_window: transformers' ``W`` (each query sees the ``W``
            positions up to itself when causal; ``|i - j| <= W`` when not),
            or None.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    causal: bool
    sliding_window: int | None = None

    @property
    def window_size(self) -> tuple[int, int]:
        """flashlib's ``window_size=(left, right)`` for this band."""
        w = self.sliding_window
        if w is None:
            return (-1, -1)
        return (w - 1, 0) if self.causal else (w, w)


def flashlib_arguments(module, query, *, dropout=0.0, scaling=None,
                       sliding_window=None, softcap=None, s_aux=None,
                       is_causal=None) -> dict:
    """The keyword arguments of :func:`flashlib.attention` for one call of a
    transformers attention layer.

    Args:
        module: the attention layer (its ``is_causal`` is the default).
        query: ``(B, H, Nq, d)``, for the device and the head count.
        dropout, scaling, sliding_window, softcap, s_aux, is_causal: what the
            layer passed (see :mod:`flashlib.hf`).

    Returns:
        ``{"causal": ..., "scale": ...}`` plus, only where used,
        ``window_size`` (``(W - 1, 0)`` causal, ``(W, W)`` bidirectional),
        ``softcap``, ``sinks`` (float32 ``(H,)``) and ``dropout_p``.

    Raises:
        TypeError / ValueError: a sliding window that is not a positive int,
            sinks of the wrong shape.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    out = {"causal": bool(is_causal), "scale": scaling}
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(
                sliding_window, int):
            raise TypeError(f"sliding_window must be an int, got "
                            f"{type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got "
                             f"{sliding_window}")
        # transformers: causal kv > q - W; bidirectional |q - kv| <= W
        out["window_size"] = Band(out["causal"], sliding_window).window_size
    if softcap is not None and softcap != 0:
        out["softcap"] = float(softcap)
    if s_aux is not None:
        h = query.shape[1]
        if tuple(s_aux.shape) != (h,):
            raise ValueError(f"s_aux (the sinks) must have shape ({h},), one "
                             f"logit per query head, got "
                             f"{tuple(s_aux.shape)}")
        # (H,) float32, on q's device; the gradient flows through the cast
        out["sinks"] = s_aux.to(device=query.device,
                                dtype=torch.float32).contiguous()
    if dropout:
        out["dropout_p"] = float(dropout)
    return out


def attention_forward(module, query, key, value, attention_mask,
                      dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, s_aux=None, *, is_causal=None,
                      backend="auto", **kwargs):
    """A transformers attention function (``AttentionInterface``) that runs
    :func:`flashlib.attention`, or :func:`flashlib.decode` for a generation
    step (one query per sequence, no dropout, no gradient).

    Args:
        module: the calling attention layer.
        query: ``(B, H, Nq, d)``; key, value: ``(B, Hkv, Nk, d)``.
        attention_mask: a :class:`Band` (what :func:`check_mask` gives: it
            decides causality and the window), ``None`` (the layer's
            ``is_causal`` and ``sliding_window`` decide), or a dense mask,
            accepted only if it is exactly the causal / window band (bool,
            True = attend; or additive float, 0 = attend).
        dropout, scaling, sliding_window, softcap, s_aux, is_causal: see
            :func:`flashlib_arguments`.
        backend: flashlib's backend ("auto", "triton", "reference", "cuda").
        kwargs: the rest of what the layer passes (position ids and the
            like), unused; packed-sequence arguments (``cu_seq_lens_q``...)
            and ``position_bias`` are refused.

    Returns:
        ``(o, None)``: ``o`` ``(B, Nq, H, d)`` in query's dtype.

    Raises:
        ValueError: a padding or custom mask (:data:`PADDING_MESSAGE`),
            packed sequences, a position bias; flashlib's own errors.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    packed = [n for n in _PACKED if kwargs.get(n) is not None]
    if packed:
        raise ValueError(f"flashlib.hf: packed sequences ({packed[0]}) need "
                         f"varlen attention, which flashlib does not have "
                         f"yet")
    if kwargs.get("position_bias") is not None:
        raise ValueError("flashlib.hf: an additive position_bias is not "
                         "supported")
    if isinstance(attention_mask, Band):
        # the mask decides, as it does for eager attention
        is_causal = attention_mask.causal
        sliding_window = attention_mask.sliding_window
        attention_mask = None
    args = flashlib_arguments(module, query, dropout=dropout,
                              scaling=scaling, sliding_window=sliding_window,
                              softcap=softcap, s_aux=s_aux,
                              is_causal=is_causal)
    if attention_mask is not None:
        _check_dense_mask(attention_mask, query.shape[2], key.shape[2],
                          args["causal"], args.get("window_size", (-1, -1)))
    if _decode_step(query, key, value, args):
        # one new token against the cache: Flash-Decoding (split-KV)
        del args["causal"]          # one query at the end sees every key
        o = api.decode(query, key, value, backend=backend, **args)
    else:
        o = api.attention(query, key, value, backend=backend, **args)
    # (B, H, Nq, d) -> (B, Nq, H, d), no attention weights
    return o.transpose(1, 2).contiguous(), None


def _decode_step(query, key, value, args) -> bool:
    """A generation step: one query per sequence, no dropout, no gradient.
    :func:`flashlib.decode` computes it (its window is bottom-right aligned
    too); anything else goes to :func:`flashlib.attention`."""
    if query.shape[2] != 1 or "dropout_p" in args:
        return False
    tensors = (query, key, value, args.get("sinks"))
    return not (torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in tensors))


def check_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
               mask_function=None, attention_mask=None, **kwargs):
    """A transformers mask function (``AttentionMaskInterface``) that builds
    no mask: a :class:`Band` when flashlib computes the mask from its own
    arguments, a ValueError otherwise.

    transformers calls it once per forward and per layer type with the mask's
    geometry: the queries are absolute positions ``q_offset ...
    q_offset + q_length - 1``, the keys ``kv_offset ... kv_offset +
    kv_length - 1``, ``mask_function(b, h, q, kv)`` the pattern and
    ``attention_mask`` the user's 2-D ``(B, total length)`` padding mask.

    Accepted: ``mask_function`` causal, bidirectional, or either with a
    sliding window; no 0 in ``attention_mask``; and the last key
    is the last query (``kv_offset + kv_length == q_offset + q_length``): the
    bottom-right alignment of flashlib's masks, true without a cache and with
    transformers' dynamic caches (sliding-window layers' included); a plain
    bidirectional mask (cross-attention to an encoder's keys) needs none.

    Raises:
        ValueError: padding (:data:`PADDING_MESSAGE`), a mask pattern flashlib
            cannot express (packed sequences, image-token blocks, chunked
            attention, or_mask_function / and_mask_function overlays), keys
            that do not end at the last query (a static cache).

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    pattern = _pattern(mask_function)
    if pattern is None:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise ValueError(
            f"flashlib.hf computes causal, bidirectional and sliding-window "
            f"masks only; this call's mask ({name}) adds another pattern "
            f"(packed sequences, image-token blocks, chunked attention or a "
            f"custom overlay)")
    end_q = int(q_offset) + int(q_length)
    end_k = int(kv_offset) + int(kv_length)
    if end_q != end_k and pattern != (False, None):   # alignment matters
        raise ValueError(
            f"flashlib.hf needs the keys to end at the last query (keys up to "
            f"position {end_k - 1}, queries up to {end_q - 1}): a static "
            f"cache's empty slots need a mask; use a DynamicCache (the "
            f"default) or no cache")
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"flashlib.hf: expected a 2-D padding mask, got "
                             f"shape {tuple(attention_mask.shape)}")
        if attention_mask.shape[-1] < end_k or not bool(attention_mask.all()):
            raise ValueError(PADDING_MESSAGE)
    return Band(*pattern)


def register(name: str = "FlashLib", backend: str = "auto") -> str:
    """Register flashlib with transformers under ``name``, for
    ``attn_implementation=name``.

    Puts :func:`attention_forward` (with ``backend`` bound) into
    ``AttentionInterface`` and :func:`check_mask` into
    ``AttentionMaskInterface``, both under ``name``: the mask function must be
    registered too, since without one transformers hands the attention
    function no mask at all, and a padded batch would pass unnoticed.
    Idempotent: registering again replaces the entries (so
    ``register(backend="reference")`` switches the backend), and
    the same backend gives the same function object. Models already loaded
    look the name up at every call, so they see the change.

    Args:
        name: the ``attn_implementation`` name: a str that is not one of
            transformers' ("eager", "sdpa", "flex_attention"...) and does not
            contain "flash" (transformers would try to load a flash-attn
            kernel of that name; "FlashLib", capitalised, is fine).
        backend: flashlib's backend for every call ("auto", "triton",
            "reference", "cuda"), checked when attention runs.

    Returns:
        ``name``.

    Raises:
        TypeError: a non-str name or backend. ValueError: an empty name,
            a built-in one, or one containing "flash". ImportError:
            transformers is not installed.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    if not isinstance(name, str) or not isinstance(backend, str):
        raise TypeError("name and backend must be str, got "
                        f"{type(name).__name__} and {type(backend).__name__}")
    if not name or name in _BUILT_IN or name.startswith("paged|"):
        raise ValueError(f"name must be a new attn_implementation name, not "
                         f"{name!r} (transformers' own)")
    if "flash" in name:
        raise ValueError(
            f"name must not contain 'flash' (got {name!r}): transformers "
            f"takes such a name for a flash-attn kernel to load and fails; "
            f"use the default 'FlashLib' or another name")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    function = _FUNCTIONS.get(backend)
    if function is None:
        function = functools.partial(attention_forward, backend=backend)
        functools.update_wrapper(function, attention_forward)
        _FUNCTIONS[backend] = function
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, check_mask)
    return name


# kind -> (config class, model class, the variant options) in transformers
TINY_MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                {"sliding_window": 6}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"sliding_window": 6, "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 30.0,
                "query_pre_attn_scalar": 8}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"sliding_window": 6, "num_local_experts": 4,
                 "num_experts_per_tok": 2}),
}
_TINY = {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "initializer_range": 0.3}


def tiny_model(kind: str, *, seed: int = 0, **config):
    """A tiny randomly initialised transformers model, in eval mode, whose
    attention uses what its family uses.

    Two layers, 4 query heads sharing 2 kv heads (GQA), head dim 8, vocabulary
    100, float32. ``kind``: "llama" (plain causal), "mistral" (sliding window
    6 in every layer), "gemma2" (layer 0 sliding window 6, layer 1 full, both
    with logit softcap 2.0: Gemma 2's 50 would barely act on such small
    scores), "gpt_oss" (sliding / full layers, learned sinks, a small
    mixture of experts). Weights drawn with ``initializer_range=0.3``: wide
    enough that attention is peaked and every variant changes the logits.
    ``config`` overrides any option (``sliding_window=4``,
    ``attention_dropout=0.1``...).

    Raises:
        ValueError: an unknown kind. ImportError: transformers is missing.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    if kind not in TINY_MODELS:
        raise ValueError(f"kind must be one of {sorted(TINY_MODELS)}, got "
                         f"{kind!r}")
    import transformers
    config_name, model_name, options = TINY_MODELS[kind]
    options = {**_TINY, **options, **config}
    cfg = getattr(transformers, config_name)(**options)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).eval()


_BUILT_IN = ("eager", "sdpa", "flex_attention", "flash_attention_2",
             "flash_attention_3", "flash_attention_4", "kernels")


def _closure(fn) -> dict:
    """The variables a nested function closed over: ``{name: value}``."""
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ())
    return {n: c.cell_contents for n, c in zip(names, cells)}


def _is(fn, qualname: str) -> bool:
    return (getattr(fn, "__module__", None) == "transformers.masking_utils"
            and getattr(fn, "__qualname__", None) == qualname)


def _pattern(fn):
    """``(causal, W)`` for transformers' causal / bidirectional mask
    functions, alone (W None) or with a sliding window W; None for any other
    pattern (read from the closures of transformers.masking_utils)."""
    if _is(fn, "causal_mask_function"):
        return True, None
    if _is(fn, "bidirectional_mask_function"):
        return False, None
    if not _is(fn, "and_masks.<locals>.and_mask"):
        return None
    parts = _closure(fn).get("mask_functions", ())
    if len(parts) != 2:
        return None
    overlay, base = parts
    w = _closure(overlay).get("sliding_window")
    if not isinstance(w, int):
        return None
    if (_is(overlay, "sliding_window_overlay.<locals>.inner_mask")
            and _is(base, "causal_mask_function")):
        return True, w
    if (_is(overlay, "sliding_window_bidirectional_overlay.<locals>."
                     "inner_mask")
            and _is(base, "bidirectional_mask_function")):
        return False, w
    return None


def _check_dense_mask(mask, nq, nk, causal, window) -> None:
    """Accept a dense mask that is exactly the band flashlib computes (bool,
    True = attend, or additive float: 0 attend, -inf or the dtype's minimum
    masked), broadcast over batch and heads; refuse any other."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"flashlib.hf: unsupported attention_mask of type "
                         f"{type(mask).__name__}")
    if mask.dim() == 2:                       # (B, Nk) padding mask
        if mask.shape[-1] == nk and bool(mask.bool().all()):
            return
        raise ValueError(PADDING_MESSAGE)
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (nq, nk):
        raise ValueError(f"flashlib.hf: expected a (B, 1, {nq}, {nk}) mask, "
                         f"got shape {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        attend = mask
    else:
        low = torch.finfo(mask.dtype).min
        attend = mask == 0
        if not bool((attend | (mask <= low / 2)).all()):
            raise ValueError("flashlib.hf: the attention_mask adds a bias "
                             "(values other than 0 and -inf), which flashlib "
                             "does not take")
    i = torch.arange(nq, device=mask.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=mask.device)[None, :]
    band = torch.ones(nq, nk, dtype=torch.bool, device=mask.device)
    left, right = window
    if causal:
        band &= j <= i
    if left >= 0:
        band &= j >= i - left
    if right >= 0:
        band &= j <= i + right
    if not bool((attend == band).all()):
        raise ValueError(PADDING_MESSAGE)
