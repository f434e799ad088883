"""A paged KV cache: memory handed out a page at a time, as vLLM does.

:class:`PageAllocator` keeps a free list of page numbers and a reference
count per page (a prompt prefix that several requests share is stored
once, its pages counted once per user). :class:`PagedKVCache` holds every
layer's keys and values in pages ``(num_pages, page_size, Hkv, d)``; a
sequence is a list of page numbers (its block table row), and token t of
it lives at row ``t % page_size`` of page ``pages[t // page_size]``.

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

import torch

from ..validation import check_int

__all__ = ["PageAllocator", "PagedKVCache"]


class PageAllocator:
    """Page numbers ``0 .. num_pages - 1``: a free list and reference counts.

    :meth:`alloc` takes pages off the free list (count 1), :meth:`share`
    adds a user to pages already held, :meth:`free` drops one user and
    returns a page to the free list when its count reaches 0. ``peak`` is
    the most pages ever held at once (what a run needed).

    Explained in: notebooks/10_serving.
    Tested in: tests/serving/test_cache.py.
    """

    def __init__(self, num_pages: int):
        self.num_pages = check_int(num_pages, "num_pages", 1)
        # a stack: the lowest page numbers go out first
        self.free_list = list(range(self.num_pages - 1, -1, -1))
        self.refs = [0] * self.num_pages
        self.peak = 0

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self.free_list)

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, each with one user (MemoryError if too few)."""
        n = check_int(n, "n", 0)
        if n > self.num_free:
            raise MemoryError(f"asked for {n} pages, {self.num_free} free "
                              f"of {self.num_pages}")
        pages = [self.free_list.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        self.peak = max(self.peak, self.in_use)
        return pages

    def share(self, pages) -> list[int]:
        """One more user of ``pages`` (held already): a shared prefix."""
        for p in pages:
            if self.refs[p] == 0:
                raise ValueError(f"pages must be held to be shared, "
                                 f"page {p} is free")
            self.refs[p] += 1
        return list(pages)

    def free(self, pages) -> None:
        """One user fewer; a page nobody uses goes back on the free list."""
        for p in pages:
            if self.refs[p] == 0:
                raise ValueError(f"pages must be held to be freed, "
                                 f"page {p} is free already")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.append(p)


class PagedKVCache:
    """Every layer's keys and values, in pages, with their allocator.

    ``k, v``: ``(n_layer, num_pages, page_size, Hkv, d)``, so ``k[l]`` is
    layer l's ``(num_pages, page_size, Hkv, d)`` paged cache, the layout
    :func:`flashlib.decode` reads through a block table. A sequence owns a
    list of pages; :meth:`grow` gives it pages for more tokens,
    :meth:`slots` says where its tokens live, :meth:`block_table` packs
    the page lists of a batch into int32 ``(B, max_pages)``.

    Explained in: notebooks/10_serving.
    Tested in: tests/serving/test_cache.py.
    """

    def __init__(self, n_layer: int, num_pages: int, page_size: int,
                 n_kv_head: int, head_dim: int, *,
                 dtype=torch.float32, device="cpu"):
        shape = (check_int(n_layer, "n_layer", 1),
                 check_int(num_pages, "num_pages", 1),
                 check_int(page_size, "page_size", 1),
                 check_int(n_kv_head, "n_kv_head", 1),
                 check_int(head_dim, "head_dim", 1))
        self.page_size = page_size
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.allocator = PageAllocator(num_pages)

    @classmethod
    def for_model(cls, model, num_pages: int, page_size: int):
        """A cache for a :class:`flashlib.models.GPT`, in its dtype."""
        c, w = model.config, model.lm_head.weight
        return cls(c.n_layer, num_pages, page_size, c.n_kv_head,
                   c.head_dim, dtype=w.dtype, device=w.device)

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes: k and v, every layer and kv head."""
        L, _, _, hkv, d = self.k.shape
        return 2 * L * hkv * d * self.k.element_size()

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_bytes

    def pages_for(self, n_tokens: int) -> int:
        """Pages that hold ``n_tokens`` tokens: ceil(n / page_size)."""
        return -(-n_tokens // self.page_size)

    def grow(self, pages: list, n_tokens: int) -> list:
        """Append pages to ``pages`` until they hold ``n_tokens``."""
        more = self.pages_for(n_tokens) - len(pages)
        if more > 0:
            pages += self.allocator.alloc(more)
        return pages

    def slots(self, pages, start: int, stop: int):
        """(page, row) of tokens ``start .. stop-1`` of a sequence: two
        int64 tensors, ``k[l][page, row]`` is where each token lives."""
        t = torch.arange(start, stop)
        table = torch.tensor(pages, dtype=torch.int64)
        page = table[t // self.page_size]
        row = t % self.page_size
        return page.to(self.k.device), row.to(self.k.device)

    def block_table(self, page_lists) -> torch.Tensor:
        """int32 ``(B, max_pages)``: row b lists sequence b's pages, padded
        with page 0 (never read: past its length)."""
        width = max(1, max(len(p) for p in page_lists))
        table = torch.zeros(len(page_lists), width, dtype=torch.int32)
        for b, pages in enumerate(page_lists):
            table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return table.to(self.k.device)
