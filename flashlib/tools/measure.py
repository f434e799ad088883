"""Measurements a CPU can make honestly: peak Python/NumPy memory (tracemalloc) and wall-clock time.

These measure *this machine*. They are never GPU figures; chapters label them "measured on this CPU".
Explained in: notebooks/01_naive_attention (memory) and notebooks/02_online_softmax (time).
"""
from __future__ import annotations

import gc
import time
import tracemalloc

__all__ = ["peak_memory", "best_time"]


def peak_memory(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` once; return ``(result, peak_bytes)`` of memory it allocated.

    NumPy reports its array buffers to tracemalloc, so the peak includes every intermediate array
    (an N x N score matrix shows up in full); the inputs, allocated before, are not counted.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/tools/test_measure.py.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    gc.collect()
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        result = fn(*args, **kwargs)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not was_tracing:
            tracemalloc.stop()
    return result, peak


def best_time(fn, *args, repeat: int = 3, **kwargs) -> float:
    """Best wall-clock seconds of ``repeat`` calls of ``fn(*args, **kwargs)`` on this machine.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/tools/test_measure.py.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        best = min(best, time.perf_counter() - t0)
    return best
