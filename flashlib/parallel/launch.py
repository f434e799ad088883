"""Run a function on ``world`` local processes joined by one torch.distributed group (gloo, 127.0.0.1).

This is how a notebook or a test runs a distributed algorithm — ring attention
(:mod:`flashlib.parallel.ring`) — on one CPU machine: every rank is a process, as every GPU would be
(with NCCL). :func:`run_local` starts the processes ("spawn"), collects each rank's result and, when
a rank raises, dies or hangs, stops the others and reports that rank, with its traceback.

Explained in: notebooks/12_beyond_one_gpu.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["run_local"]

_MAX_TIMEOUT = 86_400 * 365          # seconds: a year (a timedelta past ~2.7e6 years overflows)


def _free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the OS picks it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_local_worker(rank, world, port, timeout, fn, args, kwargs, results):
    """One process of :func:`run_local`: join the group, run ``fn``, report
    to the parent.

    Reports ``(rank, True, pickled result)`` or
    ``(rank, False, (time of the failure, traceback))``, *before* leaving the
    group: a rank that fails first then also reports first, and the parent
    can tell the cause from the peers that failed because of it.
    """
    import datetime
    import pickle
    import time
    import traceback
    try:
        # ``world`` processes share this machine's cores
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world, timeout=datetime.timedelta(seconds=timeout))
        # pickled here, by value: a tensor put on a queue as is would be
        # shared through a file descriptor that disappears when this process
        # exits
        report = (rank, True, pickle.dumps(fn(rank, world, *args, **kwargs)))
    except BaseException:      # noqa: BLE001 - reported to the parent instead
        report = (rank, False, (time.time(), traceback.format_exc()))
    results.put(report)
    if dist.is_initialized():
        if report[1]:
            try:                  # leave together: a peer may still be reading
                dist.barrier()
            except RuntimeError:  # a peer failed; the parent stops everyone
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

    Explained in: notebooks/12_beyond_one_gpu.
    Tested in: tests/parallel/test_launch.py.
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
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0
            or not math.isfinite(timeout) or timeout > _MAX_TIMEOUT):
        raise ValueError(f"timeout must be a finite number of seconds > 0 (at most {_MAX_TIMEOUT}: "
                         f"a timedelta's range), got {timeout!r}")
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
