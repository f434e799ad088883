"""A small serving engine: continuous batching over a paged KV cache.

Requests (prompt token ids, how many tokens to generate) arrive at any
step. Each :meth:`Engine.step` admits the waiting requests the free pages
allow, runs their prompts packed end to end through
:func:`flashlib.attention_varlen` (prefill), and advances every request
already running by one token: one :func:`flashlib.decode` per layer for
the whole batch, reading the paged cache through a block table. A request
that has its tokens leaves, and its pages go back to the allocator.

Requests may declare a shared prompt prefix (``Request.prefix``, its
length). With ``cascade=True`` the prefix is stored once (its pages
reference-counted) and attended once per group: the group's queries are
stacked against the prefix pages, each request attends its own tokens
alone, and :func:`flashlib.merge_states` joins the two (cascade
attention). The math outside attention is the model's own
(:class:`flashlib.models.GPT`); sampling is greedy, so the tokens are
those of :func:`flashlib.models.generate` with ``top_k=1``.

Explained in: notebooks/10_serving.
"""
from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import torch

import flashlib

from ..models.gpt import GPT
from ..validation import check_int
from .cache import PagedKVCache

__all__ = ["Request", "MemoryReport", "Engine", "generate"]


@dataclass
class Request:
    """One generation request and its state in the engine.

    Args:
        prompt: token ids (a list, or a 1-D tensor), at least one.
        max_new_tokens: how many tokens to generate (>= 1).
        prefix: how many leading prompt tokens are shared with other
            requests (0: none); fewer than ``len(prompt)``.
        arrival: the engine step at which the request arrives.

    The engine fills ``output`` (the generated ids), ``pages`` (the pages
    of the request's own tokens), ``shared`` (its prefix, when shared)
    and ``cached`` (how many own tokens the cache holds).

    Explained in: notebooks/10_serving.
    Tested in: tests/serving/test_engine.py.
    """
    prompt: list
    max_new_tokens: int
    prefix: int = 0
    arrival: int = 0
    output: list = field(default_factory=list, init=False)
    pages: list = field(default_factory=list, init=False)
    shared: object = field(default=None, init=False)
    cached: int = field(default=0, init=False)

    def __post_init__(self):
        if isinstance(self.prompt, torch.Tensor):
            self.prompt = self.prompt.tolist()
        self.prompt = list(self.prompt)
        if not self.prompt or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool)
                and t >= 0 for t in self.prompt):
            raise ValueError("prompt must hold at least one token id "
                             "(ints >= 0)")
        self.max_new_tokens = check_int(self.max_new_tokens,
                                         "max_new_tokens", 1)
        self.prefix = check_int(self.prefix, "prefix", 0)
        if self.prefix >= len(self.prompt):
            raise ValueError(f"prefix must be shorter than the prompt "
                             f"({len(self.prompt)}), got {self.prefix}")
        self.arrival = check_int(self.arrival, "arrival", 0)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    @property
    def offset(self) -> int:
        """Position of the first own token (after a shared prefix)."""
        return 0 if self.shared is None else self.shared.length

    @property
    def tokens(self) -> list:
        """The prompt followed by the generated tokens."""
        return self.prompt + self.output


@dataclass
class _Prefix:
    """A shared prompt prefix: its tokens, stored once in ``pages``."""
    tokens: tuple
    pages: list
    filled: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class _Segment:
    """A run of prompt tokens in a prefill: whose (None: a prefix's),
    their ids, the position of the first, the pages they go into, and
    the shared prefix they also attend (None: none)."""
    request: object
    ids: list
    start: int
    pages: list
    prefix: object = None


@dataclass
class MemoryReport:
    """KV memory of a run: pages at the peak against contiguous caches.

    ``paged_bytes = peak_pages * page_bytes`` is what the paged cache
    held at its fullest (measured by the allocator);
    ``contiguous_bytes = peak_requests * max_len * token_bytes`` is what
    one contiguous cache per running request, sized to the longest
    sequence the model takes, would hold for the same batch.

    Explained in: notebooks/10_serving.
    Tested in: tests/serving/test_engine.py.
    """
    page_size: int
    page_bytes: int
    token_bytes: int
    peak_pages: int
    peak_requests: int
    max_len: int
    paged_bytes: int
    contiguous_bytes: int

    @property
    def saved(self) -> float:
        """The fraction of the contiguous bytes that paging does not use."""
        return 1 - self.paged_bytes / max(1, self.contiguous_bytes)


def _block(block, x, attend):
    """One transformer block of the model on token rows ``x (T, C)``: its
    own LayerNorms, projections and MLP around ``attend(q, k, v)``, where
    ``q (T, H, d)``, ``k, v (T, Hkv, d)`` and the result is ``(T, H, d)``.
    """
    a, T = block.attn, x.shape[0]
    qkv = a.c_attn(block.ln_1(x))                   # (T, (H + 2 Hkv) d)
    sizes = [a.n_head * a.head_dim, a.n_kv_head * a.head_dim]
    q, k, v = qkv.split([sizes[0], sizes[1], sizes[1]], dim=1)
    y = attend(q.view(T, a.n_head, a.head_dim),
               k.view(T, a.n_kv_head, a.head_dim),
               v.view(T, a.n_kv_head, a.head_dim))  # (T, H, d)
    x = x + a.c_proj(y.reshape(T, -1))              # (T, C)
    return x + block.mlp(block.ln_2(x))


class Engine:
    """Continuous batching of a :class:`flashlib.models.GPT` over a paged
    KV cache of ``num_pages`` pages of ``page_size`` tokens.

    :meth:`add` queues requests, :meth:`step` runs one step, :meth:`run`
    steps until every request has its tokens, :meth:`memory` reports
    the KV memory used. ``max_batch`` caps the running requests (None:
    only the pages do). ``cascade``: store and attend shared prefixes
    once (see :class:`Request`); False stores every prompt whole.
    ``backend`` is passed to flashlib's attention calls (the model's own
    ``config.attention`` is not used: the engine attends with flashlib).

    Explained in: notebooks/10_serving.
    Tested in: tests/serving/test_engine.py.
    """

    def __init__(self, model, *, num_pages: int, page_size: int = 16,
                 max_batch: int | None = None, cascade: bool = True,
                 backend: str = "auto"):
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a flashlib.models.GPT, "
                            f"got {type(model).__name__}")
        self.model = model
        self.cache = PagedKVCache.for_model(model, num_pages, page_size)
        self.max_batch = (None if max_batch is None
                          else check_int(max_batch, "max_batch", 1))
        if not isinstance(cascade, bool):
            raise TypeError(f"cascade must be a bool, "
                            f"got {type(cascade).__name__}")
        self.cascade, self.backend = cascade, backend
        self.waiting, self.running = deque(), []
        self.prefixes = {}                  # prefix tokens -> _Prefix
        self.steps = self.peak_requests = 0
        self.history = []                   # one dict per step

    # ---- admission and release -------------------------------------

    def _own_len(self, r) -> int:
        """Own tokens r will have cached when done (the last generated
        token is never fed back)."""
        shared = r.prefix if self.cascade else 0
        return len(r.prompt) - shared + r.max_new_tokens - 1

    def _pages_needed(self, r) -> int:
        """Pages r may still take: its own, and its prefix if new."""
        need = self.cache.pages_for(self._own_len(r)) - len(r.pages)
        if r.shared is None and self.cascade and r.prefix:
            if tuple(r.prompt[:r.prefix]) not in self.prefixes:
                need += self.cache.pages_for(r.prefix)
        return need

    def add(self, request: Request) -> Request:
        """Queue a request (it runs from its ``arrival`` step on)."""
        if not isinstance(request, Request):
            raise TypeError(f"request must be a Request, "
                            f"got {type(request).__name__}")
        window = self.model.config.block_size
        if len(request.prompt) + request.max_new_tokens - 1 > window:
            raise ValueError(f"request must fit the model's window: "
                             f"len(prompt) + max_new_tokens - 1 <= "
                             f"{window}")
        total = self.cache.allocator.num_pages
        shared = request.prefix if self.cascade else 0
        if (self.cache.pages_for(self._own_len(request))
                + self.cache.pages_for(shared) > total):
            raise ValueError(f"request needs more pages than the cache "
                             f"has ({total})")
        self.waiting.append(request)
        # first come first served: by arrival (stable: then as added)
        self.waiting = deque(sorted(self.waiting, key=lambda r: r.arrival))
        return request

    def _admit(self) -> list:
        """Admit waiting requests, first come first served, while the
        free pages cover what every running request may still take."""
        new, alloc = [], self.cache.allocator
        while self.waiting and self.waiting[0].arrival <= self.steps:
            r = self.waiting[0]
            promised = sum(self._pages_needed(x) for x in self.running)
            full = self.max_batch and len(self.running) >= self.max_batch
            if full or promised + self._pages_needed(r) > alloc.num_free:
                break
            self.running.append(self.waiting.popleft())
            self._take_pages(r)
            new.append(r)
        self.peak_requests = max(self.peak_requests, len(self.running))
        return new

    def _take_pages(self, r) -> None:
        """Pages for r's prompt: its prefix (shared, or new) and its own."""
        if self.cascade and r.prefix:
            key = tuple(r.prompt[:r.prefix])
            p = self.prefixes.get(key)
            if p is None:
                pages = self.cache.allocator.alloc(
                    self.cache.pages_for(r.prefix))
                p = self.prefixes[key] = _Prefix(key, pages)
            else:
                self.cache.allocator.share(p.pages)
            r.shared = p
        self.cache.grow(r.pages, len(r.prompt) - r.offset)

    def _release(self, r) -> None:
        """Give r's pages back; a prefix nobody uses is forgotten."""
        alloc = self.cache.allocator
        alloc.free(r.pages)
        if r.shared is not None:
            alloc.free(r.shared.pages)
            if alloc.refs[r.shared.pages[0]] == 0:
                del self.prefixes[r.shared.tokens]

    # ---- the model on token rows -----------------------------------

    def _forward(self, ids, pos, attend):
        """Logits of token rows: ``ids, pos (T,)`` -> ``(T, V)``;
        ``attend(layer, q, k, v)`` is that layer's attention."""
        tr = self.model.transformer
        x = tr.wte(ids) + tr.wpe(pos)                       # (T, C)
        for layer, block in enumerate(tr.h):
            x = _block(block, x, partial(attend, layer))
        return self.model.lm_head(tr.ln_f(x))               # (T, V)

    def _cascade_plan(self, rows, prefixes):
        """How rows (token rows of this step) attend their prefixes:
        each group's rows stacked as the queries of one sequence."""
        groups = {}
        for row, p in zip(rows, prefixes):
            groups.setdefault(id(p), (p, []))[1].append(row)
        if not groups:
            return None
        plan = {"rows": [], "group": [], "slot": []}
        for g, (_, members) in enumerate(groups.values()):
            plan["rows"] += members
            plan["group"] += [g] * len(members)
            plan["slot"] += range(len(members))
        dev = self.cache.k.device
        plan = {n: torch.tensor(v, device=dev) for n, v in plan.items()}
        ps = [p for p, _ in groups.values()]
        plan["n"] = max(len(m) for _, m in groups.values())
        plan["table"] = self.cache.block_table([p.pages for p in ps])
        plan["lens"] = torch.tensor([p.length for p in ps],
                                    dtype=torch.int32, device=dev)
        return plan

    def _cascade(self, layer, q, o, lse, plan):
        """Cascade: merge rows' own attention ``o (T, H, d)``,
        ``lse (T, H)`` with their prefix's. A group's queries are
        stacked against its prefix pages, read once for the group."""
        if plan is None:
            return o
        T, H, d = q.shape
        g, s = plan["group"], plan["slot"]
        # group g's queries side by side: one "sequence" of n queries
        qg = q.new_zeros(len(plan["lens"]), plan["n"], H, d)
        qg[g, s] = q[plan["rows"]]                 # (G, n, H, d)
        og, lg = flashlib.decode(
            qg.transpose(1, 2), self.cache.k[layer], self.cache.v[layer],
            cache_seqlens=plan["lens"], block_table=plan["table"],
            return_lse=True, backend=self.backend)  # (G, H, n, d)
        # rows without a prefix keep the empty state: o = 0, lse = -inf
        o_p = torch.zeros_like(o)
        lse_p = torch.full_like(lse, float("-inf"))
        o_p[plan["rows"]] = og.transpose(1, 2)[g, s]
        lse_p[plan["rows"]] = lg.transpose(1, 2)[g, s].to(lse.dtype)
        return flashlib.merge_states(o, lse, o_p, lse_p)[0]

    # ---- prefill and decode ----------------------------------------

    def _segments(self, new) -> list:
        """What a prefill runs: each new prefix (for its keys and values
        only), then each new request's own prompt tokens."""
        segs = []
        for r in new:
            p = r.shared
            if p is not None and not p.filled:
                segs.append(_Segment(None, list(p.tokens), 0, p.pages))
                p.filled = True
            own = r.prompt[r.offset:]
            segs.append(_Segment(r, own, r.offset, r.pages, p))
        return segs

    def _pack(self, segs) -> dict:
        """The segments packed end to end: token ids, positions, where
        each token's k and v go (page, row), ``cu_seqlens``."""
        lens = [len(s.ids) for s in segs]
        cu = torch.tensor([0] + lens).cumsum(0)
        slots = [self.cache.slots(s.pages, 0, n)
                 for s, n in zip(segs, lens)]
        rows, prefixes = [], []
        for s, a, b in zip(segs, cu[:-1].tolist(), cu[1:].tolist()):
            if s.prefix is not None:
                rows += range(a, b)
                prefixes += [s.prefix] * (b - a)
        dev = self.cache.k.device
        return dict(
            ids=torch.tensor([t for s in segs for t in s.ids], device=dev),
            pos=torch.cat([torch.arange(s.start, s.start + n)
                           for s, n in zip(segs, lens)]).to(dev),
            page=torch.cat([p for p, _ in slots]),
            row=torch.cat([r for _, r in slots]),
            cu=cu.to(dev, torch.int32), max_len=max(lens),
            plan=self._cascade_plan(rows, prefixes))

    def _prefill(self, new) -> None:
        """Run the new requests' prompts packed end to end: per layer, the
        keys and values go into their pages and one
        :func:`flashlib.attention_varlen` attends (causal per sequence);
        each request's first token is sampled from its last row."""
        segs = self._segments(new)
        pk = self._pack(segs)
        cu, n = pk["cu"], pk["max_len"]

        def attend(layer, q, k, v):
            # the slot mapping: each token's k and v into its page
            self.cache.k[layer][pk["page"], pk["row"]] = k
            self.cache.v[layer][pk["page"], pk["row"]] = v
            o, lse = flashlib.attention_varlen(
                q, k, v, cu, cu, n, n, causal=True, return_lse=True,
                backend=self.backend)               # (T, H, d), (H, T)
            return self._cascade(layer, q, o, lse.T, pk["plan"])

        logits = self._forward(pk["ids"], pk["pos"], attend)   # (T, V)
        last = logits[pk["cu"][1:].long() - 1]               # (S, V)
        for s, token in zip(segs, last.argmax(-1).tolist()):
            if s.request is not None:
                s.request.output.append(token)
                s.request.cached = len(s.ids)

    def _decode(self, reqs) -> None:
        """One new token for each running request: per layer, one
        :func:`flashlib.decode` for the whole batch appends the token's
        k and v into its page and attends to the request's cache."""
        for r in reqs:                  # room for one more token
            self.cache.grow(r.pages, r.cached + 1)
        dev = self.cache.k.device
        ids = torch.tensor([r.output[-1] for r in reqs], device=dev)
        pos = torch.tensor([r.offset + r.cached for r in reqs],
                           device=dev)
        lens = torch.tensor([r.cached for r in reqs], dtype=torch.int32,
                            device=dev)
        table = self.cache.block_table([r.pages for r in reqs])
        shared = [(b, r.shared) for b, r in enumerate(reqs)
                  if r.shared is not None]
        plan = self._cascade_plan(*zip(*shared)) if shared else None

        def attend(layer, q, k, v):
            o, lse = flashlib.decode(
                q[:, :, None], self.cache.k[layer], self.cache.v[layer],
                k=k[:, None], v=v[:, None], cache_seqlens=lens,
                block_table=table, causal=True, return_lse=True,
                backend=self.backend)               # (B, H, 1, d)
            return self._cascade(layer, q, o[:, :, 0],
                                       lse[:, :, 0], plan)

        logits = self._forward(ids, pos, attend)             # (B, V)
        for r, token in zip(reqs, logits.argmax(-1).tolist()):
            r.output.append(token)
            r.cached += 1

    # ---- the loop ---------------------------------------------------

    @torch.no_grad()
    def step(self) -> list:
        """One step: admit what fits and prefill it, decode one token for
        every request that was running, release the finished ones.
        Returns the requests that finished; ``history`` gets a dict of
        the step's counts (and the pages in use before the release)."""
        old = list(self.running)
        new = self._admit()
        if new:
            self._prefill(new)
        if old:
            self._decode(old)
        done = [r for r in self.running if r.done]
        self.history.append(dict(
            step=self.steps, admitted=len(new), decoded=len(old),
            finished=len(done), pages=self.cache.allocator.in_use))
        for r in done:
            self.running.remove(r)
            self._release(r)
        self.steps += 1
        return done

    def run(self, requests=(), *, progress=None) -> list:
        """Add ``requests``, then step until none waits or runs. Returns
        each request's tokens (prompt and generated), in order.
        ``progress``: a tqdm bar of generated tokens (None: when there
        are 1000 or more)."""
        requests = [self.add(r) for r in requests]
        total = sum(r.max_new_tokens for r in requests)
        bar = None
        if progress or (progress is None and total >= 1000):
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="tokens")
        while self.waiting or self.running:
            before = sum(len(r.output) for r in self.running)
            done = self.step()
            after = sum(len(r.output) for r in self.running + done)
            if bar is not None:
                bar.update(after - before)
        if bar is not None:
            bar.close()
        return [r.tokens for r in requests]

    def memory(self, max_len: int | None = None) -> MemoryReport:
        """KV memory at the peak, from the allocator, against contiguous
        caches of ``max_len`` tokens (None: the model's block_size) for
        as many requests as ran at once."""
        c = self.cache
        if max_len is None:
            max_len = self.model.config.block_size
        max_len = check_int(max_len, "max_len", 1)
        peak = c.allocator.peak
        return MemoryReport(
            c.page_size, c.page_bytes, c.token_bytes, peak,
            self.peak_requests, max_len, peak * c.page_bytes,
            self.peak_requests * max_len * c.token_bytes)


def generate(model, prompts, max_new_tokens, *, prefix=0, arrivals=None,
             page_size: int = 16, num_pages: int | None = None,
             cascade: bool = True, backend: str = "auto", progress=None):
    """Generate greedily for several prompts with an :class:`Engine`.

    ``prompts``: lists of token ids; ``max_new_tokens``, ``prefix`` and
    ``arrivals``: an int for all, or one per prompt. ``num_pages`` (None:
    enough for every request at once). Returns each prompt followed by
    its new tokens, as lists, and the engine (for :meth:`Engine.memory`).

    Explained in: notebooks/10_serving.
    Tested in: tests/serving/test_engine.py.
    """
    n = len(prompts)

    def each(x, name):
        if not isinstance(x, (list, tuple)):
            return [x] * n
        if len(x) != n:
            raise ValueError(f"{name} must be an int or {n} ints (one "
                             f"per prompt), got {len(x)}")
        return list(x)

    page_size = check_int(page_size, "page_size", 1)
    reqs = [Request(p, m, f, a) for p, m, f, a in zip(
        prompts, each(max_new_tokens, "max_new_tokens"),
        each(prefix, "prefix"), each(arrivals or 0, "arrivals"))]
    if num_pages is None:
        num_pages = sum(-(-(len(r.prompt) + r.max_new_tokens) // page_size)
                        for r in reqs)
    engine = Engine(model, num_pages=max(1, num_pages),
                    page_size=page_size, cascade=cascade, backend=backend)
    return engine.run(reqs, progress=progress), engine
