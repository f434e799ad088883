"""flashlib.parallel.ring.run_local (gloo processes on 127.0.0.1) and check_against_single_process.

The functions the processes run live at the top level of this module: "spawn" imports them by name.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from flashlib.parallel.ring import _mode, check_cases, chunk_ids, run_local


def _whoami(rank, world, scale, *, offset=0):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)                                 # the group really connects the processes
    return {"rank": rank, "world": world, "dist_rank": dist.get_rank(),
            "dist_world": dist.get_world_size(), "sum": total.item(),
            "tensor": torch.full((2, 3), scale * rank + offset)}


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()                                         # would wait for rank 1 until the timeout


def _exit_on_rank_one(rank, world):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _sleep_on_rank_one(rank, world):
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_local_returns_every_rank_result_in_order():
    results = run_local(_whoami, 3, 10.0, offset=1, timeout=120)
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert (r["world"], r["dist_rank"], r["dist_world"], r["sum"]) == (3, rank, 3, 3.0)
        assert torch.equal(r["tensor"], torch.full((2, 3), 10.0 * rank + 1))   # tensors by value


def _expected_blocks(rank, world, causal, layout):
    """Block pairs ``rank`` hands to the backend: the ring's schedule, from chunk_ids and _mode."""
    mine = chunk_ids(rank, world, layout)
    return sum(_mode(a, b, causal) != "skip"
               for step in range(world) for b in chunk_ids((rank - step) % world, world, layout)
               for a in mine)


def test_check_against_single_process_on_two_ranks():
    cases = [dict(causal=True, layout="contiguous", heads=4, kv_heads=1, shard_len=5, head_dim=40),
             dict(causal=True, layout="zigzag", heads=2, kv_heads=2, shard_len=6, head_dim=59),
             dict(causal=False, layout="zigzag", heads=3, kv_heads=1, shard_len=4, head_dim=8,
                  dtype=torch.float32)]
    results = run_local(check_cases, 2, cases, timeout=120)
    for rank, per_case in enumerate(results):
        for case, r in zip(cases, per_case):
            tol = 1e-10 if case.get("dtype", torch.float64) == torch.float64 else 1e-5
            assert set(r) == {"max_error", "oracle_error", "baseline_error", "blocks"}
            assert set(r["max_error"]) == {"o", "dq", "dk", "dv"}
            for key in r["max_error"]:
                assert r["max_error"][key] < tol, (rank, case, r)
                assert r["oracle_error"][key] < tol, (rank, case, r)
                assert 0 < r["baseline_error"][key] < tol, (rank, case, r)   # rounding, not zero
            want = _expected_blocks(rank, 2, case["causal"], case["layout"])
            assert r["blocks"] == {"forward": want, "backward": want}, (rank, case, r)
    # contiguous causal: rank 0 skips the future block, rank 1 computes both
    assert [per_case[0]["blocks"]["forward"] for per_case in results] == [1, 2]


def test_a_failing_rank_stops_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed in _fail_on_rank_one") as info:
        run_local(_fail_on_rank_one, 2, timeout=300)
    assert "ValueError: boom from rank 1" in str(info.value)
    assert time.monotonic() - t0 < 150, "run_local waited for rank 0's barrier to time out"


def test_a_rank_that_dies_is_reported_with_its_exit_code():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 exited with code 3"):
        run_local(_exit_on_rank_one, 2, timeout=300)
    assert time.monotonic() - t0 < 150


def test_a_hanging_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[.*1.*\] of 2 had not finished"):
        run_local(_sleep_on_rank_one, 2, timeout=6)
    assert time.monotonic() - t0 < 6 + 30


def _nested():
    def inner(rank, world):
        return rank
    return inner


def test_run_local_rejects_what_spawn_cannot_run():
    def main_fn(rank, world):
        return rank
    main_fn.__module__, main_fn.__qualname__ = "__main__", "main_fn"    # as if typed in a notebook
    with pytest.raises(ValueError, match="fn must be importable"):
        run_local(main_fn, 2)
    with pytest.raises(ValueError, match="fn must be importable"):
        run_local(lambda rank, world: rank, 2)
    with pytest.raises(ValueError, match="fn must be importable"):
        run_local(_nested(), 2)
    with pytest.raises(TypeError, match="fn must be a function"):
        run_local("_whoami", 2)
    for world in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="world must be an int >= 1"):
            run_local(_whoami, world, 1.0)
    for timeout in (0, -5, float("nan"), "60"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            run_local(_whoami, 2, 1.0, timeout=timeout)
    with pytest.raises(TypeError, match="must be picklable"):
        run_local(_whoami, 2, (x for x in range(3)))                     # a generator


def test_check_against_single_process_needs_the_group():
    with pytest.raises(RuntimeError, match="initialized process group of 2 ranks"):
        check_cases(0, 2, [dict(causal=False, layout="contiguous")])
