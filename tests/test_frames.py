"""How deep flashlib is between a public call and a Triton launch: at most 6 flashlib frames, with and
without grad, for every Triton kernel (flashlib.api's docstring names them).

Each launch is caught where Triton is asked for it (``kernel[grid]``: the JIT function's, or the
interpreter's, ``__getitem__``), so the frames counted are the real call stack down to
:meth:`KernelSpec._run <flashlib.kernels.triton.spec.KernelSpec._run>`, which launches; nothing of
flashlib is stubbed. The kernels do not run (the launch is recorded, not made): outputs are not
looked at.
"""
from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from conftest import DEVICE

import flashlib
from flashlib.kernels.triton import fa2_fwd_v1

MAX_FRAMES = 6
PACKAGE = pathlib.Path(flashlib.__file__).resolve().parent


def flashlib_frames(frame) -> list[str]:
    """The flashlib frames on the stack from ``frame`` outwards, outermost first, as "file:function"."""
    names = []
    while frame is not None:
        path = pathlib.Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            names.append(f"{path.relative_to(PACKAGE).as_posix()}:{frame.f_code.co_name}")
        frame = frame.f_back
    return names[::-1]


@pytest.fixture
def launches(monkeypatch):
    """Every Triton launch as (spec's kernel name, its flashlib frames), recorded instead of run."""
    seen = []
    kind = type(fa2_fwd_v1.SPEC.fn)                     # JITFunction, or InterpretedFunction on a CPU

    def getitem(fn, grid):
        seen.append((fn.fn.__name__ if hasattr(fn, "fn") else repr(fn), flashlib_frames(sys._getframe(1))))
        return lambda *args, **kwargs: None
    monkeypatch.setattr(kind, "__getitem__", getitem)
    monkeypatch.delenv("FLASHLIB_TRITON_FWD", raising=False)
    monkeypatch.delenv("FLASHLIB_TRITON_BWD", raising=False)
    return seen


def tensors(dtype, grad, d=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, 40, d, generator=g).to(DEVICE, dtype).requires_grad_(grad) for _ in range(3)]


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
@pytest.mark.parametrize("kernel", [None, ("v4", "v5")], ids=["v1 v2", "v4 v5 (TMA)"])
def test_attention_reaches_every_launch_within_six_frames(launches, grad, kernel):
    q, k, v = tensors(torch.float16, grad)
    o = flashlib.attention(q, k, v, causal=True, backend="triton", kernel=kernel)
    forward = list(launches)
    assert [name for name, _ in forward] == ["_fwd_kernel" if kernel is None else "_fwd_tma_kernel"]
    chain = forward[0][1]
    assert chain[0] == "api.py:attention" and chain[-1] == "kernels/triton/spec.py:_run", chain
    assert len(chain) == 6 <= MAX_FRAMES, chain           # the eager ways: forward_impl or the Function
    if grad:
        o.sum().backward()
        backward = launches[len(forward):]
        assert [name for name, _ in backward] == ["_bwd_preprocess",
                                                  "_bwd_dkdv" if kernel is None else "_bwd_dkdv_tma", "_bwd_dq"]
        for _, chain in backward:                     # from autograd: the Function's backward down
            assert chain[0] == "_ops.py:backward" and len(chain) <= MAX_FRAMES, chain


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reaches_every_launch_within_six_frames(launches, num_splits):
    q = torch.randn(2, 4, 1, 32, device=DEVICE)
    cache = torch.randn(2, 2, 80, 32, device=DEVICE)
    flashlib.decode(q, cache, cache, num_splits=num_splits, backend="triton")
    assert [name for name, _ in launches] == ["_split_kernel", "_combine_kernel"][:1 if num_splits == 1 else 2]
    for _, chain in launches:
        assert chain[0] == "api.py:decode" and chain[-1] == "kernels/triton/spec.py:_run", chain
        assert len(chain) <= MAX_FRAMES, chain
