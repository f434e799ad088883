"""Models built on flashlib: a small GPT whose attention is a switch (flashlib, SDPA, or plain math).

:mod:`flashlib.models.gpt` holds the model (:class:`GPTConfig`, :class:`GPT`), the one function where
the attention choice is made (:func:`causal_attention`), the generation cache (:class:`KVCache`, read
by :func:`flashlib.decode`), a character tokenizer, a small public-domain text shipped with the
package (:func:`load_text`), and the training and sampling loops. Importing this package imports torch.

Explained in: notebooks/11_models.
"""
from .gpt import (ATTENTION_CHOICES, GPT, CharTokenizer, GPTConfig, KVCache, causal_attention,
                  generate, get_batch, load_text, texts, train)

__all__ = ["ATTENTION_CHOICES", "GPT", "GPTConfig", "KVCache", "CharTokenizer", "causal_attention",
           "generate", "get_batch", "load_text", "texts", "train"]
