"""The ring attention harness: every rank checks its shard against single-process attention.

:func:`check_against_single_process` runs on every rank of a process group (started, on one machine,
by :func:`flashlib.parallel.launch.run_local`): ring attention and its backward on this rank's shard,
against :func:`flashlib.attention` on the whole sequence in this one process, the float64 oracle and
plain PyTorch in the same dtype — and it counts the blocks the ring hands to the attention backend.

Explained in: notebooks/10_beyond_one_gpu.
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


def check_against_single_process(rank, world, causal, layout, *, batch=2, heads=4, kv_heads=2,
                                 shard_len=6, head_dim=16, dtype=torch.float64, seed=0,
                                 backend="auto") -> dict:
    """Ring attention on this rank's shard against single-process ``flashlib.attention``.

    Run it on every rank of a process group, e.g. ``run_local(check_against_single_process, 4,
    True, "zigzag")`` (:func:`flashlib.parallel.launch.run_local`). Every rank draws the same full
    ``q (batch, heads, N, head_dim)``, ``k, v (batch, kv_heads, N, head_dim)`` and ``dO`` from
    ``seed`` (``N = world · shard_len``), computes
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
    Tested in: tests/testing/test_testing_ring.py.
    """
    rank, world = _check_rank(rank, world)
    causal = check_flag(causal, "causal")
    _check_layout(layout)
    for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads), ("shard_len", shard_len)):
        check_int(value, name, 1)
    check_int(head_dim, "head_dim", 1, MAX_HEAD_DIM)
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads={heads} (GQA), got {kv_heads}")
    if layout == "zigzag" and shard_len % 2:
        raise ValueError(f"shard_len must be even with the zigzag layout (each shard holds 2 chunks), "
                         f"got {shard_len}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float16, bfloat16, float32 or float64, got {dtype!r}")
    check_int(seed, "seed", -2 ** 63, 2 ** 64 - 1, why=" (torch.Generator.manual_seed's range)")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
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
    ref_o, _, ref_grads = reference_gqa(q, k, v, causal=causal, do=do)           # float64 oracle
    q, k, v, do = (x.to(dtype) for x in (q, k, v, do))

    full = [x.clone().requires_grad_() for x in (q, k, v)]                 # one process, whole N
    o_full = attention(*full, causal=causal, backend=backend)
    o_full.backward(do)
    plain = [x.clone().requires_grad_() for x in (q, k, v)]                # the error rule's base
    o_plain = plain_torch_attention(*plain, causal=causal)
    o_plain.backward(do)

    base = backends.resolve(backend, q, "attention")
    blocks = {"forward": 0, "backward": 0}

    def counted_forward(*a, **kw):
        blocks["forward"] += 1
        return base.forward(*a, **kw)

    def counted_backward(*a, **kw):
        blocks["backward"] += 1
        return base.backward(*a, **kw)

    counted = backends.Backend(f"counted-{base.name}", counted_forward, counted_backward, base.decode,
                               base.check, f"{base.name}, counting calls")
    with backends.registered(counted):              # known by its name only while the ring runs
        mine = [shard(x, rank, world, layout=layout).requires_grad_() for x in (q, k, v)]
        o = ring_attention(*mine, causal=causal, layout=layout, backend=counted.name)
        o.backward(shard(do, rank, world, layout=layout))

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

    Explained in: notebooks/10_beyond_one_gpu.
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
