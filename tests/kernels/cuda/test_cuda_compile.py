"""nvcc compiles every flashlib CUDA kernel for every target architecture (sm_75 .. sm_90) with no
register spills, shared memory within each GPU's limit, and tensor-core instructions in v2's SASS.
"""
from __future__ import annotations

import pytest

from conftest import require
import flashlib.kernels.cuda as fc
from flashlib.kernels.cuda import build
from flashlib.hardware import ARCH_SMEM_LIMIT


@pytest.fixture(scope="module")
def rows():
    for tool in ("nvcc", "cuobjdump"):
        require(build.find_tool(tool) is not None, f"{tool} (CUDA toolkit) is needed for the compile report")
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
        if not r["kernel"].startswith("fa2_fwd_v2"):
            assert r["tensor_cores"] is False and r["mma_instructions"] == 0, r


def test_row_schema(rows):
    keys = {"backend", "kernel", "config", "arch", "ok", "registers", "spill_bytes", "shared_bytes",
            "mma_instructions", "tensor_cores"}
    for r in rows:
        assert keys <= set(r) and r["backend"] == "cuda"


def test_resource_usage_parser():
    text = """ptxas info    : Compiling entry function 'k1' for 'sm_80'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'k2' for 'sm_80'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 380 bytes cmem[0]
"""
    u = build._parse_resource_usage(text)
    assert u["k1"] == {"registers": 40, "stack_bytes": 8, "spill_bytes": 16, "static_smem": 2048}
    assert u["k2"] == {"registers": 12, "stack_bytes": 0, "spill_bytes": 0, "static_smem": 0}
    sass = "Function : k1\n  HMMA.16816.F32 R0, R4, R8, R0 ;\n  HMMA.16816.F32 R2, R4, R8, R2 ;\nFunction : k2\n FFMA R1 ;"
    assert build._count_mma(sass) == {"k1": 2, "k2": 0}


def test_missing_nvcc_is_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for var in ("NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(build.pathlib.Path, "is_file", lambda self: False)
    with pytest.raises(RuntimeError, match="needs `nvcc`"):
        build.nvcc_usage("fa2_fwd_v1_scalar.cu", "sm_80")
