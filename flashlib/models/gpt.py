"""A small GPT in the nanoGPT spirit whose attention is pluggable: flashlib, SDPA or plain math.

Token and position embeddings, ``n_layer`` pre-LayerNorm blocks (causal self-attention, then an MLP,
each on a residual path), a final LayerNorm and a head tied to the token embedding. Every block calls
:func:`causal_attention`, the one place where ``GPTConfig.attention`` picks the implementation:

* ``"flashlib"`` — :func:`flashlib.attention` with ``causal=True`` (the reference NumPy backend on a
  CPU, the Triton kernels on a CUDA GPU);
* ``"sdpa"`` — ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, looked up at call
  time, so that :mod:`flashlib.auto` can route it;
* ``"naive"`` — the masked-softmax math, the ``(B, H, T, T)`` probabilities stored for the backward.

Self-attention is square (as many queries as keys), where flashlib's bottom-right causal mask and
SDPA's top-left ``is_causal`` are the same mask. Queries may have more heads than keys and values
(GQA, ``n_kv_head``). With as many kv heads as query heads, the fused QKV projection's output is
flash-attn's packed layout ``(B, T, 3, H, hs)``, and "flashlib" hands it whole to
:func:`flashlib.attention_qkvpacked`. There is no dropout: flashlib's attention has none, and a model
that compares attention implementations step by step must be deterministic.

Generation keeps a :class:`KVCache`: the prompt is run once (prefill), and each new token then runs
alone, one query per head against the cached keys and values through :func:`flashlib.decode`
(Flash-Decoding). :func:`generate` with ``kv_cache=False`` recomputes the whole window instead.

Also here: :class:`CharTokenizer`, :func:`load_text` (a public-domain text shipped in
``flashlib/models/data``), :func:`get_batch`, :func:`train` and :func:`generate`.

Explained in: notebooks/11_models.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from importlib import resources

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..api import MAX_HEAD_DIM, attention_qkvpacked
from ..api import attention as flash_attention
from ..api import decode as flash_decode

__all__ = ["ATTENTION_CHOICES", "GPTConfig", "GPT", "KVCache", "CausalSelfAttention", "MLP", "Block",
           "causal_attention", "CharTokenizer", "load_text", "texts", "get_batch", "train", "generate"]

ATTENTION_CHOICES = ("flashlib", "sdpa", "naive")


# --------------------------------------------------------------------------------------------------
# Argument checks: a bad value is refused with the argument's name, what was expected and what came.
# --------------------------------------------------------------------------------------------------

def _check_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def _check_attention(attention) -> str:
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, got {attention!r}")
    return attention


def _check_positive_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a positive number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value}")
    return float(value)


def _check_tokens(data, name: str) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(data).__name__}")
    if data.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise TypeError(f"{name} must hold integer token ids, got dtype {data.dtype}")
    return data


# --------------------------------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------------------------------

@dataclass
class GPTConfig:
    """The model's sizes and its attention implementation.

    Args:
        vocab_size: number of distinct tokens (for :class:`CharTokenizer`, its ``vocab_size``).
        block_size: the longest sequence the model accepts (rows of the position embedding).
        n_layer: number of transformer blocks.
        n_head: query heads per block; ``n_embd % n_head == 0``, head dim ``n_embd // n_head``.
        n_kv_head: key/value heads (GQA; ``n_head % n_kv_head == 0``); None means ``n_head``
            (multi-head attention), 1 is multi-query attention.
        n_embd: width of the residual stream.
        attention: "flashlib", "sdpa" or "naive" (see :func:`causal_attention`).

    Raises:
        TypeError: a size that is not an int.
        ValueError: a size < 1, ``n_embd % n_head != 0``, ``n_head % n_kv_head != 0``, a head dim
            above flashlib's 256, or an unknown ``attention``.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    vocab_size: int
    block_size: int
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 64
    attention: str = "flashlib"

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            setattr(self, name, _check_int(getattr(self, name), name))
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        self.n_kv_head = _check_int(self.n_kv_head, "n_kv_head")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd must be a multiple of n_head ({self.n_head}), got n_embd "
                             f"{self.n_embd}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head (GQA: query "
                             f"head h reads kv head h // (n_head // n_kv_head)), got n_kv_head "
                             f"{self.n_kv_head}")
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(f"the head dim n_embd // n_head must be at most {MAX_HEAD_DIM} "
                             f"(flashlib's limit), got {self.head_dim}")
        self.attention = _check_attention(self.attention)

    @property
    def head_dim(self) -> int:
        """``n_embd // n_head``."""
        return self.n_embd // self.n_head


def causal_attention(q, k, v, attention: str = "flashlib"):
    """Causal self-attention of one block, three interchangeable ways.
    Returns ``(B, H, T, hs)``.

    Args:
        q: ``(B, H, T, hs)`` queries; k, v: ``(B, Hkv, T, hs)`` with
            ``H % Hkv == 0`` (GQA: query head h reads kv head
            ``h // (H // Hkv)``). Square: T queries and T keys, so flashlib's
            bottom-right causal mask and SDPA's top-left one are the same
            (query i sees keys 0..i).
        attention: "flashlib" (:func:`flashlib.attention`), "sdpa"
            (``torch.nn.functional.scaled_dot_product_attention``, looked up
            at each call so that :mod:`flashlib.auto` can route it) or
            "naive" (the masked-softmax math).

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    if attention == "flashlib":
        return flash_attention(q, k, v, causal=True)        # (B, H, T, hs)
    if attention == "sdpa":
        # torch >= 2.5 for GQA
        gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    if attention == "naive":
        group = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)               # (B, H, T, hs)
        v = v.repeat_interleave(group, dim=1)
        T = q.shape[-2]
        # (B, H, T, T) scores
        s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        visible = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        # (B, H, T, T), kept for the backward
        p = s.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return p @ v                                        # (B, H, T, hs)
    raise ValueError(f"attention must be one of {list(ATTENTION_CHOICES)}, "
                     f"got {attention!r}")


class CausalSelfAttention(nn.Module):
    """Project to q, k, v, attend causally (:func:`causal_attention`), project back.

    ``(B, T, C) -> (B, T, C)``. One linear layer makes q (``n_head`` heads) and k, v (``n_kv_head``
    heads each). With ``n_kv_head == n_head`` its output is the packed ``(B, T, 3, H, hs)`` layout, and
    "flashlib" attends with :func:`flashlib.attention_qkvpacked` (no split). With a cache (generation,
    :meth:`attend_cached`), k and v are written into it, and one new token attends to the whole cache
    through :func:`flashlib.decode`.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.attention = config.attention
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * config.head_dim)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, cache=None):
        """``x (B, T, C)``; ``cache``: None, or this block's
        ``(k_cache, v_cache, start)`` for :meth:`attend_cached` (generation;
        see :meth:`GPT.forward`)."""
        B, T, C = x.shape                                   # (B, T, C)
        H, Hkv, hs = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.c_attn(x)                          # (B, T, (H + 2 Hkv) hs)
        q, k, v = qkv.split([H * hs, Hkv * hs, Hkv * hs], dim=2)
        q = q.view(B, T, H, hs).transpose(1, 2)             # (B, H, T, hs)
        k = k.view(B, T, Hkv, hs).transpose(1, 2)           # (B, Hkv, T, hs)
        v = v.view(B, T, Hkv, hs).transpose(1, 2)           # (B, Hkv, T, hs)
        if cache is not None:                               # generation
            y = self.attend_cached(q, k, v, *cache)         # (B, H, T, hs)
            y = y.transpose(1, 2)                           # (B, T, H, hs)
        elif self.attention == "flashlib" and H == Hkv:     # the packed layout
            y = attention_qkvpacked(qkv.view(B, T, 3, H, hs), causal=True)
        else:
            y = causal_attention(q, k, v, self.attention)   # (B, H, T, hs)
            y = y.transpose(1, 2)                           # (B, T, H, hs)
        # (B, T, C): the heads side by side
        return self.c_proj(y.reshape(B, T, C))

    def attend_cached(self, q, k, v, k_cache, v_cache, start: int):
        """Generation: write ``k, v (B, Hkv, T, hs)`` at positions
        ``start ..`` of ``k_cache, v_cache (B, Hkv, Nmax, hs)``, then attend.
        The prompt (``start = 0``) attends causally among itself, as in
        training; one new token (``start > 0``, ``T = 1``) attends to all
        ``start + 1`` cached keys through :func:`flashlib.decode`
        (Flash-Decoding). Returns ``(B, H, T, hs)``."""
        T = q.shape[2]
        k_cache[:, :, start:start + T] = k       # append in place: no torch.cat
        v_cache[:, :, start:start + T] = v
        if start == 0:                                      # prefill
            return causal_attention(q, k, v, self.attention)  # (B, H, T, hs)
        seqlens = torch.full((q.shape[0],), start + T, dtype=torch.int32,
                             device=q.device)               # (B,)
        # (B, H, 1, hs): the new token sees the whole cache
        return flash_decode(q, k_cache, v_cache, cache_seqlens=seqlens)


class MLP(nn.Module):
    """``(B, T, C) -> (B, T, 4C) -> GELU -> (B, T, C)``.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.  (B, T, C)

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)                           # (B, T, C)
        return x + self.mlp(self.ln_2(x))                                # (B, T, C)


class GPT(nn.Module):
    """A decoder-only transformer: ``idx (B, T) -> logits (B, T, vocab_size)`` (and the loss).

    Weights are initialised as in GPT-2 (normal, std 0.02; residual projections scaled by
    ``1 / sqrt(2 n_layer)``) from torch's global generator: seed it (``torch.manual_seed``) before
    building two models that must start equal.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),          # token embedding
            wpe=nn.Embedding(config.block_size, config.n_embd),          # position embedding
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight                # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):                           # residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def set_attention(self, attention: str) -> "GPT":
        """Switch every block to ``attention`` ("flashlib", "sdpa" or "naive"), keeping the weights."""
        attention = _check_attention(attention)
        self.config.attention = attention
        for block in self.transformer.h:
            block.attn.attention = attention
        return self

    def forward(self, idx, targets=None, *, cache=None):
        """``idx (B, T)`` int token ids, ``T <= block_size``; ``targets (B, T)`` or None.

        ``cache``: None (idx holds positions ``0 .. T-1``), or a :class:`KVCache` (generation, under
        ``torch.no_grad()``): idx holds the next positions ``cache.length ..``, either a prompt into an
        empty cache (prefill: it attends causally, as without a cache) or one new token (``T = 1``: it
        attends to the whole cache through :func:`flashlib.decode`). Its keys and values are written
        into the cache, and ``cache.length`` grows by T.

        Returns ``(logits (B, T, vocab_size), loss)``, loss the mean cross-entropy (None without
        targets).
        """
        _check_tokens(idx, "idx")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        if not 1 <= T <= self.config.block_size:
            raise ValueError(f"idx must hold 1 to block_size ({self.config.block_size}) tokens per "
                             f"sequence, got T = {T}")
        start = 0 if cache is None else self._check_cache(cache, B, T)
        if targets is not None:
            _check_tokens(targets, "targets")
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got "
                                 f"{tuple(targets.shape)}")
        idx = idx.long()                                                 # (B, T) for the embedding
        pos = torch.arange(start, start + T, device=idx.device)          # (T,) positions
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)        # (B, T, C)
        layers = ([None] * len(self.transformer.h) if cache is None
                  else [(k, v, start) for k, v in zip(cache.k, cache.v)])  # block l's cache
        for block, layer_cache in zip(self.transformer.h, layers):
            x = block(x, layer_cache)                                    # (B, T, C)
        if cache is not None:
            cache.length = start + T
        logits = self.lm_head(self.transformer.ln_f(x))                  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T).long())
        return logits, loss

    def _check_cache(self, cache, B: int, T: int) -> int:
        """The position idx starts at, after checking that ``cache`` can take its T tokens."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a flashlib.models.KVCache or None, got "
                            f"{type(cache).__name__}")
        if torch.is_grad_enabled():
            raise ValueError("a KVCache is for generation (inference only): call the model under "
                             "torch.no_grad(), as generate does")
        c, p = self.config, self.lm_head.weight
        want = (c.n_layer, B, c.n_kv_head, c.block_size, c.head_dim)
        if tuple(cache.k.shape) != want or cache.k.dtype != p.dtype or cache.k.device != p.device:
            raise ValueError(f"cache must be a KVCache of this model for batch size {B}: k of shape "
                             f"{want}, {p.dtype} on {p.device}; got {tuple(cache.k.shape)}, "
                             f"{cache.k.dtype} on {cache.k.device}")
        if cache.length > 0 and T != 1:
            raise ValueError(f"with a non-empty cache (length {cache.length}) idx must hold one new "
                             f"token, got T = {T} (a prompt goes into an empty cache: cache.reset())")
        if cache.length + T > c.block_size:
            raise ValueError(f"the cache holds {cache.length} of the block_size ({c.block_size}) "
                             f"positions: no room for T = {T} more (generate re-prefills the window)")
        return cache.length


class KVCache:
    """The keys and values a :class:`GPT` has computed, kept for generation: one pair per block.

    ``k``, ``v``: ``(n_layer, B, n_kv_head, block_size, head_dim)``, allocated once in the model's dtype
    and on its device; ``k[l]`` is block l's ``(B, Hkv, Nmax, hs)`` cache. ``length``: how many
    positions hold a token, the same for every sequence of the batch. ``model(idx, cache=cache)``
    writes the keys and values of idx's tokens in place at positions ``length, length + 1, ...`` (no
    ``torch.cat`` per token) and advances ``length``; :meth:`reset` empties it.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """

    def __init__(self, model, batch_size: int):
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a flashlib.models.GPT, got {type(model).__name__}")
        batch_size = _check_int(batch_size, "batch_size")
        c, p = model.config, model.lm_head.weight
        shape = (c.n_layer, batch_size, c.n_kv_head, c.block_size, c.head_dim)   # (L, B, Hkv, Nmax, hs)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def reset(self) -> "KVCache":
        """Empty the cache (the next ``model(idx, cache=cache)`` is a prefill); the memory is kept."""
        self.length = 0
        return self


# --------------------------------------------------------------------------------------------------
# Data: a character tokenizer and the public-domain text shipped in flashlib/models/data.
# --------------------------------------------------------------------------------------------------

class CharTokenizer:
    """One token per distinct character of a text, ids in sorted character order.

    ``encode(str) -> list[int]``, ``decode(ids) -> str``.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("text must hold at least one character, got an empty string")
        self.chars = sorted(set(text))
        self._stoi = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        if not isinstance(s, str):
            raise TypeError(f"s must be a str, got {type(s).__name__}")
        try:
            return [self._stoi[c] for c in s]
        except KeyError as exc:
            raise ValueError(f"s holds the character {exc.args[0]!r}, which is not in the tokenizer's "
                             f"vocabulary of {self.vocab_size} characters") from None

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = list(ids)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, numbers.Integral)
               or not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must be ints in [0, {self.vocab_size}), got {bad[0]!r}")
        return "".join(self.chars[i] for i in ids)


def texts() -> list[str]:
    """Names of the texts shipped in ``flashlib/models/data`` (for :func:`load_text`).

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    folder = resources.files("flashlib.models").joinpath("data")
    return sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".txt"))


def load_text(name: str = "alice") -> str:
    """A public-domain text shipped with flashlib, read with :mod:`importlib.resources`.

    The file's leading ``#`` lines (title, source, why it is public domain) and the blank line after
    them are dropped; the text itself is returned unchanged. ``name`` is one of :func:`texts`.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    path = resources.files("flashlib.models").joinpath("data").joinpath(f"{name}.txt")
    if not path.is_file():
        raise ValueError(f"name must be one of {texts()}, got {name!r}")
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    start = 0
    while start < len(lines) and lines[start].startswith("#"):
        start += 1
    if start < len(lines) and not lines[start].strip():
        start += 1
    return "".join(lines[start:])


# --------------------------------------------------------------------------------------------------
# Training and sampling.
# --------------------------------------------------------------------------------------------------

def get_batch(data, batch_size: int, seq_len: int, *, generator=None, device=None):
    """Random windows of a token stream: ``x (B, T)`` and ``y (B, T)``, y being x shifted by one.

    Args:
        data: 1-D integer tensor of token ids, longer than ``seq_len``.
        batch_size, seq_len: B and T.
        generator: a :class:`torch.Generator` for the window starts (None: torch's global one).
        device: where to put x and y (None: data's device).

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    data = _check_tokens(data, "data")
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids, got shape {tuple(data.shape)}")
    batch_size = _check_int(batch_size, "batch_size")
    seq_len = _check_int(seq_len, "seq_len")
    if len(data) <= seq_len:
        raise ValueError(f"data must be longer than seq_len ({seq_len}) tokens, got {len(data)}")
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    x = torch.stack([data[i:i + seq_len] for i in starts.tolist()]).long()          # (B, T)
    y = torch.stack([data[i + 1:i + 1 + seq_len] for i in starts.tolist()]).long()  # (B, T)
    return x.to(device or data.device), y.to(device or data.device)


def train(model, data, steps: int, batch_size: int, seq_len: int,
          lr: float = 1e-3, seed: int = 0):
    """Train ``model`` with AdamW for ``steps`` steps on random windows of
    ``data``; return the losses.

    Deterministic given ``seed``: the batches come from a
    :class:`torch.Generator` seeded with it (so two runs with the same seed
    see the same batches, whatever else used torch's global generator in
    between), and ``torch.manual_seed(seed)`` is set too. The model has no
    dropout. Batches go to the device of the model's parameters.

    Returns:
        ``list[float]``, the training loss of each step (before that step's
        update).

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a flashlib.models.GPT, "
                        f"got {type(model).__name__}")
    data = _check_tokens(data, "data")
    steps = _check_int(steps, "steps")
    batch_size = _check_int(batch_size, "batch_size")
    seq_len = _check_int(seq_len, "seq_len")
    if seq_len > model.config.block_size:
        raise ValueError(f"seq_len must be at most the model's block_size "
                         f"({model.config.block_size}), got {seq_len}")
    lr = _check_positive_float(lr, "lr")
    seed = _check_int(seed, "seed", minimum=0)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        x, y = get_batch(data, batch_size, seq_len, generator=gen,
                         device=device)                     # (B, T) each
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _sample(logits, temperature: float, top_k, gen):
    """One token per row of the last position's ``logits (B, V)``: ``(B, 1)``."""
    logits = logits / temperature                                        # (B, V)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]   # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=gen)   # (B, 1)


@torch.no_grad()
def generate(model, idx, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, seed: int | None = None,
             kv_cache: bool = True):
    """Sample ``max_new_tokens`` tokens after ``idx (B, T)``; return
    ``(B, T + max_new_tokens)``.

    The model sees the last ``block_size`` tokens (its context window). Each
    step divides the last position's logits by ``temperature``, keeps the
    ``top_k`` largest (None: all) and samples, from a generator seeded with
    ``seed`` (None: torch's global one).

    ``kv_cache=True`` (Flash-Decoding): the window is run once (prefill, with
    the model's own attention) into a :class:`KVCache`; each new token then
    runs alone, one query per head against the cache through
    :func:`flashlib.decode`. ``kv_cache=False``: every step reruns the model
    on the whole window (the attention the model was configured with). Both
    give the same tokens, up to rounding. Beyond the window: the positions
    are learned and absolute, so once the window slides every kept token
    moves to a new position, and its keys and values change. A cached step
    past ``block_size`` tokens therefore re-prefills the last ``block_size``
    tokens: the same tokens as ``kv_cache=False``, at its cost. Keep
    ``T + max_new_tokens <= block_size`` to decode from the cache all the
    way.

    The model's train/eval mode is restored.

    Explained in: notebooks/11_models.
    Tested in: tests/models/test_gpt.py.
    """
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a flashlib.models.GPT, "
                        f"got {type(model).__name__}")
    _check_tokens(idx, "idx")
    if idx.dim() != 2 or idx.shape[1] < 1:
        raise ValueError(f"idx must have shape (B, T) with T >= 1, "
                         f"got {tuple(idx.shape)}")
    max_new_tokens = _check_int(max_new_tokens, "max_new_tokens", minimum=0)
    temperature = _check_positive_float(temperature, "temperature")
    if top_k is not None:
        top_k = _check_int(top_k, "top_k")
    if not isinstance(kv_cache, bool):
        raise TypeError(f"kv_cache must be a bool, "
                        f"got {type(kv_cache).__name__}")
    gen = None
    if seed is not None:
        seed = _check_int(seed, "seed", minimum=0)
        gen = torch.Generator(device=idx.device).manual_seed(seed)
    B, T = idx.shape
    window = model.config.block_size
    out = torch.empty(B, T + max_new_tokens, dtype=torch.long,
                      device=idx.device)                    # (B, T + new)
    out[:, :T] = idx
    cache = KVCache(model, B) if kv_cache and max_new_tokens else None
    was_training = model.training
    model.eval()
    try:
        for n in range(T, T + max_new_tokens):     # out[:, :n] is known
            if cache is not None and 0 < cache.length < window:
                # the cache holds out[:, :n - 1]: one token, Flash-Decoding
                logits, _ = model(out[:, n - 1:n], cache=cache)  # (B, 1, V)
            else:
                # the whole window, no cache: the prefill, or the window
                # slid (every token at a new position)
                if cache is not None:
                    cache.reset()
                window_ids = out[:, max(0, n - window):n]       # (B, T')
                logits, _ = model(window_ids, cache=cache)      # (B, T', V)
            out[:, n:n + 1] = _sample(logits[:, -1], temperature, top_k, gen)
    finally:
        model.train(was_training)
    return out
