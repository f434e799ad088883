"""Seeded inputs and the one runner shared by the Triton kernels' tests (tests/kernels/triton/) and their
GPU tier (tests/gpu/test_triton_gpu.py).

It imports no ``conftest``: a session over tests/gpu loads tests/gpu/conftest.py last, as ``conftest``.
Callers pass the device (conftest.DEVICE on the CPU suite, "cuda" in the GPU tier).
"""
from __future__ import annotations

import torch

import flashlib
from flashlib.ladder.dropout import keep_mask
from flashlib.tools.compile_report import triton_specs

# configs' table key ("fwd", "bwd_dkdv", ...) -> the KernelSpec the config functions take
TABLE_SPECS = {s.config: s for s in triton_specs() if s.config}


# (B, H, Hkv, Nq, Nk, d, causal): multiples of no block, both ways of Nq != Nk, head dims 1, 40, 59,
# 111, 256, GQA and MQA, causal rows that see nothing (Nq > Nk); the interpreter's blocks are 32 x 16.
# The forward's and the backward's tests run the same cases.
FP32_CASES = [
    (1, 1, 1, 1, 1, 1, False), (1, 2, 2, 1, 37, 40, True), (2, 4, 2, 17, 45, 40, False),
    (1, 4, 1, 45, 17, 59, True), (1, 2, 1, 33, 33, 111, True), (1, 1, 1, 5, 40, 256, True),
    (1, 4, 2, 70, 30, 16, True), (1, 2, 2, 30, 70, 24, False), (1, 3, 1, 50, 50, 64, True),
]
HALF_CASES = [(1, 4, 2, 45, 70, 59, True), (1, 2, 1, 37, 20, 40, False), (1, 1, 1, 20, 33, 111, True)]


def case_id(c):
    return "B{}H{}kv{}-{}x{}-d{}-{}".format(*c[:6], "causal" if c[6] else "full")


def make_qkv(B, H, HKV, NQ, NK, D, dtype=torch.float32, seed=0, device="cpu"):
    """``q (B, H, NQ, D)``, ``k, v (B, HKV, NK, D)`` and ``do`` like q: drawn on the CPU from one seeded
    generator (the same values on every machine), then moved to ``device`` in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, NQ, D), (B, HKV, NK, D), (B, HKV, NK, D), (B, H, NQ, D))
    return [torch.randn(*s, generator=g).to(device, dtype) for s in shapes]


def run_triton(q, k, v, do, causal, **kw):
    """``flashlib.attention(..., backend="triton")`` and its gradients for ``do``:
    ``(o, lse, (dq, dk, dv))``, the arguments of flashlib.testing.assert_attention_right."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = flashlib.attention(*leaves, causal=causal, return_lse=True, backend="triton", **kw)
    grads = torch.autograd.grad(o, leaves, do)
    return o.detach(), lse.detach(), grads


# (seed, offset) of the variant tests: both past 32 bits, the counters' 64-bit path
VARIANT_SEED = (2**40 + 12345, 2**33 + 7)


def make_variants(q, k, *, window=(-1, -1), softcap=0.0, alibi=False, sinks=False, dropout_p=0.0,
                  dropout_seed=VARIANT_SEED, gen_seed=0):
    """``(kernel_kw, oracle_kw)``: the attention variants (issue 24) as the Triton launchers take them
    (alibi_slopes float32 (B, H) contiguous, sinks float32 (H,), dropout_seed=(seed, offset)) and as the
    oracle does (dropout as its keep mask Z (B, H, Nq, Nk), flashlib.ladder.dropout.keep_mask). Shared by
    the forward's and the backward's variant tests."""
    B, H, NQ = q.shape[:3]
    NK = k.shape[2]
    g = torch.Generator().manual_seed(1000 + gen_seed)
    kern, ref = {}, {}
    if tuple(window) != (-1, -1):
        kern["window_size"] = ref["window_size"] = tuple(window)
    if softcap:
        kern["softcap"] = ref["softcap"] = float(softcap)
    if alibi:
        slopes = torch.rand(B, H, generator=g) * 0.5 + 0.05
        kern["alibi_slopes"] = slopes.to(q.device)
        ref["alibi_slopes"] = slopes.numpy()
    if sinks:
        s = torch.randn(H, generator=g)
        kern["sinks"] = s.to(q.device)
        ref["sinks"] = s.numpy()
    if dropout_p:
        kern["dropout_p"] = ref["dropout_p"] = dropout_p
        kern["dropout_seed"] = dropout_seed
        ref["dropout_mask"] = keep_mask(*dropout_seed, (B, H, NQ, NK), dropout_p)
    return kern, ref
