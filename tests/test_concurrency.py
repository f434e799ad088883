"""Concurrent calls: threads calling flashlib.attention (forward and backward) and flashlib.decode at
once each get their own right answer, checked against the float64 oracle (flashlib.testing).

Triton's interpreter keeps the launch it runs in module-level state, so two interpreted launches
at once corrupted each other (1 to 4 of 10 concurrent calls raised an InterpreterError, "x >=
grid_dim[0]", and some returned a wrong answer); flashlib.kernels.triton.spec serialises interpreted
launches with one lock. On a GPU (compiled kernels, no lock) the same test checks that concurrent
launches stay right.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import flashlib
from conftest import DEVICE, require_tool
from flashlib.testing import reference_gqa

THREADS = 12


def _call(i: int, backend: str, device: str) -> list[str]:
    """Call i of a round (attention forward, forward and backward, or decode, by i % 3) on its own
    seeded inputs; the problems found against the oracle (an empty list when right)."""
    g = torch.Generator().manual_seed(100 + i)
    nk = 20 + i                                          # every call its own shape: its own grid
    q, k, v = (torch.randn(1, 2, 5 + i % 4, 16, generator=g) if n == "q" else
               torch.randn(1, 1, nk, 16, generator=g) for n in "qkv")
    q, k, v = (x.to(device) for x in (q, k, v))
    kind = ("forward", "backward", "decode")[i % 3]
    if kind == "decode":
        lens = torch.tensor([nk - i], device=device)
        o = flashlib.decode(q, k, v, cache_seqlens=lens, num_splits=1 + i % 4, backend=backend)
        expected = reference_gqa(q, k[:, :, :nk - i], v[:, :, :nk - i])[0]
        got = {"o": o}
        want = {"o": expected}
    else:
        q, k, v = (x.requires_grad_(kind == "backward") for x in (q, k, v))
        o = flashlib.attention(q, k, v, causal=bool(i % 2), backend=backend)
        do = torch.ones_like(o)
        expected = reference_gqa(q, k, v, causal=bool(i % 2), do=do)
        got, want = {"o": o}, {"o": expected[0]}
        if kind == "backward":
            o.backward(do)
            got.update(dq=q.grad, dk=k.grad, dv=v.grad)
            want.update(dq=expected[2][0], dk=expected[2][1], dv=expected[2][2])
    errors = {n: float(np.abs(got[n].detach().cpu().double().numpy() - want[n]).max()) for n in got}
    return [f"call {i} ({kind}): {n} off by {e:.2e}" for n, e in errors.items() if not e <= 1e-4]



@pytest.mark.parametrize("backend", ["triton", "reference", "cuda"])
def test_concurrent_calls_each_get_their_own_right_answer(backend):
    """12 threads started together (a barrier), twice: 4 forwards, 4 forward+backward, 4 decodes
    ("cuda": its CPU emulator on CPU tensors). Every call must return, and match the oracle."""
    if backend == "cuda":
        require_tool("g++")                               # the CUDA emulator
    device = DEVICE if backend == "triton" else "cpu"
    for _round in range(2):
        barrier = threading.Barrier(THREADS)
        problems: list[str] = []

        def run(i):
            barrier.wait()
            try:
                problems.extend(_call(i, backend, device))
            except Exception as exc:                      # noqa: BLE001 - every failure is reported
                problems.append(f"call {i}: {type(exc).__name__}: {str(exc)[:200]}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads), "a call never returned (deadlock?)"
        assert not problems, "\n".join(problems)


def test_interpreted_launches_hold_one_lock_and_compiled_ones_none():
    """The lock exists exactly where Triton interprets (flashlib.kernels.triton.INTERPRET)."""
    from flashlib.kernels import triton as ft
    from flashlib.kernels.triton import spec
    assert (spec._INTERPRETED_LAUNCH is not None) == ft.INTERPRET
