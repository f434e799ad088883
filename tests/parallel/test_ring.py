"""Ring attention on 2 and 4 CPU processes (gloo) against single-process attention."""
import datetime
import os
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashlib
from flashlib.parallel.ring import chunk_ids, merge_partials, ring_attention, shard, unshard

CASES = [  # (causal, layout, H, Hkv, shard length, d)
    (False, "contiguous", 2, 2, 5, 8),
    (True, "contiguous", 2, 1, 6, 8),
    (True, "zigzag", 4, 2, 6, 40),
    (False, "zigzag", 1, 1, 4, 3),
]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=20))


def _ring_worker(rank, world, port, results):
    try:
        _init(rank, world, port)
        errors = []
        for causal, layout, h, hkv, n_local, d in CASES:
            g = torch.Generator().manual_seed(0)
            n = n_local * world
            q = torch.randn(2, h, n, d, generator=g, dtype=torch.float64)
            k = torch.randn(2, hkv, n, d, generator=g, dtype=torch.float64)
            v = torch.randn(2, hkv, n, d, generator=g, dtype=torch.float64)
            do = torch.randn(2, h, n, d, generator=g, dtype=torch.float64)
            # single-process truth on the full sequence
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            o_full = flashlib.attention(*full, causal=causal, backend="reference")
            o_full.backward(do)
            # this rank's shards through the ring
            mine = [shard(x, rank, world, layout=layout).requires_grad_() for x in (q, k, v)]
            o = ring_attention(*mine, causal=causal, layout=layout)
            o.backward(shard(do, rank, world, layout=layout))
            pairs = [("o", o, o_full)] + [(f"d{n}", m.grad, f.grad)
                                          for n, m, f in zip("qkv", mine, full)]
            for name, got, want in pairs:
                want = shard(want, rank, world, layout=layout)
                err = (got - want).abs().max().item()
                if not err < 1e-10:
                    errors.append(f"{causal=} {layout=} {name}: max error {err:.2e}")
        results[rank] = errors
        dist.destroy_process_group()
    except Exception:
        results[rank] = [traceback.format_exc()]


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_single_process(world):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ring_worker, args=(world, _free_port(), results), nprocs=world, join=True)
        assert sorted(results.keys()) == list(range(world))
        for rank in range(world):
            assert results[rank] == [], f"rank {rank}: {results[rank]}"


def _dying_worker(rank, world, port, results):
    _init(rank, world, port)
    if rank == 1:
        os._exit(3)                                    # a rank that dies before the ring starts
    x = torch.randn(1, 1, 4, 8)
    t0 = time.monotonic()
    try:
        ring_attention(x, x, x)
        results[rank] = "no error"
    except Exception as e:                             # noqa: BLE001 - the test inspects it
        results[rank] = f"{type(e).__name__}: {e} after {time.monotonic() - t0:.0f}s"


def test_dead_rank_gives_a_clear_error_not_a_hang():
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.spawn(_dying_worker, args=(2, _free_port(), results), nprocs=2, join=False)
        deadline = time.monotonic() + 90
        while 0 not in results and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in ctx.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        assert 0 in results, "rank 0 hung for 90 s after its peer died"
        assert results[0].startswith("RuntimeError: ring_attention on rank 0"), results[0]
        assert "a peer died or timed out" in results[0]


def test_shard_unshard_round_trip_and_layouts():
    x = torch.arange(2 * 16).reshape(1, 1, 16, 2)
    for layout in ("contiguous", "zigzag"):
        shards = [shard(x, r, 4, layout=layout) for r in range(4)]
        assert torch.equal(unshard(shards, layout=layout), x)
    assert chunk_ids(1, 4, "zigzag") == [1, 6]
    with pytest.raises(ValueError, match="layout must be one of"):
        chunk_ids(0, 2, "striped")
    with pytest.raises(ValueError, match="divisible by 8"):
        shard(torch.zeros(1, 1, 12, 2), 0, 4, layout="zigzag")


def test_merge_partials_equals_decoding_combine():
    import numpy as np
    from flashlib.ladder import decoding
    g = torch.Generator().manual_seed(1)
    o = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)
    lse = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    lse[1, 0, 2] = float("-inf")
    lse[:, 1, 3] = float("-inf")                       # both parts empty for one row
    o_m, lse_m = merge_partials(o[0], lse[0], o[1], lse[1])
    o_c, lse_c = decoding.combine(o.numpy(), lse.numpy())
    np.testing.assert_allclose(o_m.numpy(), o_c, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isneginf(lse_m.numpy()), np.isneginf(lse_c))
    assert not torch.isnan(o_m).any()


def test_needs_a_process_group():
    x = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        ring_attention(x, x, x)


def _mismatch_worker(rank, world, port, results):
    _init(rank, world, port)
    try:
        x = torch.randn(1, 1, 4, 8, dtype=torch.float32 if rank == 0 else torch.float64)
        ring_attention(x, x, x)
        results[rank] = "no error"
    except Exception as e:                             # noqa: BLE001 - the test inspects it
        results[rank] = f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_get_a_clear_error():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_mismatch_worker, args=(2, _free_port(), results), nprocs=2, join=True)
        for rank in range(2):
            assert results[rank].startswith("ValueError: ring_attention: every rank must pass"), \
                results[rank]


def _single_worker(rank, world, port, results):
    _init(rank, world, port)
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    o = ring_attention(q, q, q, causal=True)
    o.sum().backward()
    want = flashlib.attention(q.detach(), q.detach(), q.detach(), causal=True, backend="reference")
    results[rank] = float((o - want).abs().max()), bool(torch.isfinite(q.grad).all())
    dist.destroy_process_group()


def test_a_ring_of_one_rank():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_single_worker, args=(1, _free_port(), results), nprocs=1, join=True)
        err, finite = results[0]
        assert err < 1e-12 and finite
