"""Tests of flashlib/serving/cache.py: the page allocator (free list, reference counts, peak) and the
paged KV cache (shapes, bytes, growing a sequence, slots, block tables)."""
from __future__ import annotations

import pytest
import torch

from flashlib.models import GPT, GPTConfig
from flashlib.serving import PageAllocator, PagedKVCache


def test_allocator_hands_out_pages_and_takes_them_back():
    a = PageAllocator(4)
    assert (a.num_free, a.in_use, a.peak) == (4, 0, 0)
    x = a.alloc(3)
    assert x == [0, 1, 2] and a.in_use == 3 and a.peak == 3
    a.free(x[:2])
    assert a.num_free == 3 and a.peak == 3          # the peak stays
    y = a.alloc(3)
    assert len(set(y)) == 3 and 2 not in y          # page 2 is still held
    assert a.alloc(0) == [] and a.peak == 4
    with pytest.raises(MemoryError, match="asked for 1 pages, 0 free"):
        a.alloc(1)


def test_shared_pages_go_back_only_when_the_last_user_frees_them():
    a = PageAllocator(3)
    p = a.alloc(2)
    a.share(p)
    a.share(p[:1])
    assert a.refs[:2] == [3, 2]
    a.free(p)
    assert a.num_free == 1
    a.free(p)
    assert a.num_free == 2 and a.refs[:2] == [1, 0]
    a.free(p[:1])
    assert a.num_free == 3


def test_allocator_refuses_bad_input():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    with pytest.raises(TypeError, match="num_pages"):
        PageAllocator(2.0)
    a = PageAllocator(2)
    with pytest.raises(ValueError, match="n must be"):
        a.alloc(-1)
    with pytest.raises(ValueError, match="page 1 is free"):
        a.free([1])
    with pytest.raises(ValueError, match="page 0 is free"):
        a.share([0])


def test_cache_shapes_bytes_and_a_model_cache():
    c = PagedKVCache(2, 5, 4, 3, 8, dtype=torch.float16)
    assert c.k.shape == c.v.shape == (2, 5, 4, 3, 8) and c.k.dtype == torch.float16
    assert c.token_bytes == 2 * 2 * 3 * 8 * 2 and c.page_bytes == 4 * c.token_bytes
    assert [c.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    torch.manual_seed(0)
    model = GPT(GPTConfig(10, 16, n_layer=3, n_head=4, n_kv_head=2, n_embd=32)).double()
    m = PagedKVCache.for_model(model, 7, 3)
    assert m.k.shape == (3, 7, 3, 2, 8) and m.k.dtype == torch.float64
    with pytest.raises(ValueError, match="page_size"):
        PagedKVCache(2, 5, 0, 3, 8)


def test_grow_slots_and_block_table():
    c = PagedKVCache(1, 8, 3, 1, 2)
    a, b = [], []
    c.grow(a, 4)                                    # 2 pages
    c.grow(b, 1)
    c.grow(a, 6)                                    # still 2 pages
    c.grow(a, 7)                                    # a third
    assert a == [0, 1, 3] and b == [2] and c.allocator.in_use == 4
    page, row = c.slots(a, 2, 7)
    assert page.tolist() == [0, 1, 1, 1, 3] and row.tolist() == [2, 0, 1, 2, 0]
    table = c.block_table([a, b, []])
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 1, 3], [2, 0, 0], [0, 0, 0]]
    # token t of a sequence is k[l][table[b, t // page_size], t % page_size]
    c.k[0][page, row] = torch.arange(5.0)[:, None, None].expand(5, 1, 2)
    t = torch.arange(2, 7)
    got = c.k[0][table[0].long()[t // 3], t % 3][:, 0, 0]
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
