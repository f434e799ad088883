"""nvcc compiles every flashlib CUDA kernel for every target architecture (sm_75 .. sm_90) with no
register spills, shared memory within each GPU's limit, and tensor-core instructions in v2's SASS.
"""
from __future__ import annotations

import re

import pytest

from conftest import require_tool
import flashlib.kernels.cuda as fc
from flashlib.kernels.cuda import build
from flashlib.hardware import ARCH_SMEM_LIMIT


@pytest.fixture(scope="module")
def rows():
    require_tool("nvcc")
    require_tool("cuobjdump")
    return fc.compile_rows(fc.ARCHS)


def _by(rows, arch):
    return [r for r in rows if r["arch"] == arch]


@pytest.mark.parametrize("arch", fc.ARCHS)
def test_every_kernel_compiles(rows, arch):
    mine = _by(rows, arch)
    kernels = {r["kernel"] for r in mine}
    expected = {s.kernel for _, s in fc.compile_configs()}
    if arch == "sm_75":
        expected.discard("fa2_fwd_v2_bf16")                      # WMMA has no bf16 before sm_80
        expected -= {k for k in expected if k.startswith("fa2_fwd_v3_bf16")}   # nor mma.sync m16n8k16
        expected -= {k for k in expected if k.startswith("fa2_bwd_v1") and "_bf16" in k}   # (the backward too)
    assert kernels == expected
    bad = [(r["kernel"], r.get("error")) for r in mine if not r["ok"]]
    assert not bad, bad


@pytest.mark.parametrize("arch", fc.ARCHS)
def test_no_spills_and_shared_memory_fits(rows, arch):
    for r in _by(rows, arch):
        assert r["spill_bytes"] == 0, r
        assert r["registers"] is not None and 0 < r["registers"] <= 255, r
        assert r["shared_bytes"] <= ARCH_SMEM_LIMIT[arch] * 1024, r
        assert r["shared_bytes"] <= 48 * 1024, ("flashlib keeps every kernel within the 48 KB a block gets "
                                                "without an opt-in", r)


@pytest.mark.parametrize("arch", fc.ARCHS)
def test_v2_uses_tensor_cores_and_v1_does_not(rows, arch):
    mine = _by(rows, arch)
    v2 = [r for r in mine if r["kernel"].startswith("fa2_fwd_v2")]
    assert any(r["kernel"] == "fa2_fwd_v2_f16" for r in v2)      # sm_75 included: fp16 WMMA exists there
    for r in v2:
        assert r["mma_instructions"] > 0 and r["tensor_cores"] is True, r
    for r in mine:
        if r["kernel"].startswith(("fa2_bwd_v1_dkdv", "fa2_bwd_v1_dq")):   # tests/kernels/cuda/test_cuda_bwd.py
            continue
        if not r["kernel"].startswith(("fa2_fwd_v2", "fa2_fwd_v3")):      # v3: tests/kernels/cuda/test_cuda_v3.py
            assert r["tensor_cores"] is False and r["mma_instructions"] == 0, r


def test_row_schema(rows):
    keys = {"backend", "kernel", "config", "arch", "ok", "registers", "spill_bytes", "shared_bytes",
            "mma_instructions", "tensor_cores"}
    for r in rows:
        assert keys <= set(r) and r["backend"] == "cuda"


def test_rows_name_nvcc_and_its_release(rows):
    assert all(re.fullmatch(r"nvcc \d+\.\d+", r["compiler"]) for r in rows), {r["compiler"] for r in rows}


def test_missing_nvcc_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build.pathlib.Path, "is_file", lambda self: False)
    with pytest.raises(RuntimeError, match="needs `nvcc`"):
        build.nvcc_usage("fa2_fwd_v1_scalar.cu", "sm_80")
