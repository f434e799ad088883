"""Seeded torch inputs and a fresh-interpreter runner, shared by the tests of flashlib's torch API
(tests/test_api.py, tests/test_ops.py, tests/backends/)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from conftest import ROOT
from triton_cases import make_qkv as _make_qkv_do


def make_qkv(B=1, H=4, HKV=2, NQ=13, NK=21, D=24, dtype=torch.float64, seed=0, grad=False, device="cpu"):
    """q, k, v of tests/triton_cases.make_qkv (the same seeded values), with the API tests' defaults
    and leaves that require grad if ``grad``; ``device=DEVICE`` for tensors that reach Triton."""
    q, k, v, _ = _make_qkv_do(B, H, HKV, NQ, NK, D, dtype=dtype, seed=seed, device=device)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (Triton's mode not yet chosen), without TRITON_INTERPRET."""
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, env=full_env, timeout=300)
