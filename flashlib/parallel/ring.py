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

from .. import backends
from ..validation import check_flag, check_scale, check_tensors

__all__ = ["ring_attention", "shard", "unshard", "chunk_ids", "merge_partials", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunk_ids(rank: int, world: int, layout: str = "contiguous") -> list[int]:
    """The global sequence chunks held by ``rank``: ``[rank]`` of ``world`` (contiguous) or
    ``[rank, 2·world − 1 − rank]`` of ``2·world`` (zigzag).

    Explained in: notebooks/10_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    _check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def shard(x: torch.Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = -2):
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (length divisible by the chunks).

    Explained in: notebooks/10_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    n_chunks = world * len(chunk_ids(0, world, layout))
    if x.shape[dim] % n_chunks:
        raise ValueError(f"x's sequence length {x.shape[dim]} must be divisible by {n_chunks} "
                         f"({layout} layout over {world} ranks)")
    chunks = x.chunk(n_chunks, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, world, layout)], dim=dim)


def unshard(shards, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard`).

    Explained in: notebooks/10_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
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

    Explained in: notebooks/10_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
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
        backend: the flashlib backend for the per-block attention ("auto", "reference", "triton", ...;
            :mod:`flashlib.backends`).

    Returns:
        ``o`` ``(B, H, N/world, d)``, this rank's shard of the output; differentiable.

    Raises:
        RuntimeError: no initialized process group, or a peer died / timed out (after the group's
            timeout) — never a silent hang past it.
        ValueError: shards of different shapes on different ranks, a bad layout, bad tensors.

    Explained in: notebooks/10_beyond_one_gpu.
    Tested in: tests/parallel/test_ring.py.
    """
    check_tensors(q, k, v)                        # flashlib's one validator, as flashlib.attention's
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k shards must have the same length, got q {tuple(q.shape)} and "
                         f"k {tuple(k.shape)}")
    causal = check_flag(causal, "causal")
    scale = check_scale(scale, q.shape[-1])
    _check_layout(layout)
    ring = _Ring(group)
    if q.shape[2] % len(chunk_ids(0, ring.world, layout)):
        raise ValueError(f"with the {layout} layout each shard holds 2 chunks: the shard length "
                         f"{q.shape[2]} must be even")
    ring.check_same_shapes(q, k, v, causal, scale, layout)
    chosen = backends.resolve(backend, q, "attention")
    return _RingAttention.apply(q, k, v, causal, scale, ring, layout, chosen)
