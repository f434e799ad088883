"""The "cuda" backend: :mod:`flashlib.kernels.cuda`'s CUDA C++ (NVRTC on a GPU, the emulator on a CPU).

Kernel v1 (scalar) takes float32, v3 (mma.sync tensor cores, S/P/O in registers) float16/bfloat16 —
v2 (WMMA) on GPUs before sm_75 (:func:`flashlib.kernels.cuda.pick_version`); they size their own tiles.
The backward is the CUDA kernels' own (fa2_bwd_v1_mma.cu, :func:`flashlib.kernels.cuda.backward`) for
float16/bfloat16 at d <= 128; elsewhere (float32, d > 128, a GPU before sm_75) it is the "triton"
backend's on a GPU and the "reference" backend's (NumPy FA2) on a CPU, from the same saved LSE.

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

from . import reference, triton

DESCRIPTION = ("flashlib/kernels/cuda/csrc CUDA C++ kernels (NVRTC on a GPU, the emulator on CPU): forward "
               "v1 for float32, v3 mma.sync for float16/bfloat16 (v2 WMMA before sm_75); backward "
               "fa2_bwd_v1_mma for float16/bfloat16 at d <= 128")


def forward(q, k, v, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    """Backend.forward: :func:`flashlib.kernels.cuda.forward` (v1 for float32, v3 for 16-bit).
    Explained in: notebooks/08_cuda."""
    from ..kernels import cuda
    if blocks != (None, None):
        raise ValueError("backend='cuda' sizes its tiles from the head dim and the 48 KB of shared "
                         "memory (flashlib.kernels.cuda.launch); block_q/block_k are for 'triton' and "
                         "'reference'")
    return cuda.forward(q, k, v, causal=causal, scale=scale)


def backward(q, k, v, o, lse, do, *, causal, scale, allow_tf32=False, blocks=(None, None)):
    """Backend.backward: :func:`flashlib.kernels.cuda.backward` where it applies
    (:func:`flashlib.kernels.cuda.backward_supported`), else the "triton" backend's on a GPU and the
    "reference" backend's on a CPU. Explained in: notebooks/08_cuda."""
    from ..kernels import cuda
    if cuda.backward_supported(q) is None:
        return cuda.backward(q, k, v, o, lse, do, causal=causal, scale=scale)
    other = triton if q.device.type == "cuda" else reference
    return other.backward(q, k, v, o, lse, do, causal=causal, scale=scale, allow_tf32=allow_tf32)


def decode(q, k_cache, v_cache, cache_seqlens, *, num_splits, scale):
    """Backend.decode: :func:`flashlib.kernels.cuda.decode` (``cache_seqlens`` None: the lengths
    tensor is built here, every sequence at Nmax). Explained in: notebooks/08_cuda."""
    import torch

    from ..kernels import cuda
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
