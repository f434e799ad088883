"""A small serving engine on flashlib: a paged KV cache with a page
allocator (:mod:`flashlib.serving.cache`) and continuous batching with
prefill through :func:`flashlib.attention_varlen`, decode through
:func:`flashlib.decode` with a block table, and shared prefixes through
:func:`flashlib.merge_states` (:mod:`flashlib.serving.engine`).
Importing this package imports torch.

Explained in: notebooks/10_serving.
"""
from .cache import PageAllocator, PagedKVCache
from .engine import Engine, MemoryReport, Request, generate

__all__ = ["PageAllocator", "PagedKVCache", "Request", "MemoryReport",
           "Engine", "generate"]
