"""Tests of flashlib/serving/engine.py: the engine's tokens are those of generating each request alone
(flashlib.models.generate, greedy), with and without cascade, for requests of different lengths that arrive
at different steps; continuous batching under a tight page budget; the shared prefix read once per group;
the memory report; bad input. A tiny float32 GPT on the CPU (reference backend): seconds."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from conftest import DEVICE, require

import flashlib
from flashlib.models import GPT, CharTokenizer, GPTConfig, generate, load_text
from flashlib.serving import Engine, MemoryReport, Request
from flashlib.serving import generate as serve

TOK = CharTokenizer(load_text())
SHARED = TOK.encode("Alice was ")                   # a prefix several requests share


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: torch's thread pool only costs here (on a busy machine, most of the time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(n_kv_head=None, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(TOK.vocab_size, 48, n_layer=2, n_head=2, n_kv_head=n_kv_head, n_embd=32)
    return GPT(cfg).eval()


def workload():
    """Five requests: prompt lengths 11 to 20, 3 to 9 new tokens, arriving at steps 0, 0, 1, 3 and 12 (the
    last after the others finished), three sharing SHARED (the last reuses it once it is gone)."""
    texts = ["Alice was b", "Down the rabbit", "Alice was very tired", "Alice was not", "Alice was here"]
    prompts = [TOK.encode(t) for t in texts]
    news = [6, 3, 9, 5, 4]
    prefix = [len(SHARED), 0, len(SHARED), len(SHARED), len(SHARED)]
    arrivals = [0, 0, 1, 3, 12]
    return prompts, news, prefix, arrivals


@functools.cache
def expected(n=5):
    """The tokens of the first n requests of :func:`workload`, each alone, from the model ``tiny()``."""
    prompts, news, _, _ = workload()
    return alone(tiny(), prompts[:n], news[:n])


def alone(model, prompts, news):
    """Each request generated alone, greedily (top_k=1), with flashlib.models.generate's KV cache."""
    device = model.lm_head.weight.device
    return [generate(model, torch.tensor([p], device=device), n, top_k=1)[0].tolist()
            for p, n in zip(prompts, news)]


@pytest.mark.parametrize("page_size, cascade", [(1, True), (4, True), (4, False), (16, False)])
def test_tokens_are_those_of_each_request_alone(page_size, cascade):
    """With cascade or without (so both give the same tokens), any page size."""
    prompts, news, prefix, arrivals = workload()
    out, engine = serve(tiny(), prompts, news, prefix=prefix, arrivals=arrivals, page_size=page_size,
                        cascade=cascade, backend="reference")
    assert out == expected()
    assert engine.cache.allocator.in_use == 0 and not engine.prefixes   # every page given back
    assert engine.steps >= 12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads(seed):
    """Random prompts, lengths, arrivals, page sizes and two prefixes (one a page multiple), a tight cache."""
    g = torch.Generator().manual_seed(seed)

    def ints(n, lo, hi):
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    page_size = ints(1, 1, 6)[0]
    heads = [ints(n, 0, TOK.vocab_size) for n in (2 * page_size, ints(1, 1, 9)[0])]
    which = ints(6, 0, 3)                           # 2: no shared prefix
    prompts = [(heads[w] if w < 2 else []) + ints(ints(1, 1, 8)[0], 0, TOK.vocab_size) for w in which]
    prefix = [len(heads[w]) if w < 2 else 0 for w in which]
    news, arrivals = ints(6, 1, 8), ints(6, 0, 6)
    model = tiny(n_kv_head=[1, 2][seed % 2], seed=seed)
    need = sum(-(-(len(p) + n) // page_size) for p, n in zip(prompts, news))
    for cascade in (True, False):
        engine = Engine(model, num_pages=need // 2 + 2 * page_size, page_size=page_size, cascade=cascade,
                        backend="reference")
        out = engine.run([Request(*r) for r in zip(prompts, news, prefix, arrivals)])
        assert out == alone(model, prompts, news), (seed, cascade)
        assert engine.cache.allocator.in_use == 0


def test_gqa_model_with_cascade():
    model = tiny(n_kv_head=1, seed=3)
    prompts, news, prefix, arrivals = workload()
    out, _ = serve(model, prompts, news, prefix=prefix, arrivals=arrivals, page_size=3, backend="reference")
    assert out == alone(model, prompts, news)


@pytest.mark.parametrize("cascade", [True, False])
def test_triton_backend(cascade):
    """The same engine on flashlib's Triton kernels: interpreted on a CPU, compiled on a GPU (DEVICE)."""
    require(importlib.util.find_spec("triton") is not None, "triton is not installed")
    model = tiny().to(DEVICE)
    prompts, news, prefix, arrivals = workload()
    prompts, news, prefix, arrivals = prompts[:3], [2, 3, 2], prefix[:3], [0, 0, 1]
    out, _ = serve(model, prompts, news, prefix=prefix, arrivals=arrivals, page_size=4, cascade=cascade,
                   backend="triton")
    assert out == alone(model, prompts, news)


def test_requests_wait_for_pages_and_leave_while_others_run():
    model = tiny()
    prompts, news, _, _ = workload()
    # page_size 4: the requests need 4, 5, 7, 5 and 5 pages at most; 12 pages hold two at a time
    engine = Engine(model, num_pages=12, page_size=4, max_batch=3, backend="reference")
    reqs = [engine.add(Request(p, n)) for p, n in zip(prompts, news)]
    admitted, finished = {}, {}
    while engine.waiting or engine.running:
        step = engine.steps
        done = engine.step()
        for i, r in enumerate(reqs):
            if r.output and i not in admitted:
                admitted[i] = step
            if any(r is d for d in done):
                finished[i] = step
        assert engine.cache.allocator.in_use <= 12
    assert engine.peak_requests == 2                # the pages allowed two at a time
    h = engine.history
    assert [x["step"] for x in h] == list(range(engine.steps))
    assert sum(x["admitted"] for x in h) == sum(x["finished"] for x in h) == 5
    assert h[0] == dict(step=0, admitted=2, decoded=0, finished=0, pages=3 + 4)   # prompts of 11 and 15
    assert max(x["pages"] for x in h) == engine.cache.allocator.peak
    assert admitted[0] == admitted[1] == 0
    # request 1 (3 tokens) leaves; request 2 enters the next step, while request 0 runs on
    assert admitted[2] == finished[1] + 1 and admitted[2] < finished[0]
    assert [r.tokens for r in reqs] == expected()
    assert engine.cache.allocator.peak <= 12 and engine.cache.allocator.in_use == 0


def test_requests_are_served_in_order_of_arrival():
    model = tiny()
    engine = Engine(model, num_pages=8, page_size=4, backend="reference")
    late, early = engine.add(Request([1, 2], 2, arrival=3)), engine.add(Request([3], 2))
    engine.step()
    assert early.output and not late.output and engine.waiting[0] is late
    engine.run()
    assert len(late.output) == len(early.output) == 2 and engine.history[3]["admitted"] == 1


def test_max_batch_caps_the_running_requests():
    model = tiny()
    prompts, news, _, _ = workload()
    engine = Engine(model, num_pages=64, page_size=4, max_batch=2, backend="reference")
    for p, n in zip(prompts, news):
        engine.add(Request(p, n))
    while engine.waiting or engine.running:
        engine.step()
        assert len(engine.running) <= 2
    assert engine.peak_requests == 2


def test_each_prefix_is_read_once_per_group(monkeypatch):
    """With cascade, one decode per layer and step reads the shared prefix's pages, in one row of its
    block table for the whole group; the per-request decode never reads them."""
    model = tiny()
    prompts, news, prefix, _ = workload()
    tables, real = [], flashlib.decode

    def spy(q, k_cache, v_cache, **kw):
        lens = kw["cache_seqlens"] + (0 if kw.get("k") is None else kw["k"].shape[1])
        used = [row[:-(-n // k_cache.shape[1])] for row, n in zip(kw["block_table"].tolist(), lens.tolist())]
        tables.append((q.shape[2], used, lens.tolist()))
        return real(q, k_cache, v_cache, **kw)

    monkeypatch.setattr(flashlib, "decode", spy)
    engine = Engine(model, num_pages=64, page_size=4, backend="reference")
    reqs = [engine.add(Request(p, n, f)) for p, n, f in zip(prompts[:4], news[:4], prefix[:4])]
    engine.step()                                   # prefill; the prefix is stored once
    shared_pages = reqs[0].shared.pages
    assert reqs[2].shared is reqs[0].shared and reqs[3].shared is reqs[0].shared
    assert len(shared_pages) == 3 and engine.cache.allocator.refs[shared_pages[0]] == 3
    engine.step()
    calls = tables[-2 * model.config.n_layer:]      # the second step's decode calls
    prefix_calls = [c for c in calls if any(set(shared_pages) & set(row) for row in c[1])]
    # one call per layer reads the prefix, once, with the group's three queries stacked
    assert len(prefix_calls) == model.config.n_layer
    for nq, used, lens in prefix_calls:
        assert nq == 3 and lens == [len(SHARED)] and used == [shared_pages]
    while engine.waiting or engine.running:
        engine.step()
    assert [r.tokens for r in reqs] == expected(4)


def test_memory_report_from_the_allocator():
    model = tiny()
    prompts, news, prefix, _ = workload()
    reports = {}
    for cascade in (True, False):
        _, engine = serve(model, prompts, news, prefix=prefix, page_size=4, cascade=cascade,
                          backend="reference")
        m = engine.memory()
        assert isinstance(m, MemoryReport)
        c = engine.cache
        assert m.peak_pages == c.allocator.peak and m.page_bytes == c.page_bytes == 4 * m.token_bytes
        assert m.token_bytes == 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 heads, d 16, float32
        assert m.paged_bytes == m.peak_pages * m.page_bytes
        assert m.peak_requests == 5 and m.max_len == 48
        assert m.contiguous_bytes == 5 * 48 * m.token_bytes
        assert 0 < m.paged_bytes < m.contiguous_bytes and 0 < m.saved < 1
        assert engine.memory(max_len=20).contiguous_bytes == 5 * 20 * m.token_bytes
        reports[cascade] = m
    # cascade stores SHARED (10 tokens: 3 pages) once instead of in four prompts
    first = {}
    for cascade in (True, False):
        engine = Engine(model, num_pages=64, page_size=4, cascade=cascade, backend="reference")
        for p, n, f in zip(prompts, news, prefix):
            engine.add(Request(p, n, f))
        engine.step()
        first[cascade] = engine.cache.allocator.in_use
    assert first[True] == 3 + sum(-(-(len(p) - f) // 4) for p, f in zip(prompts, prefix))
    assert first[False] == sum(-(-len(p) // 4) for p in prompts)
    assert reports[True].peak_pages < reports[False].peak_pages


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    model = tiny()
    out, _ = serve(model, [TOK.encode("Alice")], 2, progress=True, backend="reference")
    assert len(out[0]) == 7
    assert "tokens" in capsys.readouterr().err


def test_bad_input():
    model = tiny()
    with pytest.raises(ValueError, match="prompt"):
        Request([], 3)
    with pytest.raises(ValueError, match="prompt"):
        Request([1, -2], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request([1], 0)
    with pytest.raises(ValueError, match="prefix must be shorter"):
        Request([1, 2], 1, prefix=2)
    with pytest.raises(TypeError, match="arrival"):
        Request([1], 1, arrival=1.5)
    assert Request(torch.tensor([3, 4]), 1).prompt == [3, 4]
    engine = Engine(model, num_pages=2, page_size=4)
    with pytest.raises(ValueError, match="window"):
        engine.add(Request([1] * 40, 10))
    with pytest.raises(ValueError, match="more pages than the cache has"):
        engine.add(Request([1] * 8, 2))
    with pytest.raises(TypeError, match="request must be a Request"):
        engine.add([1, 2])
    with pytest.raises(TypeError, match="model must be a flashlib.models.GPT"):
        Engine(torch.nn.Linear(2, 2), num_pages=2)
    with pytest.raises(TypeError, match="cascade"):
        Engine(model, num_pages=2, cascade=1)
    with pytest.raises(ValueError, match="max_batch"):
        Engine(model, num_pages=2, max_batch=0)
    with pytest.raises(ValueError, match="prefix must be an int or 2 ints"):
        serve(model, [[1], [2]], 2, prefix=[0])
    with pytest.raises(TypeError, match="page_size must be an int, got float"):
        serve(model, [[1], [2]], 2, page_size=2.5)
