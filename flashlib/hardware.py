"""The GPUs a reader meets in Colab and in the papers: published figures, one table for the whole book.

Figures are vendors' datasheet numbers as collected in the project's facts file (dense fp16 tensor-core
throughput, HBM bandwidth, SM count, shared memory a block may opt into). They are *published peak*
figures, never measurements of ours; the book says so wherever it plots them.

:func:`cuda_device` is the one exception, and no figure of merit: what the driver reports for a CUDA device
of this machine (architecture, SM count, shared memory per block), asked once per device index.

:func:`rehearse` (or ``FLASHLIB_REHEARSE=T4`` in the environment) makes CPU tensors stand for one GPU of
:data:`GPUS` in flashlib's device facts (:func:`device_facts`): the kernels still run in Triton's
interpreter, but every choice flashlib makes for a GPU (dtypes, config tables, bf16 refusal, decode's
split count) is made as on that GPU, so that a chapter which would fail on a T4 fails on a CPU first.

Explained in: book/gpu_memory and notebooks/01_naive_attention (roofline).
"""
from __future__ import annotations

import contextlib
import operator
import os
from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "ARCH_SMEM_LIMIT", "CUDA_GRID_MAX", "CudaDevice", "cuda_device", "flat_programs", "get",
           "ridge_point", "kernel_dtypes", "REHEARSE_ENV", "rehearse", "rehearsing", "device_facts"]


@dataclass(frozen=True)
class GPU:
    """One GPU's published peak figures.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/test_hardware.py.
    """
    name: str
    arch: str                   # compute capability, e.g. "sm_80"
    fp16_tflops: float          # dense fp16 tensor-core TFLOP/s
    bandwidth_gbs: float        # HBM/GDDR bandwidth, GB/s
    sms: int                    # streaming multiprocessors
    smem_per_block_kb: int      # max shared memory per block (opt-in), KB

    @property
    def ridge_flops_per_byte(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound on this GPU."""
        return ridge_point(self.fp16_tflops, self.bandwidth_gbs)


GPUS: dict[str, GPU] = {g.name: g for g in (
    GPU("T4", "sm_75", 65.0, 320.0, 40, 64),
    GPU("L4", "sm_89", 121.0, 300.0, 58, 99),
    GPU("A100-40GB", "sm_80", 312.0, 1555.0, 108, 163),
    GPU("A100-80GB", "sm_80", 312.0, 2039.0, 108, 163),
    GPU("H100-SXM", "sm_90", 989.0, 3350.0, 132, 227),
)}

# Shared memory one block may use, per architecture (KB), after opting in; 48 KB without opt-in.
ARCH_SMEM_LIMIT = {"sm_75": 64, "sm_80": 163, "sm_86": 99, "sm_89": 99, "sm_90": 227}

# CUDA's grid limits, blocks (programs) per axis x, y, z, on every architecture here. With batch·heads on
# y, B = 1024 and H = 128 failed to launch ("invalid argument"); every flashlib kernel, Triton and CUDA
# C++, therefore flattens its grid onto x and decodes its indices inside the kernel.
CUDA_GRID_MAX = (2**31 - 1, 65535, 65535)


def flat_programs(*counts: int) -> int:
    """``prod(counts)``: the blocks of a one-axis grid, checked against CUDA's x limit (ValueError
    outside ``1 .. 2^31 - 1``; a tensor needing more would not fit in any GPU's memory).

    Explained in: notebooks/appendix_verification.

    Tested in: tests/test_hardware.py.
    """
    n = 1
    try:
        for c in counts:                                       # a plain loop: every launch calls this
            n *= operator.index(c)                             # Python or NumPy integers
    except TypeError:
        raise TypeError(f"counts must be integers, got {counts!r}") from None
    if not 1 <= n <= CUDA_GRID_MAX[0]:
        raise ValueError(f"a launch of {' x '.join(map(str, counts))} = {n} programs is outside CUDA's "
                         f"grid limit of 1..{CUDA_GRID_MAX[0]} on axis x")
    return n


@dataclass(frozen=True)
class CudaDevice:
    """What the driver reports for one CUDA device of this machine (not a published figure).

    ``index``: the device index (-1 for a GPU that a rehearsal stands in for, :func:`rehearse`);
    ``arch``: e.g. "sm_90"; ``sms``: streaming multiprocessors; ``smem_optin``: shared memory a block may
    opt into, bytes (None where torch does not report it).

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    index: int
    arch: str
    sms: int
    smem_optin: int | None


_CUDA_DEVICES: dict[int, CudaDevice] = {}           # device index -> what its driver said


def _cuda_device(index: int) -> CudaDevice:
    # A plain dict, not functools.lru_cache: torch.compile traces flashlib.attention's checks through
    # here, and dynamo reads a global dict where it would break the graph at a cache wrapper.
    found = _CUDA_DEVICES.get(index)
    if found is None:
        import torch
        p = torch.cuda.get_device_properties(index)
        found = _CUDA_DEVICES[index] = CudaDevice(index, f"sm_{p.major}{p.minor}", p.multi_processor_count,
                                                  getattr(p, "shared_memory_per_block_optin", None))
    return found


def cuda_device(device=None) -> CudaDevice:
    """The :class:`CudaDevice` of ``device`` (a torch.device, "cuda:1", an index, or None: the current
    device), asked of the driver once per device index and remembered: launchers call this on every call,
    and a device's properties do not change while the process runs. ValueError for a non-CUDA device.

    Explained in: notebooks/07_triton.
    Tested in: tests/kernels/triton/test_triton_host.py.
    """
    if isinstance(device, int):
        return _cuda_device(device)
    import torch
    d = device if isinstance(device, torch.device) else torch.device("cuda" if device is None else device)
    if d.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {d}")
    index = d.index if d.index is not None else torch.cuda.current_device()
    return _cuda_device(index)


# The rehearsal: a GPU of GPUS that CPU tensors stand for in device_facts (None: CPU tensors are CPUs).
REHEARSE_ENV = "FLASHLIB_REHEARSE"
_REHEARSAL: CudaDevice | None = None


def _stand_in(name) -> CudaDevice:
    """The CudaDevice a rehearsal of GPU ``name`` answers with: its published arch, SMs and shared memory
    per block (opt-in); index -1, the mark of a device that is not on this machine."""
    gpu = get(name)                                      # TypeError/ValueError naming ``name``
    return CudaDevice(-1, gpu.arch, gpu.sms, gpu.smem_per_block_kb * 1024)


@contextlib.contextmanager
def rehearse(name: str):
    """Within the ``with`` block, CPU tensors stand for GPU ``name`` (one of :data:`GPUS`, e.g. "T4") in
    :func:`device_facts`, so every choice flashlib makes for a GPU is made as on that one: the dtypes of
    :func:`kernel_dtypes`, the Triton config tables (that GPU's arch and shared-memory limit instead of the
    interpreter's one config), the "triton" backend's refusal of bfloat16 before sm_80, and decode's default
    split count (its SM count). The kernels still run in Triton's interpreter. ``FLASHLIB_REHEARSE=T4`` in
    the environment does the same for a whole process (a notebook's kernel, a test run). Nests; restores
    what was rehearsed before on exit. ValueError for a name not in :data:`GPUS`, TypeError for a
    name that is not a str.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/test_rehearsal.py.
    """
    global _REHEARSAL
    before, _REHEARSAL = _REHEARSAL, _stand_in(name)
    try:
        yield _REHEARSAL
    finally:
        _REHEARSAL = before


def rehearsing() -> CudaDevice | None:
    """The :class:`CudaDevice` that CPU tensors stand for (:func:`rehearse`), or None (no rehearsal).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/test_rehearsal.py.
    """
    return _REHEARSAL


def device_facts(device) -> CudaDevice | None:
    """What flashlib's choices for ``device`` (a torch.device or a string like "cuda:0") go by: the driver's
    :class:`CudaDevice` for a CUDA device; for any other device the rehearsed GPU's (:func:`rehearse`), or
    None when nothing is rehearsed (a CPU: the interpreter's choices). A ``device`` that names no torch
    device ("gpu0", "cuda:x") is a ValueError, one of another type a TypeError, both naming ``device``.

    Explained in: notebooks/07_triton.
    Tested in: tests/test_rehearsal.py.
    """
    d = _as_device(device)
    return cuda_device(d) if d.type == "cuda" else _REHEARSAL


def _as_device(device):
    """``device`` as a torch.device (a torch.device, a str like "cuda:0", or an int CUDA index), else a
    TypeError/ValueError naming ``device`` (torch's own error would name nothing)."""
    import torch
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"device must be a torch.device or a str like 'cpu' or 'cuda:0', got "
                        f"{type(device).__name__} {device!r}")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must name a torch device like 'cpu' or 'cuda:0' (or be a CUDA index >= 0), "
                         f"got {device!r}") from None


def kernel_dtypes(device) -> tuple[str, ...]:
    """The dtypes flashlib's kernels take on ``device``, by name: ``("float16", "bfloat16", "float32")``,
    without bfloat16 on a GPU older than sm_80 (a T4: no bf16 tensor cores, and flashlib refuses it there).
    On a CPU every kernel runs in an emulator (Triton's interpreter, flashlib's CUDA emulator): all three,
    unless a T4 is rehearsed (:func:`rehearse`). Chapters, the GPU tier and the bench loop over these, so a
    cell never asks a T4 for bfloat16: ``[getattr(torch, n) for n in kernel_dtypes(device)]``.

    Explained in: notebooks/07_triton.
    Tested in: tests/test_hardware.py.
    """
    facts = device_facts(device)
    if facts is not None and int(facts.arch.removeprefix("sm_").rstrip("a")) < 80:
        return ("float16", "float32")
    return ("float16", "bfloat16", "float32")


def get(name: str) -> GPU:
    """The GPU called ``name`` (one of :data:`GPUS`), or a ValueError listing the names (a TypeError for
    a ``name`` that is not a str).

    Explained in: notebooks/03_flashattention1.
    Tested in: tests/test_hardware.py.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str naming a GPU of flashlib.hardware.GPUS, "
                        f"got {type(name).__name__}")
    if name not in GPUS:
        raise ValueError(f"name must be one of {sorted(GPUS)}, got {name!r}")
    return GPUS[name]


def ridge_point(tflops: float, bandwidth_gbs: float) -> float:
    """FLOP per byte at which compute time equals memory time: ``peak FLOP/s / bytes/s``.

    Explained in: book/gpu_memory.
    Tested in: tests/test_hardware.py.
    """
    return tflops * 1e12 / (bandwidth_gbs * 1e9)


def _rehearsal_from_environment() -> CudaDevice | None:
    """FLASHLIB_REHEARSE's GPU (unset or empty: none); ValueError naming the variable for an unknown one."""
    name = os.environ.get(REHEARSE_ENV, "")
    if not name:
        return None
    if name not in GPUS:
        raise ValueError(f"{REHEARSE_ENV} must be one of {sorted(GPUS)} (or empty), got {name!r}")
    return _stand_in(name)


_REHEARSAL = _rehearsal_from_environment()
