"""GPU tier: the machine shows the GPUs it was said to have.

``FLASHLIB_GPU_COUNT=N`` (``make test-gpu GPUS=N``; default 1) states how many CUDA GPUs the machine has.
tests/gpu/test_multi_gpu.py is collected only where torch sees two or more (tests/gpu/conftest.py), so a
two-GPU machine whose second GPU is hidden (CUDA_VISIBLE_DEVICES, a container) would otherwise pass the
tier without running it: here that fails.
"""
from __future__ import annotations

import os

import torch


def test_the_machine_shows_its_gpus():
    said = os.environ.get("FLASHLIB_GPU_COUNT", "1")
    assert said.isdigit() and int(said) >= 1, f"FLASHLIB_GPU_COUNT must be a positive integer, got {said!r}"
    seen = torch.cuda.device_count()
    assert seen >= int(said), (f"FLASHLIB_GPU_COUNT={said}, but torch sees {seen} CUDA GPU(s) "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
