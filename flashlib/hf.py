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
(Flash-Decoding), and a padded batch, prefill and steps alike, in
:func:`flashlib.attention_varlen` (ragged batches). What a layer passes, and
what flashlib receives (:func:`flashlib_arguments`):

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
sliding windows) and hands the layers a small :class:`Band` describing it
instead of a tensor (as transformers' flex_attention hands them a BlockMask).
The Band, like the dense mask of "eager" and "sdpa", decides causality and the
window: so a layer gets what eager attention computes even where its own
``is_causal`` says otherwise (Gemma 2 with ``use_bidirectional_attention``
keeps causal masks). Without a mask (``attention_mask=None``) the layer's
``is_causal`` and ``sliding_window`` decide, as in transformers'
flash-attention integration.

Padded batches: where the user's 2-D ``attention_mask`` (1 = token,
0 = padding) has a 0, the Band carries a :class:`Padding`: the rows of each
sequence's real tokens, as ``cu_seqlens``. The layers then unpad q, k and v
to the token-major layout of :func:`flashlib.attention_varlen`, attend (the
masks bottom-right aligned per sequence, as in every flashlib call), and pad
the output back, padding rows 0 (their logits are not eager's, and are never
used). Left padding (batched generation) and right padding both work, in the
prompt and in every generation step (one query per sequence against a cache
padded on the left). Finding the rows reads the mask back to the host, once
per forward and mask kind (not per layer): the sizes of a ragged batch are
host ints, as in flash-attn's own transformers path (``_upad_input``).

Anything else is a ValueError, never a silently wrong answer: a padding mask
with holes inside a sequence where a sliding window counts positions,
packed sequences, image-token or other custom overlays, chunked attention, a
static cache (whose empty slots need a mask), and a 4-D mask that is not the
plain band (pass the 2-D padding mask instead). A dense mask a caller passes
in itself is accepted only if it is exactly the band flashlib computes
anyway, or a 2-D padding mask.

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
    "flashlib.hf takes padding as transformers' 2-D attention_mask (B, "
    "total length), 1 = token, 0 = padding, whose tokens in each sequence are "
    "contiguous where a sliding window counts positions (left or right "
    "padding): this mask is not; pass that 2-D mask, or use another "
    "attn_implementation")

FOUR_D_MESSAGE = (
    "flashlib.hf: this 4-D attention_mask is not the plain causal / window "
    "band flashlib computes (padding, or another pattern): pass a padded "
    "batch's 2-D attention_mask (B, total length) instead")

# The keyword arguments of a packed (flattened) batch (transformers' own
# packing, from position_ids), not taken: padded batches are (Padding)
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_FUNCTIONS = {}   # backend -> the attention function registered for it


@dataclasses.dataclass(frozen=True, eq=False)
class Padding:
    """Where a padded batch's real tokens are: what :func:`check_mask` reads
    from a 2-D ``attention_mask``, once per forward and mask kind, and what
    :func:`attention_forward` unpads with (:func:`flashlib.attention_varlen`'s
    arguments). Compared by identity.

    Attributes:
        q_index, k_index: int64 ``(total_q,)`` / ``(total_k,)``, the rows of
            the real queries / keys in ``(B * Nq)`` / ``(B * Nk)``, sequence by
            sequence (the token-major order of varlen).
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)``, from 0.
        max_seqlen_q, max_seqlen_k: host ints.
        q_length, kv_length: ``Nq`` and ``Nk`` of the padded layout.
    """
    q_index: torch.Tensor
    k_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    q_length: int
    kv_length: int


@dataclasses.dataclass(frozen=True)
class Band:
    """The mask :func:`check_mask` hands a model in place of a tensor: the
    pattern, which flashlib computes from its arguments, and where a batch
    is padded, where its real tokens are.

    Attributes:
        causal: query ``i`` sees no key after it (bottom-right aligned).
        sliding_window: transformers' ``W`` (each query sees the ``W``
            positions up to itself when causal; ``|i - j| <= W`` when not),
            or None.
        padding: a :class:`Padding` (the layers then attend through
            :func:`flashlib.attention_varlen`), or None: no padding.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    causal: bool
    sliding_window: int | None = None
    padding: Padding | None = None

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
    :func:`flashlib.attention`, :func:`flashlib.decode` for a generation
    step (one query per sequence, no dropout, no gradient), or
    :func:`flashlib.attention_varlen` for a padded batch.

    Args:
        module: the calling attention layer.
        query: ``(B, H, Nq, d)``; key, value: ``(B, Hkv, Nk, d)``.
        attention_mask: a :class:`Band` (what :func:`check_mask` gives: it
            decides causality and the window, and carries the padding),
            ``None`` (the layer's ``is_causal`` and ``sliding_window``
            decide), a 2-D ``(B, Nk)`` padding mask (1 = token, 0 = padding;
            the queries are the last ``Nq`` positions), or a 4-D dense mask,
            accepted only if it is exactly the causal / window band (bool,
            True = attend; or additive float, 0 = attend).
        dropout, scaling, sliding_window, softcap, s_aux, is_causal: see
            :func:`flashlib_arguments`.
        backend: flashlib's backend ("auto", "triton", "reference", "cuda").
        kwargs: the rest of what the layer passes (position ids and the
            like), unused; packed-sequence arguments (``cu_seq_lens_q``...)
            and ``position_bias`` are refused.

    Returns:
        ``(o, None)``: ``o`` ``(B, Nq, H, d)`` in query's dtype; in a padded
        batch the padding rows are 0.

    Raises:
        ValueError: a mask flashlib cannot express (:data:`PADDING_MESSAGE`),
            packed sequences, a position bias; flashlib's own errors.

    Explained in: notebooks/09_real_models.
    Tested in: tests/test_hf.py.
    """
    packed = [n for n in _PACKED if kwargs.get(n) is not None]
    if packed:
        raise ValueError(f"flashlib.hf: packed sequences ({packed[0]}) are "
                         f"not taken: pass a padded batch with its 2-D "
                         f"attention_mask (it runs in "
                         f"flashlib.attention_varlen)")
    if kwargs.get("position_bias") is not None:
        raise ValueError("flashlib.hf: an additive position_bias is not "
                         "supported")
    padding = None
    if isinstance(attention_mask, Band):
        # the mask decides, as it does for eager attention
        is_causal = attention_mask.causal
        sliding_window = attention_mask.sliding_window
        padding = attention_mask.padding
        attention_mask = None
    args = flashlib_arguments(module, query, dropout=dropout,
                              scaling=scaling, sliding_window=sliding_window,
                              softcap=softcap, s_aux=s_aux,
                              is_causal=is_causal)
    window = args.get("window_size", (-1, -1))
    if attention_mask is not None:
        padding = _check_dense_mask(attention_mask, query.shape[0],
                                    query.shape[2], key.shape[2],
                                    args["causal"], window)
    if padding is not None:
        return _attend_padded(query, key, value, padding, backend, args), None
    if _decode_step(query, key, value, args):
        # one new token against the cache: Flash-Decoding (split-KV)
        del args["causal"]          # one query at the end sees every key
        o = api.decode(query, key, value, backend=backend, **args)
    else:
        o = api.attention(query, key, value, backend=backend, **args)
    # (B, H, Nq, d) -> (B, Nq, H, d), no attention weights
    return o.transpose(1, 2).contiguous(), None


def _attend_padded(query, key, value, padding, backend, args):
    """A padded batch through :func:`flashlib.attention_varlen`: unpad q, k,
    v to token-major rows, attend (masks bottom-right per sequence), pad the
    output back with 0 rows. ``(B, Nq, H, dv)``; differentiable."""
    b, h, nq, _ = query.shape
    nk = key.shape[2]
    if (nq, nk) != (padding.q_length, padding.kv_length) or (
            b + 1 != padding.cu_seqlens_q.shape[0]):
        raise ValueError(
            f"flashlib.hf: the padding mask was built for "
            f"{len(padding.cu_seqlens_q) - 1} sequences of "
            f"{padding.q_length} queries and {padding.kv_length} keys, but "
            f"this layer has {b} sequences, {nq} queries and {nk} keys")
    device = query.device

    def rows(x, n, index):
        # (B, heads, n, d) -> token-major (B * n, heads, d) -> the real rows
        t = x.transpose(1, 2).reshape(b * n, x.shape[1], x.shape[3])
        return t.index_select(0, index.to(device))
    q = rows(query, nq, padding.q_index)
    k = rows(key, nk, padding.k_index)
    v = rows(value, nk, padding.k_index)
    o = api.attention_varlen(
        q, k, v, padding.cu_seqlens_q.to(device),
        padding.cu_seqlens_k.to(device), padding.max_seqlen_q,
        padding.max_seqlen_k, backend=backend, **args)
    # (total_q, H, dv) -> (B * Nq, H, dv), padding rows 0 -> (B, Nq, H, dv)
    out = o.new_zeros(b * nq, h, o.shape[-1])
    out = out.index_copy(0, padding.q_index.to(device), o)
    return out.view(b, nq, h, o.shape[-1])


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
    arguments (with a :class:`Padding` for a padded batch), a ValueError
    otherwise.

    transformers calls it once per forward and per layer type with the mask's
    geometry: the queries are absolute positions ``q_offset ...
    q_offset + q_length - 1``, the keys ``kv_offset ... kv_offset +
    kv_length - 1``, ``mask_function(b, h, q, kv)`` the pattern and
    ``attention_mask`` the user's 2-D ``(B, total length)`` padding mask.

    Accepted: ``mask_function`` causal, bidirectional, or either with a
    sliding window; and the last key is the last query (``kv_offset +
    kv_length == q_offset + q_length``): the bottom-right alignment of
    flashlib's masks, true without a cache and with transformers' dynamic
    caches (sliding-window layers' included); a plain bidirectional mask
    (cross-attention to an encoder's keys) needs none. A 0 in
    ``attention_mask`` (padding, left or right) gives the Band a
    :class:`Padding`: the real tokens of each sequence, found by reading
    the mask back to the host (one read per call, as flash-attn's
    transformers path does; the layers then share it). Where a sliding
    window counts positions, each sequence's tokens must be contiguous.

    Raises:
        ValueError: a mask pattern flashlib cannot express (packed
            sequences, image-token blocks, chunked attention,
            or_mask_function / and_mask_function overlays), keys that do not
            end at the last query (a static cache), a padding mask of the
            wrong shape or with holes under a window (:data:`PADDING_MESSAGE`).

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
    aligned = end_q == end_k
    if not aligned and pattern != (False, None):   # alignment matters
        raise ValueError(
            f"flashlib.hf needs the keys to end at the last query (keys up to "
            f"position {end_k - 1}, queries up to {end_q - 1}): a static "
            f"cache's empty slots need a mask; use a DynamicCache (the "
            f"default) or no cache")
    if attention_mask is None:
        return Band(*pattern)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch_size:
        raise ValueError(f"flashlib.hf: expected a 2-D ({batch_size}, total "
                         f"length) padding mask, got shape "
                         f"{tuple(attention_mask.shape)}")
    if attention_mask.shape[-1] < end_k:
        raise ValueError(f"flashlib.hf: the 2-D attention_mask covers "
                         f"{attention_mask.shape[-1]} positions, but the keys "
                         f"reach position {end_k - 1}")
    mask = attention_mask.bool()
    keys = mask[:, end_k - int(kv_length):end_k]
    # cross-attention: the mask is the keys' only; every query is real
    queries = (mask[:, end_q - int(q_length):end_q] if aligned else
               torch.ones(batch_size, int(q_length), dtype=torch.bool,
                          device=mask.device))
    padding = _padding(keys, queries, contiguous=pattern[1] is not None)
    return Band(*pattern, padding=padding)


def _padding(keys, queries, *, contiguous):
    """The :class:`Padding` of a batch whose real keys / queries are the True
    entries of ``keys (B, Nk)`` / ``queries (B, Nq)`` (the queries the last
    positions of the keys, or all real), or None if nothing is padded.
    ``contiguous``: refuse a sequence whose tokens have a hole (a window
    counts positions; varlen's rows would close the hole up). Reads the mask
    back to the host (its sizes are host ints)."""
    b, nk = keys.shape
    nq = queries.shape[1]
    lens_k = keys.sum(1)
    lens_q = queries.sum(1)
    # one read of the mask decides: nothing padded (the common case)
    if torch.stack([lens_k.sum(), lens_q.sum()]).tolist() == [b * nk, b * nq]:
        return None
    if contiguous:
        pos = torch.arange(nk, device=keys.device)
        first = torch.where(keys, pos, nk).amin(1)
        last = torch.where(keys, pos, -1).amax(1)
        holes = ((lens_k > 0) & (last - first + 1 != lens_k)).nonzero()
        if len(holes):
            raise ValueError(f"{PADDING_MESSAGE} (sequence "
                             f"{int(holes[0, 0])}'s tokens have a hole)")

    def cumulative(lens):
        cu = torch.zeros(b + 1, dtype=torch.int32, device=lens.device)
        cu[1:] = lens.cumsum(0)
        return cu
    return Padding(
        q_index=queries.reshape(-1).nonzero().squeeze(1),
        k_index=keys.reshape(-1).nonzero().squeeze(1),
        cu_seqlens_q=cumulative(lens_q), cu_seqlens_k=cumulative(lens_k),
        max_seqlen_q=int(lens_q.max()) if b else 0,
        max_seqlen_k=int(lens_k.max()) if b else 0,
        q_length=nq, kv_length=nk)


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


def _check_dense_mask(mask, batch, nq, nk, causal, window):
    """A 2-D ``(B, Nk)`` padding mask: its :class:`Padding` (None if it pads
    nothing). A 4-D mask: accepted (None) if it is exactly the band flashlib
    computes (bool, True = attend, or additive float: 0 attend, -inf or the
    dtype's minimum masked), broadcast over batch and heads; any other is
    refused."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"flashlib.hf: unsupported attention_mask of type "
                         f"{type(mask).__name__}")
    if mask.dim() == 2:                       # (B, Nk) padding mask
        if tuple(mask.shape) != (batch, nk):
            raise ValueError(f"flashlib.hf: expected a ({batch}, {nk}) "
                             f"padding mask, got shape {tuple(mask.shape)}")
        keys = mask.bool()
        # the queries are the last Nq keys, except in plain cross-attention
        cross = not causal and window == (-1, -1) and nq != nk
        queries = torch.ones_like(keys[:, :nq]) if cross else keys[:, nk - nq:]
        return _padding(keys, queries, contiguous=window != (-1, -1))
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
        raise ValueError(FOUR_D_MESSAGE)
    return None
