"""Tensors on a GPU that is not the current one (machines with two or more GPUs).

Triton launches on the *current* CUDA device, whatever device the tensors live on, so the Triton backend
runs each entry point under ``torch.cuda.device(q.device)`` (``with _OnDevice(q)`` in
flashlib.backends.triton; its logic is tested on a CPU in tests/kernels/triton/test_triton_host.py).
Here, with cuda:0 current, inputs on the last GPU must give the same bits as the same inputs on cuda:0
(the same GPU model; close in fp16 otherwise), forward, backward and decode, and the outputs must live
on the inputs' GPU. tests/gpu/conftest.py collects this file only where torch sees two GPUs or more
(not a skip: on one GPU there is nothing to run; the tier's report header says whether it was
collected, and FLASHLIB_GPU_COUNT states how many the machine must show).
"""
from __future__ import annotations

import torch

import flashlib

def _run(device):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 333, 128, generator=g).to(device, torch.float16).requires_grad_()
    k, v = (torch.randn(2, 2, 401, 128, generator=g).to(device, torch.float16).requires_grad_() for _ in range(2))
    o = flashlib.attention(q, k, v, causal=True, backend="triton")
    grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    with torch.no_grad():
        dec = flashlib.decode(q[:, :, -1:], k, v, cache_seqlens=torch.tensor([401, 7], device=device),
                              backend="triton")
    return o, *grads, dec


def test_inputs_on_another_gpu_run_there_and_match_the_current_gpu():
    torch.cuda.set_device(0)
    other = torch.device("cuda", torch.cuda.device_count() - 1)
    here, there = _run(torch.device("cuda", 0)), _run(other)
    assert torch.cuda.current_device() == 0                       # the caller's device is left as it was
    same_model = torch.cuda.get_device_name(0) == torch.cuda.get_device_name(other)
    for a, b in zip(here, there):
        assert b.device == other
        if same_model:                  # the same kernels and configs: the same bits
            assert torch.equal(a, b.to(a.device))
        else:                           # another GPU model may pick other tiles: fp16 rounding apart
            torch.testing.assert_close(b.to(a.device), a, atol=2e-2, rtol=2e-2)
