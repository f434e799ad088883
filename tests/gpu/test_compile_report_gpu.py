"""GPU tier: the compile report (flashlib/tools/compile_report.py) against what this GPU really compiled.

A report is true only for the Triton that produced it (triton 3.9 on a CPU and 3.6 on an H100 differed
by up to 2x on the same kernels). Here both sides use this machine's Triton: the report's rows for this
GPU's own architecture must match the registers and shared memory of the kernels Triton's JIT
compiled when flashlib ran them, at the report's problem (d = 128, fp16, causal).
"""
from __future__ import annotations

import importlib.metadata

import pytest
import torch

import flashlib
from flashlib.tools import compile_report as fi
from flashlib.kernels.triton import configs, decode_v3 as decode, fa2_bwd_v2, fa2_bwd_v5_tma, fa2_fwd_v1, fa2_fwd_v4_tma, versions

DEVICE = torch.device("cuda")
TMA_OK = versions.has_tensor_descriptors()      # the TMA kernels exist from triton 3.4 on (chosen here)
KERNELS = {"fa2_fwd": fa2_fwd_v1._fwd_kernel, "fa2_bwd_dkdv": fa2_bwd_v2._bwd_dkdv, "fa2_bwd_dq": fa2_bwd_v2._bwd_dq,
           "decode_split": decode._split_kernel,
           **({"fa2_fwd_tma": fa2_fwd_v4_tma._fwd_tma_kernel, "fa2_bwd_dkdv_tma": fa2_bwd_v5_tma._bwd_dkdv_tma}
              if TMA_OK else {})}


def _jit_compiled(fn):
    """The kernels Triton's JIT holds for ``fn`` (all devices, all specialisations)."""
    return [k for cache in fn.device_caches.values() for k in cache[0].values()]


@pytest.fixture(scope="module")
def compiled():
    """Run flashlib once at the report's problem, from empty JIT caches: one kernel per function."""
    for fn in KERNELS.values():
        fn.device_caches.clear()
    g = torch.Generator().manual_seed(0)
    # Lengths and head counts that are not multiples of 16 and not 1, as the report leaves them
    # general (Triton's JIT specialises integers that are).
    q = torch.randn(2, 6, 1000, 128, generator=g).to(DEVICE, torch.float16).requires_grad_()
    k, v = (torch.randn(2, 3, 1000, 128, generator=g).to(DEVICE, torch.float16).requires_grad_()
            for _ in range(2))
    o = flashlib.attention(q, k, v, causal=True, backend="triton")
    o.backward(torch.randn_like(o))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    if TMA_OK:
        o2, lse2 = fa2_fwd_v4_tma.forward(qd, kd, vd, causal=True, scale=128 ** -0.5)     # the TMA kernels
        fa2_bwd_v5_tma.backward(qd, kd, vd, o2, lse2, torch.randn_like(o2), causal=True, scale=128 ** -0.5)
    kc, vc = (torch.randn(2, 3, 2001, 128, generator=g).to(DEVICE, torch.float16) for _ in range(2))
    lens = torch.tensor([2001, 999], device=DEVICE, dtype=torch.int32)     # SEQLENS is a pointer, as reported
    flashlib.decode(q[:, :, :1].detach(), kc, vc, cache_seqlens=lens, backend="triton")
    torch.cuda.synchronize()
    out = {}
    for name, fn in KERNELS.items():
        kernels = _jit_compiled(fn)
        assert len(kernels) == 1, f"{name}: expected one compiled kernel, found {len(kernels)}"
        kern = kernels[0]
        kern._init_handles()                          # loads the binary: registers are known then
        out[name] = kern
    return out


@pytest.fixture(scope="module")
def rows():
    arch = configs.device_arch(DEVICE)
    return {r["kernel"]: r for r in fi.triton_rows((arch,), cache=False)}


def test_report_names_this_triton(rows):
    version = importlib.metadata.version("triton")
    assert all(r["compiler"] == f"triton {version}" for r in rows.values())


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_report_matches_what_this_gpu_compiled(name, rows, compiled):
    row, kern = rows[name], compiled[name]
    assert row["ok"], row
    md = kern.metadata
    assert (md.num_warps, md.num_stages) == tuple(int(x[1:]) for x in row["config"].split()[0].split("-")[2:]), \
        f"{name}: the GPU ran {md.num_warps} warps / {md.num_stages} stages, the report {row['config']}"
    assert md.shared == row["shared_bytes"], f"{name}: shared memory {md.shared} on the GPU vs {row}"
    # Registers: the JIT specialises this call's integers (the report leaves lengths general), which
    # may move the allocation by a few registers; 2x (what another Triton gave) is far outside this.
    assert abs(kern.n_regs - row["registers"]) <= max(8, row["registers"] // 10), \
        f"{name}: {kern.n_regs} registers on the GPU vs {row}"
    assert (kern.n_spills == 0) == (row["spill_bytes"] == 0), f"{name}: spills {kern.n_spills} vs {row}"
