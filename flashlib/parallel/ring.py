"""Ring attention over torch.distributed: context parallelism with the Flash-Decoding merge.

Liu, Zaharia & Abbeel (2023), "Ring Attention with Blockwise Transformers". Each rank holds one shard
of the sequence for Q, K and V. K/V shards travel around the ring of ranks
(``batch_isend_irecv``: send to rank + 1, receive from rank - 1); at every step a rank attends its
queries to the K/V shard it holds and merges the partial ``(O, LSE)`` with the same log-sum-exp
rescaling as Flash-Decoding's combine. After ``world`` steps every query has seen every key.

Causal attention skips the blocks that lie entirely in the future. With the *contiguous* layout
(rank r holds chunk r) rank 0 has almost nothing to do and the last rank everything; the *zigzag*
layout gives rank r the chunks r and 2·world − 1 − r of 2·world chunks, which balances the work.

The backward pass goes around the ring again: with the global ``O`` and ``LSE`` saved, each block's
gradient is independent (FlashAttention-2's backward with ``P = exp(S − LSE)`` and
``D = rowsum(dO ∘ O)``), so dQ accumulates locally while dK and dV travel with their K/V shard and are
home after ``world`` rotations.

Explained in: notebooks/10_beyond_one_gpu.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "shard", "unshard", "chunk_ids", "merge_partials", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunk_ids(rank: int, world: int, layout: str = "contiguous") -> list[int]:
    """The global sequence chunks held by ``rank``: ``[rank]`` of ``world`` (contiguous) or
    ``[rank, 2·world − 1 − rank]`` of ``2·world`` (zigzag)."""
    _check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def shard(x: torch.Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = -2):
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (length divisible by the chunks)."""
    n_chunks = world * len(chunk_ids(0, world, layout))
    if x.shape[dim] % n_chunks:
        raise ValueError(f"x's sequence length {x.shape[dim]} must be divisible by {n_chunks} "
                         f"({layout} layout over {world} ranks)")
    chunks = x.chunk(n_chunks, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, layout)], dim=dim)


def unshard(shards, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard`)."""
    world = len(shards)
    per_rank = len(chunk_ids(0, world, layout))
    placed = {}
    for rank, s in enumerate(shards):
        for c, piece in zip(chunk_ids(rank, world, layout), s.chunk(per_rank, dim=dim)):
            placed[c] = piece
    return torch.cat([placed[c] for c in range(world * per_rank)], dim=dim)


def merge_partials(o_a, lse_a, o_b, lse_b):
    """Merge two partial attentions over disjoint keys (Flash-Decoding's combine for two parts).

    ``lse = logaddexp(lse_a, lse_b)``, ``o = exp(lse_a − lse) o_a + exp(lse_b − lse) o_b``; where both
    are empty (``lse = −inf``) the result is ``o = 0``, ``lse = −inf``. Shapes ``(..., N, d)``,
    ``(..., N)``. Same formula as :func:`flashlib.ladder.decoding.combine`.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.where(torch.isneginf(lse_a), torch.zeros_like(lse_a), torch.exp(lse_a - safe))
    w_b = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - safe))
    return w_a[..., None] * o_a + w_b[..., None] * o_b, lse


def _mode(a: int, b: int, causal: bool) -> str:
    """How query chunk ``a`` attends to key chunk ``b``: "full", "causal" (diagonal) or "skip"."""
    if not causal or b < a:
        return "full"
    return "causal" if a == b else "skip"


class _Ring:
    """The ring of one process group: who sends to whom, and the exchange itself."""

    def __init__(self, group):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ring_attention needs an initialized process group: call "
                               "torch.distributed.init_process_group(...) first")
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)
        self.world = len(self.ranks)
        self.rank = dist.get_rank(self.group)

    def rotate(self, tensors):
        """Send ``tensors`` to the next rank and receive the previous rank's; returns the received."""
        if self.world == 1:                      # a ring of one: nothing travels
            return list(tensors)
        nxt = self.ranks[(self.rank + 1) % self.world]
        prv = self.ranks[(self.rank - 1) % self.world]
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, self.group) for r in recv]
        try:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        except RuntimeError as e:   # a dead or hung peer: gloo/NCCL raise when the timeout expires
            raise RuntimeError(f"ring_attention on rank {self.rank}: exchanging K/V with rank {prv} "
                               f"and rank {nxt} failed — a peer died or timed out ({e})") from e
        return recv

    def check_same_shapes(self, q, k, v, causal, scale, layout):
        """Every rank must hold shards of one shape and dtype, and ask for the same attention."""
        dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
        mine = torch.tensor([*q.shape, *k.shape, *v.shape, dtypes.index(q.dtype), causal, scale,
                             LAYOUTS.index(layout)], dtype=torch.float64, device=q.device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            dist.all_gather(every, mine, group=self.group)
        except RuntimeError as e:
            raise RuntimeError(f"ring_attention on rank {self.rank}: could not compare shard shapes "
                               f"with the other ranks — a peer died or timed out ({e})") from e
        for r, other in enumerate(every):
            if not torch.equal(other, mine):
                raise ValueError(f"ring_attention: every rank must pass shards of one shape and dtype "
                                 f"and the same causal, scale and layout; rank {self.rank} has "
                                 f"(q, k, v shapes, dtype, causal, scale, layout) = "
                                 f"{tuple(mine.tolist())} but rank {r} has {tuple(other.tolist())}")


def _split(x, n):
    return list(x.chunk(n, dim=-2))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, ring, layout, backend):
        mine = chunk_ids(ring.rank, ring.world, layout)
        acc = torch.promote_types(q.dtype, torch.float32)            # fp32, or fp64 for fp64
        qs = _split(q, len(mine))                                     # (B, H, c, d) per chunk
        o = [torch.zeros(qa.shape, dtype=acc, device=q.device) for qa in qs]
        lse = [torch.full(qa.shape[:-1], float("-inf"), dtype=acc, device=q.device) for qa in qs]
        kv = (k, v)
        for step in range(ring.world):
            held = chunk_ids((ring.rank - step) % ring.world, ring.world, layout)
            for ks, vs, b in zip(_split(kv[0], len(held)), _split(kv[1], len(held)), held):
                for i, a in enumerate(mine):
                    mode = _mode(a, b, causal)
                    if mode != "skip":
                        o_ab, lse_ab = backend.forward(qs[i], ks, vs, causal=mode == "causal",
                                                       scale=scale)
                        o[i], lse[i] = merge_partials(o[i], lse[i], o_ab.to(acc), lse_ab.to(acc))
            if step < ring.world - 1:
                kv = ring.rotate(kv)
        o, lse = torch.cat(o, dim=-2).to(q.dtype), torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, scale, ring, layout, backend)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, ring, layout, backend = ctx.args
        mine = chunk_ids(ring.rank, ring.world, layout)
        n, acc = len(mine), torch.promote_types(q.dtype, torch.float32)
        qs, os_, lses, dos = _split(q, n), _split(o, n), list(lse.chunk(n, dim=-1)), _split(do, n)
        dq = [torch.zeros(qa.shape, dtype=acc, device=q.device) for qa in qs]
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=acc, device=k.device),
               torch.zeros(v.shape, dtype=acc, device=v.device))
        for step in range(ring.world):
            held = chunk_ids((ring.rank - step) % ring.world, ring.world, layout)
            dks, dvs = _split(dkv[0], len(held)), _split(dkv[1], len(held))
            for j, (ks, vs, b) in enumerate(zip(_split(kv[0], len(held)), _split(kv[1], len(held)),
                                                held)):
                for i, a in enumerate(mine):
                    mode = _mode(a, b, causal)
                    if mode != "skip":
                        g = backend.backward(qs[i], ks, vs, os_[i], lses[i], dos[i],
                                             causal=mode == "causal", scale=scale)
                        dq[i] += g[0].to(acc)
                        dks[j] += g[1].to(acc)
                        dvs[j] += g[2].to(acc)
            dkv = (torch.cat(dks, dim=-2), torch.cat(dvs, dim=-2))
            if step < ring.world - 1:                    # K/V and their gradients travel on
                *kv, dk_, dv_ = ring.rotate([*kv, *dkv])
                kv, dkv = tuple(kv), (dk_, dv_)
            else:                                        # last hop: gradients go home
                dkv = tuple(ring.rotate(list(dkv)))
        return (torch.cat(dq, dim=-2).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q, k, v, *, causal=False, group=None, layout="contiguous", scale=None,
                   backend="auto"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``(B, H, N/world, d)`` — this rank's shard of the queries (see :func:`shard`).
        k, v: ``(B, Hkv, N/world, d)`` — this rank's shards of the keys and values (GQA allowed).
        causal: causal over the *global* sequence (Nq = Nk globally, so top-left = bottom-right).
        group: a torch.distributed process group (default: the world). Its backend moves the
            shards: gloo on CPUs, NCCL on GPUs.
        layout: "contiguous" (rank r holds chunk r) or "zigzag" (chunks r and 2·world−1−r; balances
            causal work). Shard and unshard tensors with :func:`shard` and :func:`unshard`.
        scale: default ``d ** -0.5`` (d is the head dim).
        backend: the flashlib backend for the per-block attention ("auto", "reference", "triton", ...).

    Returns:
        ``o`` ``(B, H, N/world, d)``, this rank's shard of the output; differentiable.

    Raises:
        RuntimeError: no initialized process group, or a peer died / timed out (after the group's
            timeout) — never a silent hang past it.
        ValueError: shards of different shapes on different ranks, a bad layout, bad tensors.

    Explained in: notebooks/10_beyond_one_gpu.
    """
    from .. import api
    for name, x in (("q", q), ("k", k), ("v", v)):
        api._check_tensor(x, name)
    api._check_same(q, {"k": k, "v": v})
    api._check_heads(q, k, v, "k", "v")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k shards must have the same length, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    causal = api._check_flag(causal, "causal")
    scale = api._check_scale(scale, q.shape[-1])
    _check_layout(layout)
    ring = _Ring(group)
    if q.shape[2] % len(chunk_ids(0, ring.world, layout)):
        raise ValueError(f"with the {layout} layout each shard holds 2 chunks: the shard length "
                         f"{q.shape[2]} must be even")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"q must be float16, bfloat16, float32 or float64, got {q.dtype}")
    ring.check_same_shapes(q, k, v, causal, scale, layout)
    chosen = api._resolve_backend(backend, q, "attention")
    return _RingAttention.apply(q, k, v, causal, scale, ring, layout, chosen)


# --------------------------------------------------------------------------------------------------
# A ring on one machine: ``world`` local processes joined by gloo over 127.0.0.1 (notebooks, tests).
# --------------------------------------------------------------------------------------------------

__all__ += ["run_local", "check_against_single_process", "check_cases"]


def _free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_local_worker(rank, world, port, timeout, fn, args, kwargs, results):
    """One process of :func:`run_local`: join the group, run ``fn``, report to the parent.

    Reports ``(rank, True, pickled result)`` or ``(rank, False, (time of the failure, traceback))``,
    *before* leaving the group: a rank that fails first then also reports first, and the parent can
    tell the cause from the peers that failed because of it.
    """
    import datetime
    import pickle
    import time
    import traceback
    try:
        torch.set_num_threads(1)                    # ``world`` processes share this machine's cores
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout))
        # pickled here, by value: a tensor put on a queue as is would be shared through a file
        # descriptor that disappears when this process exits
        report = (rank, True, pickle.dumps(fn(rank, world, *args, **kwargs)))
    except BaseException:                           # noqa: BLE001 - reported to the parent instead
        report = (rank, False, (time.time(), traceback.format_exc()))
    results.put(report)
    if dist.is_initialized():
        if report[1]:
            try:                                    # leave together: a peer may still be reading
                dist.barrier()
            except RuntimeError:                    # a peer failed; the parent stops everyone
                pass
        dist.destroy_process_group()


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def run_local(fn, world, *args, timeout=60, **kwargs) -> list:
    """Run ``fn(rank, world, *args, **kwargs)`` in ``world`` new processes joined by one gloo group.

    The processes are started with the "spawn" method, talk over 127.0.0.1 (a free port), and each
    initializes the default process group (``torch.distributed``, backend gloo, with ``timeout`` for
    every collective) before calling ``fn``; each runs torch with one thread. This is how a notebook
    or a test runs ring attention on a CPU: every rank is a process, as every GPU would be (with
    NCCL).
    From a script, call it under ``if __name__ == "__main__":`` (spawned processes import the
    script); from a notebook, just call it.

    Args:
        fn: an importable function (defined at the top level of a module, not in a notebook or a
            ``__main__`` script, not a lambda): "spawn" starts fresh interpreters that import ``fn``
            by its module and name. Its return value must be picklable (tensors are fine).
        world: the number of processes (ranks), >= 1.
        *args, **kwargs: passed on to ``fn`` after ``rank`` and ``world``; picklable.
        timeout: seconds for the whole run (> 0), also the process group's timeout.

    Returns:
        ``[fn(0, world, ...), fn(1, world, ...), ...]``: the results in rank order.

    Raises:
        TypeError, ValueError: a non-importable ``fn``, a bad ``world`` or ``timeout``.
        RuntimeError: a rank raised (the message holds that rank's traceback; ranks that failed
            after it, usually because it left, are named with their last line) or died without
            reporting (its exit code); the other ranks are stopped rather than left waiting.
        TimeoutError: some rank had not finished after ``timeout`` seconds (all are stopped).

    Explained in: notebooks/10_beyond_one_gpu.
    """
    import multiprocessing
    import numbers
    import pickle
    import queue
    import time
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if module in (None, "__main__", "__mp_main__") or "<" in qualname:
        raise ValueError(f"fn must be importable by new processes (a function defined at the top "
                         f"level of a module), got {qualname or fn!r} from module {module!r}: "
                         f"functions defined in a notebook, a script's __main__, lambdas and "
                         f"nested functions cannot be found by a spawned process")
    if isinstance(world, bool) or not isinstance(world, numbers.Integral) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as e:                          # noqa: BLE001 - re-raised with the reason
        raise TypeError(f"fn and its arguments must be picklable to reach the processes: "
                        f"{e}") from e
    grace = 2.0                     # seconds to wait, after a first failure, for its root cause
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_run_local_worker, name=f"run_local-rank{rank}",
                         args=(rank, world, port, timeout, fn, args, kwargs, results), daemon=True)
             for rank in range(world)]
    done, failed, dead, silent_since = {}, {}, {}, {}
    deadline = time.monotonic() + timeout
    first_failure = None
    try:
        for p in procs:
            p.start()
        while len(done) + len(failed) + len(dead) < world:
            now = time.monotonic()
            if first_failure is not None and now > first_failure + grace:
                break
            if now >= deadline:
                if failed or dead:
                    break
                missing = [r for r in range(world) if r not in done]
                raise TimeoutError(f"run_local: rank(s) {missing} of {world} had not finished "
                                   f"{qualname} after {timeout} s; all were stopped")
            try:
                rank, ok, payload = results.get(timeout=min(0.2, max(deadline - now, 0.01)))
            except queue.Empty:
                for r, p in enumerate(procs):       # died without a word (os._exit, a signal)?
                    if p.exitcode is not None and all(r not in d for d in (done, failed, dead)):
                        if now - silent_since.setdefault(r, now) > 1.0:  # a report in flight?
                            dead[r] = p.exitcode
                            first_failure = first_failure or now
                continue
            if ok:
                done[rank] = pickle.loads(payload)
            else:
                failed[rank] = payload
                first_failure = first_failure or time.monotonic()
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5 if len(done) == world else 0)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        results.close()
        results.join_thread()
    if dead:                                        # a rank that vanished is the likeliest cause
        r = min(dead)
        others = sorted((set(failed) | set(dead)) - {r})
        raise RuntimeError(f"run_local: rank {r} of {world} exited with code {dead[r]} before "
                           f"returning from {qualname}; the other ranks were stopped"
                           + (f" (rank(s) {others} failed too, most likely because of it)"
                              if others else ""))
    if failed:
        r = min(failed, key=lambda rank: failed[rank][0])               # the earliest failure
        after = "".join(f"\n  rank {o}: {_last_line(failed[o][1])}"
                        for o in sorted(failed) if o != r)
        raise RuntimeError(f"run_local: rank {r} of {world} failed in {qualname}; the other ranks "
                           f"were stopped. Rank {r}'s traceback:\n{failed[r][1]}"
                           + (f"Ranks that failed after it (most likely because it left):{after}"
                              if after else ""))
    return [done[r] for r in range(world)]


def check_against_single_process(rank, world, causal, layout, *, batch=2, heads=4, kv_heads=2,
                                 shard_len=6, head_dim=16, dtype=torch.float64, seed=0,
                                 backend="auto") -> dict:
    """Ring attention on this rank's shard against single-process ``flashlib.attention``.

    Run it on every rank of a process group, e.g. ``run_local(check_against_single_process, 4,
    True, "zigzag")``. Every rank draws the same full ``q (batch, heads, N, head_dim)``, ``k, v
    (batch, kv_heads, N, head_dim)`` and ``dO`` from ``seed`` (``N = world · shard_len``), computes
    :func:`flashlib.attention` and its gradients on the whole sequence in this one process, then
    :func:`ring_attention` on its shard (``layout``) and its backward with its shard of ``dO``.

    Returns a dict for this rank:
        ``"max_error"``: ``{"o", "dq", "dk", "dv"}`` max abs difference between the ring's shard and
        the same shard of the single-process result; ``"oracle_error"``: the same against the
        float64 oracle (:func:`flashlib.testing.reference_gqa`); ``"baseline_error"``: the error
        against the oracle of plain PyTorch attention in the same dtype
        (:func:`flashlib.testing.plain_torch_attention`, the baseline of FlashAttention's error
        rule: at most 2x for the output, 3x for gradients); ``"blocks"``: ``{"forward",
        "backward"}``, how many (query chunk, key chunk) blocks this rank handed to the attention
        backend, counted while the ring ran.

    Explained in: notebooks/10_beyond_one_gpu.
    """
    from .. import api, testing
    world_now = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    if world_now != world:
        raise RuntimeError(f"check_against_single_process needs an initialized process group of "
                           f"{world} ranks (use run_local), got {world_now}")
    g = torch.Generator().manual_seed(seed)
    n = world * shard_len
    q = torch.randn(batch, heads, n, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, n, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, n, head_dim, generator=g, dtype=torch.float64)
    do = torch.randn(batch, heads, n, head_dim, generator=g, dtype=torch.float64)
    ref_o, _, ref_grads = testing.reference_gqa(q, k, v, causal=causal, do=do)   # float64 oracle
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))

    full = [x.clone().requires_grad_() for x in (q, k, v)]                 # one process, whole N
    o_full = api.attention(*full, causal=causal, backend=backend)
    o_full.backward(do)
    plain = [x.clone().requires_grad_() for x in (q, k, v)]                # the error rule's base
    o_plain = testing.plain_torch_attention(*plain, causal=causal)
    o_plain.backward(do)

    base = api._resolve_backend(backend, q, "attention")
    blocks = {"forward": 0, "backward": 0}

    def counted_forward(*a, **kw):
        blocks["forward"] += 1
        return base.forward(*a, **kw)

    def counted_backward(*a, **kw):
        blocks["backward"] += 1
        return base.backward(*a, **kw)

    name = f"counted-{base.name}"                  # registered only while this rank's ring runs
    api.register_backend(api.Backend(name, counted_forward, counted_backward, base.decode,
                                     base.check, f"{base.name}, counting calls"))
    try:
        mine = [shard(x, rank, world, layout=layout).requires_grad_() for x in (q, k, v)]
        o = ring_attention(*mine, causal=causal, layout=layout, backend=name)
        o.backward(shard(do, rank, world, layout=layout))
    finally:
        api.BACKENDS.pop(name, None)

    def part(x):
        return shard(torch.as_tensor(x), rank, world, layout=layout).double()

    ring = {"o": o, "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
    single = {"o": o_full, "dq": full[0].grad, "dk": full[1].grad, "dv": full[2].grad}
    baseline = {"o": o_plain, "dq": plain[0].grad, "dk": plain[1].grad, "dv": plain[2].grad}
    oracle = {"o": ref_o, "dq": ref_grads[0], "dk": ref_grads[1], "dv": ref_grads[2]}

    def err(got, want):
        return float((got.detach().double() - want).abs().max())

    return {"max_error": {key: err(ring[key], part(single[key].detach())) for key in ring},
            "oracle_error": {key: err(ring[key], part(oracle[key])) for key in ring},
            "baseline_error": {key: err(part(baseline[key].detach()), part(oracle[key]))
                               for key in ring},
            "blocks": blocks}


def check_cases(rank, world, cases) -> list:
    """:func:`check_against_single_process` for each dict of keyword arguments in ``cases`` (each
    with ``causal`` and ``layout``), in one process group; returns the list of its results.
    Explained in: notebooks/10_beyond_one_gpu."""
    return [check_against_single_process(rank, world, **case) for case in cases]
