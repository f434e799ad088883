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

Explained in: notebooks/12_beyond_one_gpu.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import backends
from ..validation import check_flag, check_int, check_scale, check_tensors
from ..states import merge_states

__all__ = ["ring_attention", "shard", "unshard", "chunk_ids", "merge_partials", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_rank(rank, world) -> tuple[int, int]:
    world = check_int(world, "world", 1, why=" (the number of ranks)")
    return check_int(rank, "rank", 0, world - 1, why=f" (a rank of a world of {world})"), world


def _check_dim(x, dim) -> int:
    """``dim`` as an index of one of ``x``'s dimensions (negative counts from the end)."""
    check_int(dim, "dim", -x.dim(), x.dim() - 1, why=f" (a dim of a {x.dim()}-D tensor)")
    return int(dim)


def chunk_ids(rank: int, world: int, layout: str = "contiguous") -> list[int]:
    """The global sequence chunks held by ``rank``: ``[rank]`` of ``world``
    (contiguous) or ``[rank, 2·world − 1 − rank]`` of ``2·world`` (zigzag).

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    _check_layout(layout)
    rank, world = _check_rank(rank, world)
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world - 1 - rank]


def shard(x: torch.Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = -2):
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (length divisible by the chunks).

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    mine = chunk_ids(rank, world, layout)                 # checks rank, world and layout
    n_chunks = world * len(mine)
    if x.dim() == 0:
        raise ValueError("x must have a sequence dim to shard, got a 0-D tensor")
    dim = _check_dim(x, dim)
    if x.shape[dim] % n_chunks:
        raise ValueError(f"x's sequence length {x.shape[dim]} must be divisible by {n_chunks} "
                         f"({layout} layout over {world} ranks)")
    chunks = x.split(x.shape[dim] // n_chunks, dim=dim) if x.shape[dim] else [x] * n_chunks
    return torch.cat([chunks[c] for c in mine], dim=dim)


def unshard(shards, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard`).

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    _check_layout(layout)
    if not isinstance(shards, (list, tuple)):
        raise TypeError(f"shards must be a non-empty list of tensors, one per rank, got "
                        f"{type(shards).__name__}")
    if not shards:
        raise ValueError("shards must be a non-empty list of tensors, one per rank, got an empty "
                         f"{type(shards).__name__}")
    for rank, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"shards[{rank}] must be a torch.Tensor, got {type(s).__name__}")
        if s.shape != shards[0].shape:
            raise ValueError(f"every shard must have the shape of shards[0] {tuple(shards[0].shape)}, "
                             f"got shards[{rank}] {tuple(s.shape)}")
    if shards[0].dim() == 0:
        raise ValueError("shards must have a sequence dim, got 0-D tensors")
    dim = _check_dim(shards[0], dim)
    world = len(shards)
    per_rank = len(chunk_ids(0, world, layout))
    if shards[0].shape[dim] % per_rank:
        raise ValueError(f"with the {layout} layout each shard holds {per_rank} chunks: its length "
                         f"{shards[0].shape[dim]} (dim {dim}) must be divisible by {per_rank}")
    placed = {}
    for rank, s in enumerate(shards):
        for c, piece in zip(chunk_ids(rank, world, layout), s.chunk(per_rank, dim=dim)):
            placed[c] = piece
    return torch.cat([placed[c] for c in range(world * per_rank)], dim=dim)


def merge_partials(o_a, lse_a, o_b, lse_b):
    """Merge two partial attentions over disjoint keys (Flash-Decoding's
    combine for two parts).

    ``lse = logaddexp(lse_a, lse_b)``,
    ``o = exp(lse_a − lse) o_a + exp(lse_b − lse) o_b``; where both are empty
    (``lse = −inf``) the result is ``o = 0``, ``lse = −inf``. Shapes
    ``(..., N, d)``, ``(..., N)``. It is :func:`flashlib.merge_states`, the
    one merge of attention states (chapter 10), and the formula of
    :func:`flashlib.ladder.decoding.combine`.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    if isinstance(o_a, torch.Tensor) and o_a.dim() < 2:
        raise ValueError(f"o_a must have shape (..., N, d), at least 2 dims, "
                         f"got {tuple(o_a.shape)}")
    # the one merge of attention states (flashlib.states, chapter 10)
    return merge_states(o_a, lse_a, o_b, lse_b)


def _mode(a: int, b: int, causal: bool) -> str:
    """How query chunk ``a`` attends to key chunk ``b``: "full", "causal"
    (diagonal) or "skip"."""
    if not causal or b < a:
        return "full"
    return "causal" if a == b else "skip"


class _Ring:
    """The ring of one process group: who sends to whom, and the exchange itself."""

    def __init__(self, group):
        if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(f"group must be a torch.distributed process group (dist.new_group(...)) or "
                            f"None for the world, got {type(group).__name__} {group!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ring_attention needs an initialized process group: call "
                               "torch.distributed.init_process_group(...) first")
        self.group = group if group is not None else dist.group.WORLD
        try:
            self.ranks = dist.get_process_group_ranks(self.group)
        except (KeyError, ValueError, RuntimeError) as e:   # a group destroyed, or of another world
            raise ValueError(f"group must be a live process group of this world, got {group!r} "
                             f"({type(e).__name__}: {e})") from None
        self.world = len(self.ranks)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError(f"group must include this process (global rank {dist.get_rank()}), "
                             f"got a group of ranks {self.ranks}")

    def rotate(self, tensors):
        """Send ``tensors`` to the next rank and receive the previous rank's;
        returns the received."""
        if self.world == 1:                  # a ring of one: nothing travels
            return list(tensors)
        nxt = self.ranks[(self.rank + 1) % self.world]
        prv = self.ranks[(self.rank - 1) % self.world]
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group)
               for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, self.group) for r in recv]
        try:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        except RuntimeError as e:
            # a dead or hung peer: gloo and NCCL raise when the timeout expires
            raise RuntimeError(
                f"ring_attention on rank {self.rank}: exchanging K/V with "
                f"rank {prv} and rank {nxt} failed — a peer died or timed "
                f"out ({e})") from e
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
        # the accumulators: fp32 (fp64 for fp64)
        acc = torch.promote_types(q.dtype, torch.float32)
        qs = _split(q, len(mine))                  # (B, H, c, d) per chunk
        o = [torch.zeros(qa.shape, dtype=acc, device=q.device) for qa in qs]
        lse = [torch.full(qa.shape[:-1], float("-inf"), dtype=acc,
                          device=q.device) for qa in qs]
        kv = (k, v)
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world    # whose K/V we hold
            held = chunk_ids(src, ring.world, layout)
            n = len(held)
            for ks, vs, b in zip(_split(kv[0], n), _split(kv[1], n), held):
                for i, a in enumerate(mine):
                    mode = _mode(a, b, causal)
                    if mode == "skip":
                        continue
                    o_ab, lse_ab = backend.forward(
                        qs[i], ks, vs, causal=mode == "causal", scale=scale)
                    o[i], lse[i] = merge_partials(o[i], lse[i], o_ab.to(acc),
                                                  lse_ab.to(acc))
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
        qs, os_, dos = _split(q, n), _split(o, n), _split(do, n)
        lses = list(lse.chunk(n, dim=-1))
        dq = [torch.zeros(qa.shape, dtype=acc, device=q.device) for qa in qs]
        kv = (k, v)
        dkv = (torch.zeros(k.shape, dtype=acc, device=k.device),
               torch.zeros(v.shape, dtype=acc, device=v.device))
        for step in range(ring.world):
            src = (ring.rank - step) % ring.world    # whose K/V we hold
            held = chunk_ids(src, ring.world, layout)
            m = len(held)
            dks, dvs = _split(dkv[0], m), _split(dkv[1], m)
            pairs = zip(_split(kv[0], m), _split(kv[1], m), held)
            for j, (ks, vs, b) in enumerate(pairs):
                for i, a in enumerate(mine):
                    mode = _mode(a, b, causal)
                    if mode == "skip":
                        continue
                    g = backend.backward(qs[i], ks, vs, os_[i], lses[i], dos[i],
                                         causal=mode == "causal", scale=scale)
                    dq[i] += g[0].to(acc)
                    dks[j] += g[1].to(acc)
                    dvs[j] += g[2].to(acc)
            dkv = (torch.cat(dks, dim=-2), torch.cat(dvs, dim=-2))
            if step < ring.world - 1:
                # K/V and their gradients travel on
                *kv, dk_, dv_ = ring.rotate([*kv, *dkv])
                kv, dkv = tuple(kv), (dk_, dv_)
            else:
                # the last hop: the gradients go home
                dkv = tuple(ring.rotate(list(dkv)))
        dq = torch.cat(dq, dim=-2).to(q.dtype)
        return (dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)


def ring_attention(q, k, v, *, causal=False, group=None, layout="contiguous",
                   scale=None, backend="auto"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Args:
        q: ``(B, H, N/world, d)`` — this rank's shard of the queries (see
            :func:`shard`).
        k, v: ``(B, Hkv, N/world, d)`` — this rank's shards of the keys and
            values (GQA allowed).
        causal: causal over the *global* sequence (Nq = Nk globally, so
            top-left = bottom-right).
        group: a torch.distributed process group (default: the world). Its
            backend moves the shards: gloo on CPUs, NCCL on GPUs.
        layout: "contiguous" (rank r holds chunk r) or "zigzag" (chunks r and
            2·world−1−r; balances causal work). Shard and unshard tensors
            with :func:`shard` and :func:`unshard`.
        scale: default ``d ** -0.5`` (d is the head dim).
        backend: the flashlib backend for the per-block attention ("auto",
            "reference", "triton", ...; :mod:`flashlib.backends`).

    Returns:
        ``o`` ``(B, H, N/world, d)``, this rank's shard of the output;
        differentiable.

    Raises:
        RuntimeError: no initialized process group, or a peer died / timed
            out (after the group's timeout) — never a silent hang past it.
        ValueError: shards of different shapes on different ranks, a bad
            layout, bad tensors, a group this process is not in.
        TypeError: ``group`` not a process group (a name such as "world" is
            not one), bad tensors.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    # flashlib's one validator, as flashlib.attention's
    check_tensors(q, k, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k shards must have the same length, "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, q.shape[-1])
    _check_layout(layout)
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    ring = _Ring(group)
    if q.shape[2] % len(chunk_ids(0, ring.world, layout)):
        raise ValueError(f"with the {layout} layout each shard holds 2 chunks: "
                         f"the shard length {q.shape[2]} must be even")
    ring.check_same_shapes(q, k, v, causal, scale, layout)
    chosen = backends.resolve(backend, q, "attention")
    return _RingAttention.apply(q, k, v, causal, scale, ring, layout, chosen)
