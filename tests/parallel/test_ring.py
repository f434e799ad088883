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


# ---- careful-user inputs: a TypeError or ValueError naming the argument (before: a KeyError for
# group="world", an IndexError for shard(x, 5, 4) or dim=7, a ZeroDivisionError for world=0, a
# shard of rank -1 returned as if it were valid, torch's broadcast error from merge_partials) ----
X = torch.arange(16.0).reshape(1, 1, 8, 2)
BAD_HELPER_CALLS = [
    ("shard rank past world", lambda: shard(X, 5, 4), ValueError, r"rank must be an int from 0 to 3 .*got 5"),
    ("shard rank -1", lambda: shard(X, -1, 4), ValueError, r"rank must be an int from 0 to 3 .*got -1"),
    ("shard world 0", lambda: shard(X, 0, 0), ValueError, r"world must be an int >= 1 .*got 0"),
    ("shard world 2.5", lambda: shard(X, 0, 2.5), TypeError, r"world must be an int, got float 2.5"),
    ("shard rank True", lambda: shard(X, True, 2), TypeError, r"rank must be an int, got bool"),
    ("shard rank '0'", lambda: shard(X, "0", 2), TypeError, r"rank must be an int, got str"),
    ("shard dim 7", lambda: shard(X, 0, 2, dim=7), ValueError, r"dim must be an int from -4 to 3 .*got 7"),
    ("shard dim -5", lambda: shard(X, 0, 2, dim=-5), ValueError, r"dim must be .*got -5"),
    ("shard dim 1.0", lambda: shard(X, 0, 2, dim=1.0), TypeError, r"dim must be an int, got float"),
    ("shard a list", lambda: shard([1, 2], 0, 2), TypeError, r"x must be a torch.Tensor, got list"),
    ("shard a 0-D tensor", lambda: shard(torch.tensor(1.0), 0, 1), ValueError, r"x must have a sequence dim"),
    ("shard layout None", lambda: shard(X, 0, 2, layout=None), ValueError, r"layout must be one of"),
    ("shard layout list", lambda: shard(X, 0, 2, layout=["zigzag"]), ValueError, r"layout must be one of"),
    ("shard indivisible", lambda: shard(X, 0, 3), ValueError, r"divisible by 3"),
    ("chunk_ids rank past world", lambda: chunk_ids(3, 2), ValueError, r"rank must be an int from 0 to 1"),
    ("chunk_ids world -1", lambda: chunk_ids(0, -1), ValueError, r"world must be an int >= 1"),
    ("unshard []", lambda: unshard([]), ValueError, r"shards must be a non-empty list of tensors.*got an empty list"),
    ("unshard a tensor", lambda: unshard(X), TypeError, r"shards must be a non-empty list .*got Tensor"),
    ("unshard a list of lists", lambda: unshard([[1.0], [2.0]]), TypeError, r"shards\[0\] must be a torch.Tensor"),
    ("unshard shapes differ", lambda: unshard([X, X[..., :4, :]]), ValueError,
     r"every shard must have the shape of shards\[0\] \(1, 1, 8, 2\), got shards\[1\] \(1, 1, 4, 2\)"),
    ("unshard zigzag odd", lambda: unshard([X[..., :3, :]], layout="zigzag"), ValueError,
     r"each shard holds 2 chunks: its length 3 .* divisible by 2"),
    ("unshard dim 4", lambda: unshard([X, X], dim=4), ValueError, r"dim must be an int from -4 to 3"),
    ("unshard layout", lambda: unshard([X, X], layout="ring"), ValueError, r"layout must be one of"),
    ("merge o_b shape", lambda: merge_partials(X, X[..., 0], X[..., :4, :], X[..., :4, 0]), ValueError,
     r"o_b must have the shape of o_a \(1, 1, 8, 2\), got \(1, 1, 4, 2\)"),
    ("merge lse shape", lambda: merge_partials(X, X[..., :1], X, X[..., 0]), ValueError,
     r"lse_a must have shape \(1, 1, 8\) .*got \(1, 1, 8, 1\)"),
    ("merge broadcastable lse", lambda: merge_partials(X, X[..., 0], X, X[..., :1, 0]), ValueError,
     r"lse_b must have shape \(1, 1, 8\)"),
    ("merge numpy", lambda: merge_partials(X.numpy(), X[..., 0], X, X[..., 0]), TypeError,
     r"o_a must be a torch.Tensor, got ndarray"),
    ("merge int tensors", lambda: merge_partials(X.long(), X[..., 0], X, X[..., 0]), TypeError,
     r"o_a must be a floating-point tensor, got torch.int64"),
    ("merge 1-D", lambda: merge_partials(X[0, 0, 0], X[0, 0, 0, :0], X[0, 0, 0], X[0, 0, 0, :0]), ValueError,
     r"o_a must have shape \(..., N, d\), at least 2 dims"),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in BAD_HELPER_CALLS],
                         ids=[c[0] for c in BAD_HELPER_CALLS])
def test_helpers_refuse_bad_arguments_naming_them(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_helpers_take_numpy_integers_and_empty_sequences():
    import numpy as np
    assert chunk_ids(np.int64(1), np.int32(4), "zigzag") == [1, 6]
    assert torch.equal(shard(X, np.int64(1), 2, dim=np.int64(-2)), X[..., 4:, :])
    assert torch.equal(shard(X, 1, 2, dim=-1), X[..., 1:])
    empty = torch.zeros(1, 1, 0, 2)
    assert shard(empty, 1, 2).shape == (1, 1, 0, 2)
    assert unshard([empty, empty]).shape == (1, 1, 0, 2)


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (the world), destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("group, error, message", [
    ("world", TypeError, r"group must be a torch.distributed process group .*got str 'world'"),
    (0, TypeError, r"group must be a torch.distributed process group .*got int 0"),
    ([0], TypeError, r"group must be .*got list \[0\]"),
])
def test_ring_attention_refuses_a_group_that_is_no_process_group(group, error, message, world_of_one):
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(error, match=message):
        ring_attention(x, x, x, group=group)


def test_ring_attention_refuses_a_destroyed_group_and_takes_a_live_one(world_of_one):
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    group = dist.new_group([0])
    want = flashlib.attention(x, x, x, backend="reference")
    torch.testing.assert_close(ring_attention(x, x, x, group=group), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(ring_attention(x, x, x, group=dist.group.WORLD), want, atol=1e-12, rtol=0)
    dist.destroy_process_group(group)
    with pytest.raises(ValueError, match=r"group must be a live process group of this world"):
        ring_attention(x, x, x, group=group)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(causal="yes"), TypeError, r"causal must be a bool, got str 'yes'"),
    (dict(causal=1), TypeError, r"causal must be a bool, got int 1"),
    (dict(layout="striped"), ValueError, r"layout must be one of \('contiguous', 'zigzag'\), got 'striped'"),
    (dict(layout=None), ValueError, r"layout must be one of"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(scale="0.1"), TypeError, r"scale must be a real number or None, got str"),
    (dict(backend=3), TypeError, r"backend must be a str, got int"),
    (dict(backend="nope"), ValueError, r"backend must be one of .*got 'nope'"),
])
def test_ring_attention_refuses_bad_arguments_naming_them(kwargs, error, message, world_of_one):
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(error, match=message):
        ring_attention(x, x, x, **kwargs)


def test_ring_attention_refuses_bad_tensors_naming_them(world_of_one):
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got ndarray"):
        ring_attention(x.numpy(), x, x)
    with pytest.raises(ValueError, match=r"q and k shards must have the same length"):
        ring_attention(x, x[..., :2, :], x[..., :2, :])
    with pytest.raises(ValueError, match=r"shard length 3 must be even"):
        ring_attention(x[..., :3, :], x[..., :3, :], x[..., :3, :], layout="zigzag")
