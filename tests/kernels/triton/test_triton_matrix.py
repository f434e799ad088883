"""The version matrix: every Triton kernel and every config its table can choose, cross-compiled on a CPU
for sm_75 to sm_90, in fp16, bf16 and fp32, with each Triton of versions.TESTED (the oldest supported,
torch 2.7's, Colab's current, the pinned one), specialised as the GPU's JIT specialises them
(flashlib.tools.compile_report.matrix_rows). Each must compile and fit its architecture's shared memory;
bf16 below sm_80 must be refused before compiling.

Needs the network once (pip installs each Triton into ~/.cache/flashlib/triton/<version>) and the wheels'
ptxas/cuobjdump. Cold, the matrix is ~650 compiles (minutes on 2 cores); its rows are cached on disk by
kernel-source hash, Triton version, arch and dtype, so a warm run takes seconds.
FLASHLIB_MATRIX=full compiles every head dim (64, 128, 256) of each config, not only its largest.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, require_module, require_tool

from flashlib.hardware import ARCH_SMEM_LIMIT
from flashlib.kernels.triton import configs, versions
from flashlib.tools import compile_report as fi
from flashlib.tools import triton_versions

CELLS = [(v, a, d) for v in versions.TESTED for a in fi.MATRIX_ARCHS.get(v, fi.ARCHS) for d in fi.DTYPES]
TABLE_FILE = "triton-matrix.txt"          # the table, beside the cache, for the closing note


@pytest.fixture(scope="module")
def matrix():
    require_module("triton")
    require_tool("ptxas")
    require_tool("cuobjdump")
    rows = fi.matrix_rows()
    table = fi.matrix_table(rows)
    print("\n" + table)
    from flashlib.tools import toolchain
    (toolchain.cache_dir("compile-report") / TABLE_FILE).write_text(table + "\n")
    return rows


def _cell(rows, version, arch, dtype):
    return [r for r in rows if (r["compiler"], r["arch"], r["dtype"]) == (f"triton {version}", arch, dtype)]


def _runs_there(s, version, arch, dtype) -> bool:
    return not s.name.endswith("_tma") or (versions.has_tensor_descriptors(version) and arch == "sm_90"
                                           and dtype in fi.TMA_DTYPES)


def _table_choices(version, arch, dtype) -> tuple[set, set]:
    """What the launcher can run there, read through configs' own functions: the (kernel, config) its
    tables can choose (the kernel's name alone for a fixed config), and the (kernel, head dim) that
    configs.refusal refuses."""
    name = fi.TORCH_NAMES[dtype]
    elem_bytes = 4 if configs.upcast_tiles(name, arch, version) else fi.ELEM_BYTES[dtype]
    want, refused = set(), set()
    for s in (s for s in fi.triton_specs() if _runs_there(s, version, arch, dtype)):
        if s.config is None:
            want.add(s.name)
            continue
        for block_d in fi.MATRIX_HEAD_DIMS:
            if configs.refusal(s.config, arch, block_d, name, version):
                refused.add((s.name, block_d))
                continue
            want |= {(s.name, str(c)) for c in configs.arch_candidates(s, arch, block_d, elem_bytes)}
    return want, refused


@pytest.mark.parametrize("version,arch,dtype", CELLS, ids=["-".join(c) for c in CELLS])
def test_every_candidate_compiles_and_fits_or_is_refused(matrix, version, arch, dtype):
    cell = _cell(matrix, version, arch, dtype)
    if dtype == "bf16" and (int(arch[3:]) < 80 or not versions.bf16_compiles(arch, version)):
        assert len(cell) == 1 and cell[0].get("refused"), cell                         # no compiles
        assert "bfloat16" in cell[0]["refused"] and "sm_80" in cell[0]["refused"]
        with pytest.raises(ValueError, match="bfloat16"):
            configs.check_dtype_arch("bfloat16", arch, version)
        return
    built = [r for r in cell if "refused" not in r]
    failed = [(r["kernel"], r["config"], r["error"]) for r in built if not r["ok"]]
    assert built and not failed, failed
    limit = ARCH_SMEM_LIMIT[arch] * 1024
    too_big = [(r["kernel"], r["config"], r["shared_bytes"]) for r in built if r["shared_bytes"] > limit]
    assert not too_big and all(r["fits"] for r in built), (limit, too_big)
    want, refused = _table_choices(version, arch, dtype)
    got = {(r["kernel"], r["config"].split()[0]) for r in built} | {r["kernel"] for r in built}
    assert not want - got, f"configs the tables can choose that the matrix did not compile: {want - got}"
    assert {(r["kernel"], r["block_d"]) for r in cell if "refused" in r} == refused
    assert all(r["compiler"] == f"triton {version}" for r in cell)
    tma = {r["kernel"] for r in built if r["kernel"].endswith("_tma")}
    assert bool(tma) == (arch == "sm_90" and versions.has_tensor_descriptors(version)
                         and dtype in fi.TMA_DTYPES), tma


@pytest.mark.parametrize("arch", fi.ARCHS)
def test_tensor_cores_on_each_version_are_what_versions_says(matrix, arch):
    """The fact behind mma_on_tensor_cores: tl.dot on sm_75 is HMMA up to 3.2 and FFMA from 3.3 on."""
    for version in versions.TESTED:
        cell = [r for r in _cell(matrix, version, arch, "fp16") if r["kernel"] == "fa2_fwd"]
        if not cell:
            continue
        want = versions.mma_on_tensor_cores(arch, version)
        assert all((r["mma_instructions"] > 0) == want == r["tensor_cores"] for r in cell), (version, cell)


def test_triton_3_3_on_sm75_needs_fp32_tiles_for_tl_dot(matrix):
    """The T4 finding: triton 3.3 fails to compile fp16 tiles into tl.dot for sm_75 (the compiler aborts:
    "Unsupported conversion from f16 to f16"); fp32 tiles (UPCAST, what the launcher passes there)
    compile. triton 3.9 compiles the fp16 tiles."""
    from flashlib.kernels.triton import fa2_fwd_v1
    assert versions.dot_needs_fp32_tiles("sm_75", "3.3.1")
    assert not versions.dot_needs_fp32_tiles("sm_75", "3.9.0")
    cfg = configs.arch_config(fa2_fwd_v1.SPEC, "sm_75", 128, 2)
    jobs = [fi._job(fa2_fwd_v1.SPEC, "sm_75", "fp16", v, 128, cfg, upcast=up)
            for v, up in (("3.3.1", False), ("3.3.1", True), (versions.PINNED, False))]
    without, with_fp32, pinned = fi._rows_of(jobs)
    assert not without["ok"] and without["error"], without
    assert with_fp32["ok"] and "fp32-tiles" in with_fp32["config"], with_fp32
    assert pinned["ok"] and "fp32-tiles" not in pinned["config"], pinned
    # and the matrix compiled 3.3's sm_75 fp16 rows the launcher's way: with fp32 tiles
    matmuls = [r for r in _cell(matrix, "3.3.1", "sm_75", "fp16") if r["kernel"] in ("fa2_fwd", "fa2_bwd_dq")]
    assert matmuls and all("fp32-tiles" in r["config"] for r in matmuls), matmuls


def test_matrix_table_has_a_line_per_version_and_arch(matrix):
    table = fi.matrix_table(matrix).splitlines()
    pairs = {(v, a) for v, a, _ in CELLS}
    assert len(table) == 1 + len(pairs)
    assert table[0].split()[:2] == ["compiler", "arch"] and all(d in table[0] for d in fi.DTYPES)
    for v, a in pairs:
        line = next(ln for ln in table if ln.startswith(f"triton {v} ") and f" {a} " in ln)
        assert ("refuses" in line) == (a == "sm_75"), line        # bf16 below sm_80
        assert "compile" in line


@pytest.mark.parametrize("version", versions.TESTED)
def test_flashlib_imports_beside_each_triton(version):
    """torch 2.13 (CPU) beside each tested Triton: flashlib and its Triton kernels import, in the
    interpreter and in compile mode (what a reader with that Triton gets)."""
    require_module("triton")
    folder = triton_versions.ensure(version)
    for interpret in ("1", "0"):
        env = dict(os.environ, TRITON_INTERPRET=interpret,
                   PYTHONPATH=os.pathsep.join([str(folder)] * (folder is not None) + [str(ROOT)]))
        code = ("import triton, flashlib, flashlib.kernels.triton as t\n"
                "from flashlib.tools.compile_report import triton_specs; triton_specs()\n"
                "print(triton.__version__, t.INTERPRET)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == [version, str(interpret == "1")], out.stdout


def test_the_matrix_jobs_follow_the_launchers_rules():
    """No compiles: matrix_jobs asks what the launcher would (dtype_refusal, kernel_refusal, tile_bytes)
    and makes no job for what flashlib refuses before launching."""
    from flashlib.kernels.triton import fa2_bwd_v2
    assert fi.dtype_refusal("bf16", "sm_75", "3.6.0") and fi.dtype_refusal("fp16", "sm_75", "3.6.0") is None
    assert fi.matrix_jobs("3.6.0", "sm_75", "bf16") == []
    assert fi.tile_bytes("fp16", "sm_75", "3.3.1") == 4 and fi.tile_bytes("fp16", "sm_75", "3.6.0") == 2
    assert fi.tile_bytes("fp32", "sm_80", "3.9.0") == 4
    for version, dtype in (("3.3.1", "fp16"), ("3.2.0", "fp32")):
        assert fi.kernel_refusal(fa2_bwd_v2.DKDV_SPEC, "sm_75", dtype, version, 256)
        jobs = fi.matrix_jobs(version, "sm_75", dtype)
        assert jobs and not [j for j in jobs if j["kernel"] == "fa2_bwd_dkdv" and j["block_d"] == 256]
        assert [j for j in jobs if j["kernel"] == "fa2_bwd_dkdv" and j["block_d"] == 128]
    assert fi.kernel_refusal(fa2_bwd_v2.DKDV_SPEC, "sm_75", "fp32", "3.6.0", 256) is None


# The serving switches (chapter 10) as every tested Triton compiles them, on the arches the matrix
# compiles for that version: the forward with VARLEN, the ragged backward's dK/dV and dQ (VARLEN fixed
# on), decode's split kernel with PAGED and the append kernel; fp16, d = 128, each arch's table config
# (the report's problem), specialised as the JIT specialises them.
@pytest.mark.parametrize("version", versions.TESTED)
def test_the_serving_kernels_compile_and_fit_under_every_tested_triton(version):
    import dataclasses
    require_module("triton")
    require_tool("ptxas")
    require_tool("cuobjdump")
    from flashlib.kernels.triton import decode_v3, fa2_bwd_v2, fa2_fwd_v1
    jobs = []
    for arch in fi.MATRIX_ARCHS.get(version, fi.ARCHS):
        elem_bytes = fi.tile_bytes("fp16", arch, version)
        for spec, flags in ((fa2_fwd_v1.SPEC, {"VARLEN": True}), (fa2_bwd_v2.DKDV_VARLEN_SPEC, {}),
                            (fa2_bwd_v2.DQ_VARLEN_SPEC, {}), (decode_v3.SPLIT_SPEC, {"PAGED": True}),
                            (decode_v3.APPEND_SPEC, {"PAGED": True})):
            cfg = spec.fixed or configs.arch_config(spec, arch, fi.REPORT_HEAD_DIM, elem_bytes)
            if spec is decode_v3.SPLIT_SPEC:                  # the rows the report compiles it with
                cfg = dataclasses.replace(cfg, block_m=decode_v3.split_block_m(cfg.block_m,
                                                                               *fi.REPORT_DECODE_ROWS))
            job = fi._job(spec, arch, "fp16", version, fi.REPORT_HEAD_DIM, cfg)
            job["constexprs"].update(flags)
            job["label"] += "".join(f" {n.lower()}" for n in flags)
            jobs.append(job)
    rows = fi._rows_of(jobs)
    failed = [(r["kernel"], r["config"], r["arch"], r["error"]) for r in rows if not r["ok"]]
    assert not failed, failed
    too_big = [(r["kernel"], r["arch"], r["shared_bytes"]) for r in rows
               if r["shared_bytes"] > ARCH_SMEM_LIMIT[r["arch"]] * 1024]
    assert not too_big, too_big
    assert len(rows) == 5 * len(fi.MATRIX_ARCHS.get(version, fi.ARCHS))
    assert all(r["compiler"] == f"triton {version}" for r in rows)
