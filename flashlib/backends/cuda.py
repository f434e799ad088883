"""The "cuda" backend: :mod:`flashlib.kernels.cuda`'s CUDA C++ (NVRTC on a GPU, the emulator on a CPU).

Kernel versions (:mod:`flashlib.backends.variants`, the same tables and ``pick`` as the Triton
backend's; the versions are in the file names): the forwards :data:`FORWARD` are v3
(``fa2_fwd_v3_mma.cu``: mma.sync tensor cores, S/P/O in registers; float16/bfloat16, sm_75+), v2
(``fa2_fwd_v2_wmma.cu``: WMMA, float16/bfloat16, any GPU) and v1 (``fa2_fwd_v1_scalar.cu``: float32),
in that order of preference (:func:`flashlib.kernels.cuda.pick_version` says which takes what);
``flashlib.attention(..., backend="cuda", kernel="v2")`` names one. They size their own tiles.
The backward :data:`BACKWARD` is v1 (``fa2_bwd_v1_mma.cu``, :func:`flashlib.kernels.cuda.backward`) for
float16/bfloat16 at d <= 128; elsewhere (float32, d > 128, a GPU before sm_75) it is the "triton"
backend's on a GPU and the "reference" backend's (NumPy FA2) on a CPU, from the same saved LSE.
Decode :data:`DECODE` is v1 (``decode_v1_splitkv.cu``).

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

from . import reference, triton
from .variants import Family, Variant

DESCRIPTION = ("flashlib/kernels/cuda/csrc CUDA C++ kernels (NVRTC on a GPU, the emulator on CPU): forward "
               "v1 for float32, v3 mma.sync for float16/bfloat16 (v2 WMMA before sm_75); backward "
               "fa2_bwd_v1_mma for float16/bfloat16 at d <= 128")


def _forward_supported(version: str):
    """``supported(q, k, v)`` of forward ``version``: why :func:`flashlib.kernels.cuda.pick_version`
    refuses q's dtype on q's GPU, or None."""
    def supported(q, *rest, **variants) -> str | None:
        from ..kernels import cuda
        capability = cuda._torch().cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
        try:
            cuda.pick_version(str(q.dtype).removeprefix("torch."), version, capability)
        except TypeError as exc:
            return str(exc)
        return None
    return supported


def _backward_supported(q, *rest, **variants) -> str | None:
    from ..kernels import cuda
    return cuda.backward_supported(q)


FORWARD = Family("cuda forward", (
    Variant("v3", "fa2_fwd_v3_mma.cu: mma.sync tensor cores, float16/bfloat16, sm_75+", _forward_supported("v3")),
    Variant("v2", "fa2_fwd_v2_wmma.cu: WMMA tensor cores, float16/bfloat16", _forward_supported("v2")),
    Variant("v1", "fa2_fwd_v1_scalar.cu: one thread per query row, float32", _forward_supported("v1")),
))
BACKWARD = Family("cuda backward", (
    Variant("v1", "fa2_bwd_v1_mma.cu: mma.sync, float16/bfloat16, d <= 128", _backward_supported),))
# The attention variants (window, softcap, ALiBi, sinks, dropout) are not in the CUDA C++ kernels:
# flashlib.attention and flashlib.decode refuse them for backend="cuda" by name, and "auto" passes
# this backend over (flashlib.backends.resolve).
VARIANTS = {"attention": frozenset(), "decode": frozenset()}
DECODE = Family("cuda decode", (Variant("v1", "decode_v1_splitkv.cu: split-KV then combine"),))
KERNELS = {"forward": FORWARD, "backward": BACKWARD, "decode": DECODE}


def forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None), kernel=None):
    """Backend.forward: :func:`flashlib.kernels.cuda.forward` with the version :data:`FORWARD` picks
    (``kernel``, else v3 for 16-bit, v2 before sm_75, v1 for float32).
    Explained in: notebooks/08_cuda."""
    from ..kernels import cuda
    if blocks != (None, None):
        raise ValueError("backend='cuda' sizes its tiles from the head dim and the 48 KB of shared "
                         "memory (flashlib.kernels.cuda.launch); block_q/block_k are for 'triton' and "
                         "'reference'")
    version = FORWARD.pick(kernel, q, k, v).name
    return cuda.forward(q, k, v, causal=causal, scale=scale, version=version)


def backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None), kernel=None):
    """Backend.backward: :func:`flashlib.kernels.cuda.backward` where it applies
    (:func:`flashlib.kernels.cuda.backward_supported`), else the "triton" backend's on a GPU and the
    "reference" backend's on a CPU (``kernel="v1"`` insists on the CUDA one: ValueError where it
    cannot run). Explained in: notebooks/08_cuda."""
    from ..kernels import cuda
    if kernel is not None:
        BACKWARD.pick(kernel, q)
    if cuda.backward_supported(q) is None:
        return cuda.backward(q, k, v, o, lse, do, causal=causal, scale=scale)
    other = triton if q.device.type == "cuda" else reference
    return other.backward(q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32)


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale, kernel=None):
    """Backend.decode: :func:`flashlib.kernels.cuda.decode` (``cache_seqlens`` None: the lengths
    tensor is built here, every sequence at Nmax). Explained in: notebooks/08_cuda."""
    import torch

    from ..kernels import cuda
    if kernel is not None:
        DECODE.get(kernel)
    if cache_seqlens is None:
        cache_seqlens = torch.full((q.shape[0],), k_cache.shape[2], dtype=torch.int32, device=q.device)
    return cuda.decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, num_splits=num_splits,
                       scale=scale)


def check(q, op):
    """Backend.check: float32/16-bit; g++ for CPU tensors (the emulator), CuPy for CUDA tensors; meta
    tensors need neither (shapes only: :mod:`flashlib._ops` runs no kernel on them).
    Explained in: notebooks/08_cuda."""
    import importlib.util

    import torch

    from ..tools import toolchain
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='cuda' takes float32 (kernel v1) or float16/bfloat16 (kernel v3), "
                        f"got {q.dtype}")
    if q.device.type == "cpu":
        if toolchain.find_tool("g++") is None:
            raise RuntimeError("backend='cuda' runs CPU tensors in flashlib's CUDA emulator, which "
                               "needs g++: not found on PATH")
    elif q.device.type == "cuda":
        if importlib.util.find_spec("cupy") is None:
            raise RuntimeError("backend='cuda' compiles the kernels with NVRTC through CuPy, which is "
                               "not installed (pip install cupy-cuda12x)")
    elif q.device.type != "meta":
        raise ValueError(f"backend='cuda' runs on CUDA or CPU tensors, got device {q.device}")
