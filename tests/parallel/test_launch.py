"""flashlib.parallel.launch.run_local: gloo processes on 127.0.0.1, each rank's result in order, and a
clear error (never a hang) when a rank raises, dies or hangs.

The functions the processes run live at the top level of this module: "spawn" imports them by name.
"""
import os
import time

import pytest
import torch
import torch.distributed as dist

from flashlib.parallel.launch import run_local


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
    for timeout in (0, -5, float("nan"), "60", float("inf"), 1e300, True):   # inf: timedelta overflowed
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            run_local(_whoami, 2, 1.0, timeout=timeout)
    with pytest.raises(TypeError, match="must be picklable"):
        run_local(_whoami, 2, (x for x in range(3)))                     # a generator
