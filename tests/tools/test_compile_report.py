"""Tests of flashlib/tools/compile_report.py: every kernel compiles for every architecture, with no GPU.

Needs ptxas and cuobjdump (shipped in the triton wheel); without them the tests skip on a reader's
machine and fail under FLASHLIB_REQUIRE_ALL=1. The first run compiles (~1 minute on 2 cores); the
rows are cached on disk by source hash, so later runs and the notebook read them.
"""
from __future__ import annotations

import dataclasses

import pytest
from conftest import require_module, require_pinned_triton, require_tool, run_cli

from flashlib.kernels.triton import configs, versions
from flashlib.kernels.triton import spec as tspec
from flashlib.tools import compile_report as fi
from flashlib.tools import triton_versions
from flashlib.hardware import ARCH_SMEM_LIMIT

MATMUL_KERNELS = {"fa2_fwd", "fa2_fwd_tma", "fa2_bwd_dkdv", "fa2_bwd_dkdv_tma", "fa2_bwd_dq", "decode_split"}
# The one allowed spill: sm_90's dK/dV tile (M64-N64-w4-s2) is the fastest measured right on a real
# H100 (notebooks/appendix_verification); triton 3.9 spills 216 bytes for it when cross-compiling here
# (276 before the offsets became 64-bit). The TMA dK/dV (fa2_bwd_v5_tma.py) at the same tile spills 8 bytes.
SPILL_ALLOWED = {("fa2_bwd_dkdv", "sm_90"): 512, ("fa2_bwd_dkdv_tma", "sm_90"): 16}


@pytest.fixture(scope="module")
def report():
    require_module("triton")
    require_tool("ptxas")
    require_tool("cuobjdump")
    require_tool("nvcc")
    return fi.compile_report()


@pytest.fixture(scope="module")
def rows(report):
    """The Triton rows (the CUDA rows are tested in test_cuda_compile.py)."""
    return [r for r in report if r["backend"] == "triton"]


def test_rows_have_the_documented_keys(report):
    assert report and all(set(fi.KEYS) <= set(r) for r in report)
    assert {r["backend"] for r in report} == {"triton", "cuda"}
    cuda = [r for r in report if r["backend"] == "cuda"]
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in cuda)


def test_every_kernel_compiles_on_all_five_architectures(rows):
    kernels = {r["kernel"] for r in rows}
    assert MATMUL_KERNELS <= kernels
    for kernel in kernels:
        archs = {r["arch"] for r in rows if r["kernel"] == kernel and r["ok"]}
        failed = [r["error"] for r in rows if r["kernel"] == kernel and not r["ok"]]
        assert archs == set(fi.ARCHS), f"{kernel}: {failed}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_no_spills_and_tensor_cores_on_ampere_and_hopper(rows, arch):
    for r in (r for r in rows if r["arch"] == arch and r["dtype"] == "fp16"):
        assert r["spill_bytes"] <= SPILL_ALLOWED.get((r["kernel"], arch), 0), r
        if r["kernel"] in MATMUL_KERNELS:
            assert r["tensor_cores"] and r["mma_instructions"] > 0, r


# fp32 runs on its own tile tables (tables.table(arch, 4)): on the fp16 tables ptxas spilled 25-66 KB per
# thread on sm_80/sm_90 (e.g. the sm_90 forward at M128-N32-w8-s2, d = 128: 30,608 B; triton 3.9). With
# them, nothing at d = 128 spills more than a few dozen bytes with triton 3.6 or 3.9 (the version matrix
# checks d = 256 too). The TMA kernels take 16-bit inputs only, so their fp32 rows never run.
FP32_SPILL_LIMIT = 64


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp32_runs_on_tiles_that_do_not_spill(rows, arch):
    fp32 = [r for r in rows if r["arch"] == arch and r["dtype"] == "fp32" and not r["kernel"].endswith("_tma")]
    assert {r["kernel"] for r in fp32} >= MATMUL_KERNELS - {"fa2_fwd_tma", "fa2_bwd_dkdv_tma"}
    for r in fp32:
        assert r["ok"] and r["spill_bytes"] <= FP32_SPILL_LIMIT, r


def test_shared_memory_within_each_architecture_limit(rows):
    for r in rows:
        assert 0 <= r["shared_bytes"] <= ARCH_SMEM_LIMIT[r["arch"]] * 1024, r


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fp32_rows_run_tl_dot_on_cuda_cores(rows, arch):
    """fp32 inputs with allow_tf32=False (the default: PRECISION "ieee") get no tensor cores: FFMA."""
    fp32 = [r for r in rows if r["arch"] == arch and r["dtype"] == "fp32"]
    assert {r["kernel"] for r in fp32} >= MATMUL_KERNELS - {"fa2_fwd_tma", "fa2_bwd_dkdv_tma"}
    assert all(r["ok"] and r["tensor_cores"] is False and r["mma_instructions"] == 0 for r in fp32), fp32


def test_sm75_tensor_cores_are_the_installed_tritons_fact(rows):
    """From triton 3.3 on, tl.dot on sm_75 is FFMA (no tensor cores); up to 3.2 it is HMMA
    (versions.mma_on_tensor_cores; the 3.2 rows are checked below)."""
    on_tc = versions.mma_on_tensor_cores("sm_75", triton_versions.installed_version())
    for r in (r for r in rows if r["arch"] == "sm_75"):
        want = on_tc and r["kernel"] in MATMUL_KERNELS and r["dtype"] == "fp16"
        assert r["tensor_cores"] is want and (r["mma_instructions"] > 0) is want, r


@pytest.fixture(scope="module")
def rows_3_2():
    require_module("triton")
    require_tool("ptxas")
    return fi.triton_rows(("sm_75", "sm_80"), triton="3.2.0", dtypes=("fp16",))


def test_the_report_works_on_triton_3_2_where_sm75_uses_tensor_cores(rows_3_2):
    """Colab's oldest runtime (triton 3.2): the compile request is built in 3.2's format (an
    AttrsDescriptor: pointers, strides and D divisible by 16), ptxas -v is read without
    TRITON_DUMP_PTXAS_LOG, there are no TMA kernels, and tl.dot on sm_75 runs on tensor cores
    (HMMA.1688)."""
    assert versions.mma_on_tensor_cores("sm_75", "3.2.0")
    assert [r["kernel"] for r in rows_3_2 if r["arch"] == "sm_75"] == \
        [s.name for s in fi.triton_specs() if not s.name.endswith("_tma")]
    for r in rows_3_2:
        assert r["ok"] and r["compiler"] == "triton 3.2.0" and r["registers"] > 0, r
        if r["kernel"] in MATMUL_KERNELS:
            assert r["tensor_cores"] and r["mma_instructions"] > 0, r
    assert "HMMA" in fi.sass_excerpt("fa2_fwd", "sm_75", triton="3.2.0")


def test_rows_of_triton_3_2_are_specialised_as_the_jit_does(rows_3_2):
    """Without the divisibility hints (pointers, strides, D) the loads are not pipelined: no cp.async
    (LDGSTS) and less shared memory (triton 3.2, sm_80 forward M128-N64-w8-s3: 65,536 B instead of
    98,304 B). The report must compile what the GPU's JIT compiles: pipelined, on every version."""
    for r in (r for r in rows_3_2 if r["arch"] == "sm_80" and r["kernel"] in ("fa2_fwd", "fa2_bwd_dq")):
        assert r["ldgsts_instructions"] > 0, r


def test_the_report_reads_ptxas_on_triton_3_3_without_its_log_switch():
    """3.3 and 3.4 have no TRITON_DUMP_PTXAS_LOG: rows used to compile and be marked failed."""
    require_module("triton")
    assert not versions.dumps_ptxas_log("3.3.1")
    rows = fi.triton_rows(("sm_80",), triton="3.3.1", dtypes=("fp16",))
    assert rows and all(r["ok"] and r["registers"] > 0 and r["spill_bytes"] is not None for r in rows), rows


def test_sass_excerpt_shows_hmma_and_hgmma(rows):
    assert "HMMA" in fi.sass_excerpt("fa2_fwd", "sm_80")
    assert "HGMMA" in fi.sass_excerpt("fa2_fwd", "sm_90")


def test_tma_forward_copies_tiles_with_tma_on_hopper_only(rows):
    """The TMA forward's descriptors become TMA copies on sm_90 (loads of Q, K, V and the store of O) and
    pointer loads elsewhere; version 1 has no TMA anywhere. On sm_90 it also needs fewer
    registers than version 1 (no per-thread address arithmetic for its tiles) and runs on wgmma."""
    require_pinned_triton()                                  # registers: a fact about one Triton
    by = {(r["kernel"], r["arch"]): r for r in rows if r["dtype"] == "fp16"}
    hopper = by[("fa2_fwd_tma", "sm_90")]
    assert hopper["tma_instructions"] >= 4 and hopper["spill_bytes"] == 0, hopper
    assert "HGMMA" in fi.sass_excerpt("fa2_fwd_tma", "sm_90")
    assert hopper["registers"] < by[("fa2_fwd", "sm_90")]["registers"], (hopper, by[("fa2_fwd", "sm_90")])
    for arch in fi.ARCHS:
        assert by[("fa2_fwd", arch)]["tma_instructions"] == 0
        if arch != "sm_90":
            assert by[("fa2_fwd_tma", arch)]["tma_instructions"] == 0, arch
    assert " tma " in f" {fi.format_report(rows).splitlines()[1]} "


def test_tma_dkdv_spills_far_less_than_version_2_on_hopper(rows):
    """The reason for the TMA dK/dV: at sm_90's measured tile its descriptors free the registers that
    version 2 spends on addresses (triton 3.9: 216 bytes spilled -> 8), with TMA copies instead."""
    require_pinned_triton()                                  # spills: a fact about one Triton
    by = {(r["kernel"], r["arch"]): r for r in rows if r["dtype"] == "fp16"}
    v2, tma = by[("fa2_bwd_dkdv", "sm_90")], by[("fa2_bwd_dkdv_tma", "sm_90")]
    assert v2["config"] == tma["config"]
    assert tma["spill_bytes"] * 10 < v2["spill_bytes"] and tma["tma_instructions"] > 0, (v2, tma)
    assert all(by[("fa2_bwd_dkdv_tma", a)]["tma_instructions"] == 0 for a in fi.ARCHS if a != "sm_90")


def test_tables_print_every_row(rows, report):
    table = fi.format_report(rows).splitlines()
    assert len(table) == len(rows) + 2                                   # + the compilers, the heads
    assert len(fi.summary(rows).splitlines()) == len(fi.ARCHS) * len(fi.REPORT_DTYPES)
    full = fi.format_report(report).splitlines()                        # with the CUDA rows' long names
    for col in ("arch", "ok"):                                           # columns line up under their heads
        start = full[1].index(f"  {col} ") + 2
        assert all(line[start - 2:start] == "  " and line[start] != " " for line in full[2:]), (col, full)


def test_row_producers_are_the_extension_point(monkeypatch, rows):
    extra = dict(zip(fi.KEYS, ("other", "fake", "-", "sm_80", True, 1, 0, 0, 1, True)), compiler="x 1.0")
    monkeypatch.setattr(fi, "ROW_PRODUCERS", [*fi.ROW_PRODUCERS, lambda archs, cache: [extra]])
    assert fi.compile_report()[-1] == extra


def test_every_row_names_its_compiler(report):
    """A report is true for its compiler only (triton 3.9 and 3.6 differed by 2x on the same kernels)."""
    import importlib.metadata
    triton_version = importlib.metadata.version("triton")
    for r in report:
        want = f"triton {triton_version}" if r["backend"] == "triton" else "nvcc "
        assert r["compiler"].startswith(want), r
    assert f"triton {triton_version}" in fi.format_report(report).splitlines()[0]


def test_triton_rows_are_the_kernels_their_specs_describe(rows):
    names = [s.name for s in fi.triton_specs()]
    for arch in fi.ARCHS:
        for dtype in fi.REPORT_DTYPES:
            assert [r["kernel"] for r in rows if (r["arch"], r["dtype"]) == (arch, dtype)] == names
            assert all(f" d128 {dtype}" in r["config"] or r["kernel"] == "decode_combine"
                       for r in rows if (r["arch"], r["dtype"]) == (arch, dtype))


@pytest.mark.parametrize("arch", ["sm_75", "sm_90"])
def test_the_report_compiles_each_triton_kernel_as_its_spec_says(arch):
    """Signatures, constexprs and configs come from the KernelSpecs (no compiler needed to check)."""
    jobs = fi._triton_jobs(arch)
    assert [s for s, *_ in jobs] == list(fi.triton_specs())
    for s, signature, constexprs, cfg in jobs:
        assert tuple(signature) == s.arg_names and tuple(constexprs) == s.constexprs
        assert all(signature[n] == "constexpr" for n in s.constexprs)
        want = s.fixed if s.config is None else configs.arch_config(s, arch, fi.REPORT_HEAD_DIM, 2)
        if s.name == "decode_split":          # as a one-token GQA-4 step runs: 16 rows, the table's cap above
            assert fi.REPORT_DECODE_ROWS == (4, 1) and cfg.block_m == 16 <= want.block_m
            want = dataclasses.replace(want, block_m=16)
        assert cfg == want
        assert all(constexprs[n] == v for n, v in s.block_constexprs(cfg).items())
        label = fi._config_label(s, constexprs, cfg)
        assert f"w{cfg.num_warps}" in label and label.endswith(" causal") == ("CAUSAL" in s.constexprs)
    labels = {s.name: fi._config_label(s, c, cfg) for s, _, c, cfg in jobs}
    assert labels["fa2_bwd_preprocess"] == "M64-w4 d128 fp16"
    assert labels["decode_combine"] == "S16-w4 d128 fp32->fp16"


@pytest.mark.parametrize("version", [versions.PINNED, "3.6.0"])
def test_the_matrix_compiles_tma_kernels_only_for_the_dtypes_they_run(version):
    """No compiles: fa2_fwd_v4_tma.supported refuses every dtype but fp16/bf16 (fp32 runs versions 1 and 2),
    so the version matrix makes no fp32 TMA job on sm_90, and the 16-bit ones make them there only."""
    require_module("triton")
    tma = {"fa2_fwd_tma", "fa2_bwd_dkdv_tma"}
    assert fi.TMA_DTYPES == ("fp16", "bf16")
    for dtype in fi.DTYPES:
        kernels = {j["kernel"] for j in fi.matrix_jobs(version, "sm_90", dtype)}
        assert "fa2_fwd" in kernels and "fa2_bwd_dkdv" in kernels, (dtype, kernels)
        assert (kernels >= tma) if dtype in fi.TMA_DTYPES else not kernels & tma, (dtype, kernels)
        assert not {j["kernel"] for j in fi.matrix_jobs(version, "sm_80", dtype)} & tma
    import torch
    from flashlib.kernels.triton import fa2_fwd_v4_tma
    q = torch.zeros(1, 1, 16, 64)
    assert "float16 or bfloat16" in fa2_fwd_v4_tma.supported(q, q, q)       # what the dtype rule stands on


def test_a_constexpr_the_report_has_no_value_for_is_named(monkeypatch):
    from flashlib.kernels.triton import tl, triton

    @triton.jit
    def kernel(X, N, NEW: tl.constexpr):
        tl.store(X + tl.arange(0, NEW), N)

    new = tspec.KernelSpec("new_kernel", kernel, grid=lambda a: (1,), fixed=configs.Config(16, 0),
                           uses_dot=False)                  # NEW: a constexpr with no default
    monkeypatch.setattr(fi, "triton_specs", lambda: (new,))
    with pytest.raises(ValueError, match=r"no value for new_kernel's constexprs \['NEW'\]"):
        fi._triton_jobs("sm_80")


@pytest.mark.parametrize("archs", [(), ("ampere",), "sm80", (80,)])
def test_bad_archs_are_refused(archs):
    with pytest.raises(ValueError, match="archs must be"):
        fi.compile_report(archs)


@pytest.mark.parametrize("dtypes", [(), ("float16",), "fp8"])
def test_bad_dtypes_are_refused(dtypes):
    with pytest.raises(ValueError, match="dtypes must be"):
        fi.compile_report(dtypes=dtypes)


@pytest.mark.parametrize("version,error", [("3.1.0", ValueError), ("3.2", ValueError), ("latest", ValueError),
                                           (3.2, TypeError)])
def test_bad_triton_versions_are_refused(version, error):
    with pytest.raises(error, match="version must be"):
        fi.compile_report(triton=version)


def test_other_tritons_install_into_their_own_folders():
    """triton==X installs (pip --no-deps --target) into <cache>/triton/X; the installed one needs none."""
    require_module("triton")
    assert triton_versions.ensure(triton_versions.installed_version()) is None
    folder = triton_versions.ensure("3.2.0")
    assert folder == triton_versions.folder("3.2.0") and folder.name == "3.2.0"
    assert "'3.2.0'" in (folder / "triton" / "__init__.py").read_text() or \
        list(folder.glob("triton-3.2.0.dist-info"))
    assert triton_versions.ensure("3.2.0") == folder                # the second call installs nothing


def test_cli_compiles_with_another_triton_and_dtype():
    require_module("triton")
    require_tool("nvcc")
    out = run_cli("compile-report", "--triton", "3.6.0", "--dtype", "fp32", "--arch", "sm_80")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "triton 3.6.0" in out.stdout.splitlines()[0] and "d128 fp32" in out.stdout, out.stdout[:2000]
    bad = run_cli("compile-report", "--triton", "2.9.0")
    assert bad.returncode == 2 and "version must be" in bad.stderr, bad.stderr
