"""No GPU→CPU read-back in flashlib.attention (forward and backward) and flashlib.decode, on a CPU.

A read of a tensor's value by the host (``int(t)``, ``t.item()``, ``t.tolist()``, ``torch.nonzero``, a
data-dependent shape...) makes the host wait for the GPU and forbids CUDA-graph capture
(tests/gpu/test_graphs_gpu.py checks both on a GPU). Here :class:`Watch`, a TorchDispatchMode, raises on
every aten op that reads values back, and :class:`WatchCalls`, a TorchFunctionMode, on the Python
methods that copy to the host without an aten op (``tolist``, ``numpy``, ``cpu``). The Triton kernels'
launches are recorded, not run (the interpreter reads everything: it *is* the host).

The one read allowed is :func:`flashlib.validation.check_cache_seqlens`'s range check of lengths that
already live on the CPU; a device tensor's lengths are never read (tests/test_validation.py).

Both ways a call can reach its backend are watched (flashlib._ops.path):
* the op: the whole call inside the watch — a dispatch mode on the stack is what sends it to the op;
* the lean ways (the autograd Function, the backend directly): path() must see no mode, so the watch
  is switched on around the backend calls only (the triton backend's forward, backward, decode), which the
  op runs too: a custom op hides what runs inside it from a mode around the whole call. The code above
  _ops (validation, the split rule, the backend's choice) is the same on both ways: the op's watch
  covers it.
"""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import flashlib
from api_cases import make_qkv
from conftest import DEVICE
from flashlib.backends import BACKENDS

# aten ops whose result the host must wait for: a value (item, int(), bool()) or a shape that depends
# on values (nonzero, masked_select, unique)
READ_BACK = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "_unique2",
             "unique_consecutive", "unique_dim"}
HOST_COPIES = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu}    # no aten op on a CPU


HOST_CHECKS = {"check_cache_seqlens", "check_capacity", "check_cu_seqlens", "check_max_seqlen"}


def _range_check_on_host(tensor) -> bool:
    """True inside flashlib.validation's range checks of CPU lengths, offsets or tables
    (check_cache_seqlens, check_capacity, check_cu_seqlens, check_max_seqlen: values already on the
    host, no wait)."""
    import traceback
    return tensor.device.type == "cpu" and any(
        f.name in HOST_CHECKS and f.filename.endswith("validation.py")
        for f in traceback.extract_stack())


class Watch(TorchDispatchMode):
    """Records every aten op in ``ops``; raises AssertionError on a read-back (:data:`READ_BACK`)."""

    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops.append(str(func))
        if name in READ_BACK and not _range_check_on_host(args[0]):
            raise AssertionError(f"host read-back: {func}")
        return func(*args, **(kwargs or {}))


class WatchCalls(TorchFunctionMode):
    """Raises AssertionError on a copy to the host that dispatches no aten op on a CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES:
            raise AssertionError(f"host copy: {func.__name__}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def watch(ops):
    with WatchCalls(), Watch(ops):
        yield


@pytest.fixture
def watched(monkeypatch):
    """The Triton launches recorded instead of run, the backend calls watched; returns the record:
    ``ops`` (aten and flashlib ops seen), ``launches`` (kernel names), ``ways`` (which impl ran)."""
    from flashlib.kernels.triton.spec import KernelSpec
    record = {"ops": [], "launches": [], "ways": []}
    monkeypatch.setattr(KernelSpec, "_run", lambda spec, grid, args, kw: record["launches"].append(spec.name))
    def watching(backend):
        """``backend`` with its forward, backward and decode run inside the watch, each recorded."""
        def watched_call(name):
            def call(*args, **kwargs):
                record["ways"].append(name)
                with watch(record["ops"]):
                    return getattr(backend, name)(*args, **kwargs)
            return call
        return dataclasses.replace(backend, forward=watched_call("forward"), backward=watched_call("backward"),
                                   decode=watched_call("decode"))
    monkeypatch.setitem(BACKENDS, "triton", watching(BACKENDS["triton"]))
    record["watching"] = watching
    return record


def _attention_inputs():
    q, k, v = make_qkv(B=2, H=4, HKV=2, NQ=40, NK=37, D=16, dtype=torch.float16, seed=1, device=DEVICE)
    return q, k, v, torch.ones_like(q)


@pytest.mark.parametrize("way", ["op", "lean"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_and_backward_read_nothing_back(watched, way, causal):
    q, k, v, do = _attention_inputs()
    leaves = [x.requires_grad_() for x in (q, k, v)]
    around = watch(watched["ops"]) if way == "op" else contextlib.nullcontext()
    with around:
        o = flashlib.attention(*leaves, causal=causal, backend="triton")
        torch.autograd.grad(o, leaves, do)
        with torch.no_grad():
            flashlib.attention(q, k, v, causal=causal, backend="triton")
    assert watched["ways"] == ["forward", "backward", "forward"]
    assert ("flashlib.attention_fwd.default" in watched["ops"]) == (way == "op")
    assert watched["launches"][0] == watched["launches"][-1] and "fa2_bwd_dq" in watched["launches"]


@pytest.mark.parametrize("way", ["op", "lean"])
@pytest.mark.parametrize("lengths", [None, "int32", "int64"])
def test_decode_reads_nothing_back(watched, way, lengths):
    q, kc, vc = make_qkv(B=3, H=8, HKV=2, NQ=1, NK=300, D=32, dtype=torch.float16, seed=2, device=DEVICE)
    lens = None if lengths is None else torch.tensor([300, 0, 7], dtype=getattr(torch, lengths), device=DEVICE)
    around = watch(watched["ops"]) if way == "op" else contextlib.nullcontext()
    with around:
        flashlib.decode(q, kc, vc, cache_seqlens=lens, backend="triton")          # num_splits: the rule
        flashlib.decode(q, kc, vc, cache_seqlens=lens, num_splits=4, backend="triton")
    assert watched["ways"] == ["decode"] * 2
    assert ("flashlib.decode.default" in watched["ops"]) == (way == "op")
    assert watched["launches"][-2:] == ["decode_split", "decode_combine"]


def test_the_watch_catches_a_read_back(watched, monkeypatch):
    """The control: a length read back in the backend (the old range check's ``int(lens.max())``) or a
    copy of the lengths to the host are caught on both ways; the CPU range check is not."""
    from flashlib.backends import BACKENDS, Backend, registered
    triton = BACKENDS["triton"]
    q, kc, vc = make_qkv(B=2, H=4, HKV=2, NQ=1, NK=30, D=16, dtype=torch.float32, device=DEVICE)
    lens = torch.tensor([30, 4], device=DEVICE)
    for planted in (lambda lens: int(lens.max()), lambda lens: lens.tolist()):
        def decode(q, k, v, lens, **kw):
            planted(lens)
            return triton.decode(q, k, v, lens, **kw)
        with registered(watched["watching"](Backend("planted", triton.forward, triton.backward, decode,
                                                     triton.check))):
            for around in (contextlib.nullcontext(), watch([])):
                with pytest.raises(AssertionError, match="host read-back|host copy"), around:
                    flashlib.decode(q, kc, vc, cache_seqlens=lens, backend="planted")
    from flashlib.validation import check_cache_seqlens
    with watch([]):                                   # the one read allowed: lengths already on the host
        check_cache_seqlens(torch.tensor([3, 4]), torch.empty(2, 1, 1, 1), 10)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_without_lengths_fills_no_tensor(watched, num_splits):
    """cache_seqlens=None allocates its outputs (and partials) and nothing else: before, every call
    filled a lengths tensor (torch.full: one more kernel per layer per token on a GPU)."""
    q, kc, vc = make_qkv(B=2, H=4, HKV=1, NQ=1, NK=50, D=16, dtype=torch.float16, seed=3, device=DEVICE)
    with watch(watched["ops"]):
        flashlib.decode(q, kc, vc, num_splits=num_splits, backend="triton")
    others = [op for op in watched["ops"] if not op.startswith(("aten.view", "aten.empty", "flashlib.decode"))]
    allocated = [op for op in watched["ops"] if op.startswith("aten.empty")]
    assert others == [] and len(allocated) == (2 if num_splits == 1 else 4)   # o, lse (+ 2 partials)
    assert "flashlib.decode.default" in watched["ops"]                        # inside the op: watched
