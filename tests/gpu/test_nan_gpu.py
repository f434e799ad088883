"""GPU tier: the NaN rule (tests/nan_cases.py) on CUDA tensors, for the compiled Triton kernels and the
CUDA kernels through NVRTC.

The same cases as tests/test_nan.py (where the interpreter and the emulator run them), plus sizes that
reach the real kernel configs (N ~ 1000, d = 128: many FULL key blocks before the causal diagonal), and
what only a GPU decides: fmaxf/tl.max ignoring NaN in hardware, 0 * NaN in tensor-core products, the
compiler's handling of NaN compares. Rule: a NaN a row sees makes the row's o NaN (and its lse, unless
only v has it); a NaN it does not see (causal mask, past cache_seqlens, memory past a view's end)
changes nothing; a row that sees no key outputs 0, lse = -inf. Backends: "triton" (version 1, and the
TMA forward where this Triton has tensor descriptors), "cuda" (v1 fp32, v3 16-bit; v2 explicitly),
flashlib.decode on both, and flashlib.auto's routes. Dtypes by capability (no bfloat16 below sm_80).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from conftest import require
from nan_cases import (assert_rule, attention_case, decode_case, decode_oracle, rule_rows,
                       seen_keys)

import flashlib
from flashlib.hardware import kernel_dtypes
from flashlib.kernels.triton import versions
from flashlib.testing import reference_gqa

DEVICE = torch.device("cuda")
DTYPES = [getattr(torch, n) for n in kernel_dtypes(DEVICE)]
HALF = [t for t in DTYPES if t != torch.float32]
ids = lambda t: {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[t]  # noqa: E731
TMA_OK = versions.has_tensor_descriptors()
# (Nq, Nk, d): the CPU suite's shapes, and ones that reach the real configs.
SHAPES = [(24, 24, 16), (12, 40, 16), (40, 12, 16), (70, 90, 16), (300, 1000, 128), (1000, 257, 64),
          (129, 129, 128)]
BACKENDS = ["triton", "cuda", "cuda-v2"] + (["triton-tma"] if TMA_OK else [])


def need_cupy():
    require(importlib.util.find_spec("cupy") is not None,
            "Python module 'cupy' is not installed (backend='cuda' compiles with NVRTC through CuPy)")


def run(backend, q, k, v, causal):
    if backend.startswith("cuda"):
        need_cupy()
    if backend == "cuda-v2":
        from flashlib.kernels import cuda
        return cuda.forward(q, k, v, causal=causal, version="v2")
    if backend == "triton-tma":
        from flashlib.kernels.triton import fa2_fwd_v4_tma
        return fa2_fwd_v4_tma.forward(q, k, v, causal=causal, scale=q.shape[-1] ** -0.5)
    return flashlib.attention(q, k, v, causal=causal, return_lse=True, backend=backend)


CASES = [(b, t) for b in BACKENDS for t in (HALF if b in ("cuda-v2", "triton-tma") else DTYPES)]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend, dtype", CASES, ids=lambda x: ids(x) if isinstance(x, torch.dtype) else x)
def test_attention_follows_the_nan_rule_on_the_gpu(backend, dtype, shape, causal):
    nq, nk, d = shape
    q, k, v = attention_case(nq, nk, causal, dtype, d=d, device=DEVICE)
    o, lse = run(backend, q, k, v, causal)
    o_ref, lse_ref = reference_gqa(q, k, v, causal=causal)
    assert_rule(o, lse, q, k, v, seen_keys(nq, nk, causal, batch=q.shape[0]), o_ref, lse_ref,
                f"{backend} {dtype} {shape} causal={causal}")


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("lengths, nmax, d", [([40, 23, 0, 9], 40, 16), ([1000, 517, 0, 129], 1000, 128)],
                         ids=["short", "long"])
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_decode_follows_the_nan_rule_on_the_gpu(backend, dtype, lengths, nmax, d, num_splits):
    if backend == "cuda":
        need_cupy()
    q, k, v = decode_case(dtype, 1, d=d, lengths=lengths, nmax=nmax, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    o, lse = flashlib.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits, return_lse=True,
                             backend=backend)
    o_ref, lse_ref = decode_oracle(q, k, v, lengths)
    assert_rule(o, lse, q, k, v, seen_keys(1, nmax, False, lengths, batch=4), o_ref, lse_ref,
                f"decode {backend} {dtype} {lengths} splits={num_splits}")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_auto_routes_follow_the_nan_rule_on_the_gpu(backend, monkeypatch):
    """flashlib.auto on CUDA tensors, its choice set to each backend: attention-shaped (causal and not)
    and decode-shaped SDPA calls follow the rule."""
    if backend == "cuda":
        need_cupy()
    import flashlib.auto
    from flashlib import backends
    monkeypatch.setitem(backends.AUTO, "cuda", backend)
    for causal in (True, False):
        q, k, v = attention_case(24, 24, causal, torch.float16, device=DEVICE)
        with flashlib.auto.enabled():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        o_nan, _, _ = rule_rows(q, k, v, seen_keys(24, 24, causal, batch=5))
        assert (torch.isnan(o).any(-1).cpu().numpy() == o_nan).all(), (backend, causal)
    q, k, v = decode_case(torch.float16, 1, device=DEVICE)
    before = dict(flashlib.auto.stats)
    with flashlib.auto.enabled():
        o = F.scaled_dot_product_attention(q[:2], k[:2], v[:2], enable_gqa=True)
    assert flashlib.auto.stats["decode"] == before["decode"] + 1
    o_nan, _, _ = rule_rows(q[:2], k[:2], v[:2], seen_keys(1, 40, False, batch=2))
    assert (torch.isnan(o).any(-1).cpu().numpy() == o_nan).all(), backend
