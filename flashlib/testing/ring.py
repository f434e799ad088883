"""The ring attention harness: every rank checks its shard against single-process attention.

:func:`check_against_single_process` runs on every rank of a process group (started, on one machine,
by :func:`flashlib.parallel.launch.run_local`): ring attention and its backward on this rank's shard,
against :func:`flashlib.attention` on the whole sequence in this one process, the float64 oracle and
plain PyTorch in the same dtype — and it counts the blocks the ring hands to the attention backend.

Explained in: notebooks/12_beyond_one_gpu.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import backends
from ..api import attention
from ..parallel.ring import _check_layout, _check_rank, ring_attention, shard
from ..validation import check_int
from ..validation import MAX_HEAD_DIM, check_flag
from . import plain_torch_attention, reference_gqa

__all__ = ["check_against_single_process", "check_cases"]


def _check_case(rank, world, causal, layout, batch, heads, kv_heads,
                shard_len, head_dim, dtype, seed, backend):
    """The arguments of :func:`check_against_single_process`, checked
    (TypeError / ValueError naming the argument, RuntimeError without a
    process group of ``world`` ranks); returns ``(rank, world, causal)``."""
    rank, world = _check_rank(rank, world)
    causal = check_flag(causal, "causal")
    _check_layout(layout)
    for name, value in (("batch", batch), ("heads", heads),
                        ("kv_heads", kv_heads), ("shard_len", shard_len)):
        check_int(value, name, 1)
    check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads={heads} (GQA), "
                         f"got {kv_heads}")
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"shard_len must be even with the zigzag layout "
                         f"(each shard holds 2 chunks), got {shard_len}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32,
                     torch.float64):
        raise TypeError(f"dtype must be torch.float16, bfloat16, float32 or "
                        f"float64, got {dtype!r}")
    check_int(seed, "seed", -2 ** 63, 2 ** 64 - 1,
              why=" (torch.Generator.manual_seed's range)")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, "
                        f"got {type(backend).__name__}")
    live = dist.is_available() and dist.is_initialized()
    world_now = dist.get_world_size() if live else None
    if world_now != world:
        raise RuntimeError(f"check_against_single_process needs an initialized "
                           f"process group of {world} ranks (use run_local), "
                           f"got {world_now}")
    return rank, world, causal


def _counting(base, blocks: dict):
    """``base`` (a :class:`flashlib.backends.Backend`) that counts its
    forward and backward calls in ``blocks``."""
    def counted_forward(*a, **kw):
        blocks["forward"] += 1
        return base.forward(*a, **kw)

    def counted_backward(*a, **kw):
        blocks["backward"] += 1
        return base.backward(*a, **kw)

    return backends.Backend(f"counted-{base.name}", counted_forward,
                            counted_backward, base.decode, base.check,
                            f"{base.name}, counting calls")


def _inputs(n, batch, heads, kv_heads, head_dim, dtype, seed, causal):
    """The same full ``q, k, v, dO`` on every rank, drawn from ``seed`` in
    float64 and cast to ``dtype``, and the float64 oracle's
    ``[o, dq, dk, dv]``."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    q = torch.randn(batch, heads, n, head_dim, **f64)
    k = torch.randn(batch, kv_heads, n, head_dim, **f64)
    v = torch.randn(batch, kv_heads, n, head_dim, **f64)
    do = torch.randn(batch, heads, n, head_dim, **f64)
    ref_o, _, ref_grads = reference_gqa(q, k, v, causal=causal, do=do)
    qkvdo = tuple(x.to(dtype) for x in (q, k, v, do))
    return qkvdo, [ref_o] + list(ref_grads[:3])


def _report(rank, world, layout, ring, single, baseline, oracle, blocks):
    """The dict :func:`check_against_single_process` returns, from the
    ``[o, dq, dk, dv]`` of the ring (this rank's shard), the single process,
    plain PyTorch and the oracle (whole sequences)."""
    def part(x):
        x = torch.as_tensor(x).detach()
        return shard(x, rank, world, layout=layout).double()

    def err(got, want):
        return float((got.detach().double() - want).abs().max())

    names = ("o", "dq", "dk", "dv")
    ring, single, baseline, oracle = (dict(zip(names, x)) for x in
                                      (ring, single, baseline, oracle))
    return {
        "max_error": {i: err(ring[i], part(single[i])) for i in names},
        "oracle_error": {i: err(ring[i], part(oracle[i])) for i in names},
        "baseline_error": {i: err(part(baseline[i]), part(oracle[i]))
                           for i in names},
        "blocks": blocks,
    }


def check_against_single_process(rank, world, causal, layout, *, batch=2,
                                 heads=4, kv_heads=2, shard_len=6,
                                 head_dim=16, dtype=torch.float64, seed=0,
                                 backend="auto") -> dict:
    """Ring attention on this rank's shard against single-process
    ``flashlib.attention``, run on every rank of a process group (e.g. by
    :func:`flashlib.parallel.launch.run_local`).

    Every rank draws the same full ``q (batch, heads, N, head_dim)``,
    ``k, v (batch, kv_heads, N, head_dim)`` and ``dO`` from ``seed``
    (``N = world · shard_len``). Returns, for this rank's shard:
    ``"max_error"`` (``{"o", "dq", "dk", "dv"}``, against the single-process
    result), ``"oracle_error"`` (against the float64 oracle),
    ``"baseline_error"`` (plain PyTorch attention in the same dtype against
    the oracle: the base of the error rule, 2x for o, 3x for gradients) and
    ``"blocks"`` (``{"forward", "backward"}``: the blocks this rank handed to
    the attention backend, counted while the ring ran).

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/testing/test_testing_ring.py.
    """
    rank, world, causal = _check_case(rank, world, causal, layout, batch,
                                      heads, kv_heads, shard_len, head_dim,
                                      dtype, seed, backend)
    (q, k, v, do), oracle = _inputs(world * shard_len, batch, heads,
                                    kv_heads, head_dim, dtype, seed, causal)

    # one process, the whole sequence
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    o_full = attention(*full, causal=causal, backend=backend)
    o_full.backward(do)
    # plain PyTorch: the base of the error rule
    plain = [x.clone().requires_grad_() for x in (q, k, v)]
    o_plain = plain_torch_attention(*plain, causal=causal)
    o_plain.backward(do)

    # the ring, on this rank's shard, counting the blocks it computes
    blocks = {"forward": 0, "backward": 0}
    counted = _counting(backends.resolve(backend, q, "attention"), blocks)
    with backends.registered(counted):   # known by name while the ring runs
        mine = [shard(x, rank, world, layout=layout).requires_grad_()
                for x in (q, k, v)]
        o = ring_attention(*mine, causal=causal, layout=layout,
                           backend=counted.name)
        o.backward(shard(do, rank, world, layout=layout))

    ring = [o] + [x.grad for x in mine]
    single = [o_full] + [x.grad for x in full]
    baseline = [o_plain] + [x.grad for x in plain]
    return _report(rank, world, layout, ring, single, baseline, oracle,
                   blocks)


def check_cases(rank, world, cases) -> list:
    """:func:`check_against_single_process` for each dict of keyword arguments in ``cases`` (each
    with ``causal`` and ``layout``), in one process group; returns the list of its results.

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/testing/test_testing_ring.py.
    """
    if isinstance(cases, (str, dict)) or not hasattr(cases, "__iter__"):
        raise TypeError(f"cases must be a list of dicts of keyword arguments, got {type(cases).__name__}")
    cases = list(cases)
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise TypeError(f"cases[{i}] must be a dict of keyword arguments, got {type(case).__name__}")
        missing = [key for key in ("causal", "layout") if key not in case]
        if missing:
            raise ValueError(f"cases[{i}] must name causal and layout, missing {missing}: {case!r}")
    return [check_against_single_process(rank, world, **case) for case in cases]
