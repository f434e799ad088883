"""What the kernels compile to, on every GPU a reader meets — measured by the compiler, with no GPU.

:func:`compile_report` compiles each kernel for each architecture (Triton's ``GPUTarget``
cross-compilation: PTX, then ``ptxas`` to a cubin), then reads what the hardware would get: registers
and spill bytes (``ptxas -v``), shared memory (Triton's allocation plus any static), and the
tensor-core instructions in the SASS (``cuobjdump -sass``: HMMA on sm_75–89, HGMMA on sm_90).
``ptxas`` and ``cuobjdump`` ship in the triton wheel (``triton/backends/nvidia/bin``).

Triton's mode is fixed per process at its first import (interpreter or compiler), so the compiling is
always done in child processes (one per architecture, as many at a time as there are cores), which
also keeps a notebook that interprets kernels free to go on interpreting. Results are cached on disk
(``$FLASHLIB_CACHE_DIR`` or ``~/.cache/flashlib``), keyed by a hash of the kernel sources, this file
and the triton version: edit a kernel and its rows are compiled afresh.

A report is true only for the compiler that produced it: the same kernels cross-compiled by triton 3.9
on a CPU and JIT-compiled by triton 3.6 on an H100 differed by up to 2x (the forward's shared memory
66,560 vs 131,072 bytes; the decode split's registers 230 vs 112). So every row names its compiler
(``compiler``: "triton 3.9.0", "nvcc 13.0"), the table says it, and the GPU tier
(tests/gpu/test_compile_report_gpu.py) checks that the rows for the GPU's own architecture match what
that GPU really compiled, with the same Triton.

Other backends add rows by appending a producer ``f(archs) -> list[dict]`` to :data:`ROW_PRODUCERS`
(e.g. ``backend="cuda"`` rows from nvcc ``--resource-usage``, which name the kernel version — v1, v2,
v3 — and add ``ldsm_instructions``/``ldgsts_instructions``); each row has the keys of :data:`KEYS`.
Triton rows add ``tma_instructions``: the TMA copies (UTMALDG, UTMASTG) in the SASS, which only the TMA
kernels (tensor descriptors: fa2_fwd_tma, fa2_bwd_tma) have, and only on sm_90.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable

from ..hardware import ARCH_SMEM_LIMIT
from . import toolchain

__all__ = ["ARCHS", "KEYS", "ROW_PRODUCERS", "compile_report", "triton_rows", "triton_specs", "sass_excerpt",
           "format_report", "summary", "compilers"]

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
KEYS = ("backend", "kernel", "config", "arch", "ok", "registers", "spill_bytes", "shared_bytes",
        "mma_instructions", "tensor_cores")
REPORT_HEAD_DIM = 128                                # the problem the report compiles for: d = 128,
REPORT_DTYPE = "fp16"                                # fp16, causal (every kernel in its heavier variant)

_PKG = pathlib.Path(__file__).resolve().parents[1]     # flashlib/


def _check_archs(archs) -> tuple[str, ...]:
    if isinstance(archs, str):
        archs = (archs,)
    archs = tuple(archs)
    bad = [a for a in archs if not isinstance(a, str) or not re.fullmatch(r"sm_\d{2,3}a?", a)]
    if bad or not archs:
        raise ValueError(f"archs must be a non-empty sequence like ('sm_80', 'sm_90'), got {archs!r}")
    return archs


# ------------------------------------------------------------------------------------- the kernels

# The constexpr values of the problem the report compiles (d = 128, causal, true fp32 dots; the decode
# combine for 16 splits; the TMA forward (version 4) as it runs by default, not warp-specialized); BLOCK_M and
# BLOCK_N come from each kernel's config.
REPORT_CONSTEXPRS = dict(CAUSAL=True, BLOCK_D=REPORT_HEAD_DIM, UPCAST=False, PRECISION="ieee", BLOCK_S=16,
                         WARP_SPECIALIZE=False)
# The decode split kernel stacks a kv head's query rows (group · Nq of them) into one program, with
# split_block_m's rows: its config's block_m is only a cap. The report compiles it as it runs when a model
# generates one token with 4 query heads per kv head (Llama's 32/8): 16 rows, not the cap.
REPORT_DECODE_ROWS = (4, 1)                        # (group, Nq)
# TMA copies in the SASS (sm_90+): tensor loads (UTMALDG) and stores (UTMASTG) issued through a descriptor.
TMA_RE = re.compile(r"\bUTMA(LDG|STG)\b")


def triton_specs() -> tuple:
    """Every Triton kernel's KernelSpec (flashlib.kernels.triton.spec), in the report's order.

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_compile_report.py.
    """
    from ..kernels.triton import decode, fa2_bwd, fa2_bwd_tma, fa2_fwd, fa2_fwd_tma
    return (fa2_fwd.SPEC, fa2_fwd_tma.SPEC, fa2_bwd.PREPROCESS_SPEC, fa2_bwd.DKDV_SPEC, fa2_bwd_tma.DKDV_SPEC,
            fa2_bwd.DQ_SPEC,
            decode.SPLIT_SPEC, decode.COMBINE_SPEC)


def _triton_jobs(arch: str) -> list[tuple]:
    """``[(KernelSpec, signature, constexprs, config)]``: every Triton kernel as its spec describes it
    (flashlib.kernels.triton.spec), with the config ``configs`` picks for ``arch`` (or its fixed one).

    Runs in the compiling child process (Triton in compile mode)."""
    from ..kernels.triton import configs
    from ..kernels.triton import decode
    jobs = []
    for s in triton_specs():
        cfg = s.fixed if s.config is None else configs.arch_config(s, arch, REPORT_HEAD_DIM, 2)
        if s is decode.SPLIT_SPEC:                   # the rows it really runs with (REPORT_DECODE_ROWS)
            cfg = dataclasses.replace(cfg, block_m=decode.split_block_m(cfg.block_m, *REPORT_DECODE_ROWS))
        values = {**REPORT_CONSTEXPRS, **s.block_constexprs(cfg)}
        missing = [n for n in s.constexprs if n not in values]
        if missing:
            raise ValueError(f"the compile report has no value for {s.name}'s constexprs {missing}: "
                             "add them to REPORT_CONSTEXPRS")
        jobs.append((s, s.signature(REPORT_DTYPE), {n: values[n] for n in s.constexprs}, cfg))
    return jobs


def _config_label(spec, constexprs: dict, cfg) -> str:
    """"M128-N64-w8-s3 d128 fp16 causal" for a kernel with a config table, "M64-w4 d128 fp16" for one
    with fixed blocks; "fp32->fp16" where the kernel reads fp32 (the decode combine's partials)."""
    if spec.config is None:
        blocks = [f"{n.removeprefix('BLOCK_')}{v}" for n, v in constexprs.items()
                  if n.startswith("BLOCK_") and n != "BLOCK_D"]
        blocks = "-".join(blocks + [f"w{cfg.num_warps}"])
    else:
        blocks = str(cfg)
    first = next(iter(spec.pointers.values()))
    dtype = REPORT_DTYPE if first == "in" else f"{first}->{REPORT_DTYPE}"
    return f"{blocks} d{REPORT_HEAD_DIM} {dtype}" + (" causal" if constexprs.get("CAUSAL") else "")


def _cuobjdump(cubin, *args) -> str:
    """``cuobjdump args cubin``, with the triton wheel's own copy first (the tools of the ptxas that made
    the cubin)."""
    return toolchain.run_tool("cuobjdump", *args, cubin, purpose="reading Triton's cubin in the compile report",
                              triton_first=True)


def _compile_arch(arch: str) -> list[dict]:
    """Compile every kernel for ``arch`` (in this process, which must be in Triton's compile mode)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    cc = int(arch.removeprefix("sm_").rstrip("a"))
    rows = []
    for spec, signature, constexprs, cfg in _triton_jobs(arch):
        name, fn, uses_dot = spec.name, spec.fn, spec.uses_dot
        row = {"backend": "triton", "kernel": name, "config": _config_label(spec, constexprs, cfg), "arch": arch,
               "compiler": f"triton {triton.__version__}", "ok": False, "registers": None, "spill_bytes": None, "shared_bytes": None,
               "mma_instructions": None, "tensor_cores": uses_dot and cc >= 80, "stack_bytes": None,
               "error": None, "_sass": ""}
        # What Triton's JIT would specialise for this problem: pointers and strides (and d = 128) are
        # multiples of 16; the sequence lengths and head counts are left general.
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if signature[n].startswith("*") or n.startswith("stride") or n == "D"}
        log = io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):     # TRITON_DUMP_PTXAS_LOG=1 prints ptxas -v here
                kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                        target=GPUTarget("cuda", cc, 32),
                                        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        except Exception as exc:                        # a kernel that does not compile is a row too
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
            rows.append(row)
            continue
        row["compile_seconds"] = round(time.perf_counter() - t0, 2)
        ptxas = toolchain.parse_ptxas(log.getvalue()).get(kernel.name, {})
        row.update(registers=ptxas.get("registers"), spill_bytes=ptxas.get("spill_stores"),
                   stack_bytes=ptxas.get("stack_bytes"))
        with tempfile.TemporaryDirectory() as tmp:
            cubin = pathlib.Path(tmp) / f"{name}.cubin"
            cubin.write_bytes(kernel.asm["cubin"])
            usage = _cuobjdump(cubin, "--dump-resource-usage")
            sass = _cuobjdump(cubin, "-sass")
        static = re.search(r"SHARED:(\d+)", usage)
        row["shared_bytes"] = int(kernel.metadata.shared) + (int(static.group(1)) if static else 0)
        if row["registers"] is None:
            reg = re.search(r"REG:(\d+)", usage)
            row["registers"] = int(reg.group(1)) if reg else None
        row["mma_instructions"] = sum(toolchain.count_mma(sass).values())
        row["tma_instructions"] = sum(toolchain.count_mma(sass, TMA_RE).values())
        row["_sass"] = "\n".join(_sass_window(sass, 12))
        row["ok"] = row["spill_bytes"] is not None
        rows.append(row)
    return rows


def _sass_window(sass: str, n: int) -> list[str]:
    """``n`` SASS lines around the first tensor-core instruction (else the first FFMA: sm_75 Triton)."""
    lines = [re.sub(r"\s+", " ", re.sub(r"/\* 0x[0-9a-f]+ \*/", "", ln)).strip()
             for ln in sass.splitlines() if "/*" in ln and ";" in ln]
    first = next((i for i, ln in enumerate(lines) if toolchain.MMA_RE.search(ln)),
                 next((i for i, ln in enumerate(lines) if " FFMA " in ln), 0))
    start = max(0, first - 2)
    return lines[start:start + n]


# --------------------------------------------------------------------------------- the child processes

def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted((_PKG / "kernels" / "triton").glob("*.py")) + [pathlib.Path(__file__).resolve(),
                                                           _PKG / "hardware.py", _PKG / "tools" / "toolchain.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    try:
        from importlib.metadata import version
        h.update(version("triton").encode())
    except Exception:                                   # pragma: no cover - triton without metadata
        pass
    return h.hexdigest()[:20]


def _run_child(arch: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_ALWAYS_COMPILE="1", TRITON_DUMP_PTXAS_LOG="1",
               TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    root = str(_PKG.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    with tempfile.TemporaryDirectory(prefix="flashlib-report-") as tmp:
        env["TRITON_CACHE_DIR"] = tmp                   # fresh: no cross-process cache races
        proc = subprocess.run([sys.executable, "-m", "flashlib.tools.compile_report", "--child", arch],
                              capture_output=True, text=True, env=env, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling for {arch} failed in the child process:\n{proc.stderr[-3000:]}")
    marker = "FLASHLIB-REPORT-JSON:"
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(marker))
    return json.loads(line[len(marker):])


def _arch_rows(arch: str, cache: bool) -> list[dict]:
    folder = toolchain.cache_dir("compile-report")
    path = folder / f"triton-{arch}-{_source_hash()}.json"
    with toolchain.locked(folder / f"triton-{arch}.lock"):     # built, pruned and read under one lock
        if not (cache and path.exists()):
            toolchain.build_atomically(path, lambda tmp: tmp.write_text(json.dumps(_run_child(arch))))
        for stale in folder.glob(f"triton-{arch}-*.json"):
            if stale != path:                           # rows of older kernel sources
                stale.unlink(missing_ok=True)
        return json.loads(path.read_text())


def _all_rows(archs, cache: bool) -> list[dict]:
    workers = max(1, min(len(archs), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:   # threads wait on child processes
        results = list(pool.map(lambda a: _arch_rows(a, cache), archs))
    return [row for rows in results for row in rows]


def triton_rows(archs=ARCHS, *, cache: bool = True) -> list[dict]:
    """The Triton kernels' rows (see :func:`compile_report`), with the private ``_sass`` excerpts.

    Explained in: notebooks/07_triton.
    Tested in: tests/gpu/test_compile_report_gpu.py.
    """
    return _all_rows(_check_archs(archs), cache)


def cuda_rows(archs=ARCHS, *, cache: bool = True) -> list[dict]:
    """The CUDA C++ kernels' rows (nvcc -cubin per architecture; flashlib.kernels.cuda caches per source)."""
    from ..kernels import cuda
    return cuda.compile_rows(tuple(archs))


ROW_PRODUCERS: list[Callable] = [triton_rows, cuda_rows]


def compile_report(archs=ARCHS, *, cache: bool = True) -> list[dict]:
    """One row per (kernel, config, arch): what each kernel compiles to on each architecture.

    Args:
        archs: architectures like ``("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")``.
        cache: reuse rows cached on disk for these exact kernel sources (False: compile afresh).

    Returns:
        A list of dicts with keys ``backend`` ("triton"), ``kernel``, ``config`` (block sizes, warps,
        stages, head dim 128, fp16), ``arch``, ``ok`` (compiled), ``registers`` per thread,
        ``spill_bytes`` (ptxas spill stores), ``shared_bytes`` (per block), ``mma_instructions``
        (tensor-core instructions in the SASS), ``tensor_cores`` (whether this row is expected to use
        them: False for Triton on sm_75, where tl.dot becomes FFMA, and for kernels without a
        matmul), ``compiler`` (e.g. "triton 3.9.0": the report is true for that version only) — plus
        ``stack_bytes``, ``compile_seconds`` and ``error`` (None when ok).

    Compiles in child processes (see the module docstring); the first call takes about a minute on
    two cores, later calls read the cache.

    Explained in: notebooks/07_triton.

    Tested in: tests/tools/test_compile_report.py.
    """
    archs = _check_archs(archs)
    rows = []
    for producer in ROW_PRODUCERS:
        rows += [{k: v for k, v in row.items() if not k.startswith("_")}
                 for row in producer(archs, cache=cache)]
    return rows


def compilers(rows) -> str:
    """One line naming the compilers behind ``rows``: the report holds for these versions only.

    Explained in: notebooks/07_triton.

    Tested in: tests/tools/test_compile_report.py.
    """
    names = sorted({r.get("compiler", "?") for r in rows})
    return ("compiled by " + ", ".join(names) + " (a report is true for its compiler versions only: "
            "another Triton can allocate up to 2x the shared memory or registers)")


def sass_excerpt(kernel: str = "fa2_fwd", arch: str = "sm_80") -> str:
    """A dozen SASS lines of ``kernel`` compiled for ``arch``, around its first tensor-core instruction
    (HMMA, HGMMA; on sm_75, where Triton's tl.dot has none, around its first FFMA).

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_compile_report.py.
    """
    for row in triton_rows((arch,)):
        if row["kernel"] == kernel:
            return row["_sass"]
    raise ValueError(f"kernel must be one of the report's kernels, got {kernel!r}")


def format_report(rows) -> str:
    """The rows as a fixed-width table, after a line naming the compilers (:func:`compilers`); the
    CUDA C++ rows also show their ldmatrix (LDSM) and cp.async (LDGSTS) counts, the Triton rows their
    TMA copies (UTMALDG/UTMASTG).

    Explained in: notebooks/07_triton.
    Tested in: tests/tools/test_compile_report.py.
    """
    def wide(key, least):                           # a column as wide as its longest value
        return max([least, *(len(str(r.get(key, ""))) for r in rows)])
    cols = [("backend", 7), ("kernel", wide("kernel", 20)), ("arch", 5), ("config", wide("config", 30)),
            ("ok", 5), ("registers", 4), ("spill_bytes", 6), ("shared_bytes", 7), ("mma_instructions", 5), ("ldsm_instructions", 4),
            ("ldgsts_instructions", 6), ("tma_instructions", 3), ("tensor_cores", 5)]
    heads = {"registers": "regs", "spill_bytes": "spill", "shared_bytes": "smem", "mma_instructions": "mma",
             "ldsm_instructions": "ldsm", "ldgsts_instructions": "ldgsts", "tma_instructions": "tma",
             "tensor_cores": "TC"}
    out = [compilers(rows), "  ".join(f"{heads.get(c, c):<{w}}" for c, w in cols)]
    for r in rows:                                  # ldsm/ldgsts: the CUDA C++ rows only; tma: Triton's
        out.append("  ".join(f"{str(r.get(c, '-')):<{w}}" for c, w in cols))
    return "\n".join(out)


def summary(rows) -> str:
    """Per arch and kernel: registers / spill bytes / shared KB (limit), and mma count — one line each.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/tools/test_compile_report.py.
    """
    lines = []
    for arch in dict.fromkeys(r["arch"] for r in rows):
        limit = ARCH_SMEM_LIMIT.get(arch)
        parts = []
        for r in (r for r in rows if r["arch"] == arch):
            if not r["ok"]:
                parts.append(f"{r['kernel']}: FAILED")
                continue
            parts.append(f"{r['kernel']} {r['registers']}r/{r['spill_bytes']}sp/"
                         f"{r['shared_bytes'] / 1024:.0f}KB/{r['mma_instructions']}mma")
        lines.append(f"{arch} (smem limit {limit} KB): " + ", ".join(parts))
    return "\n".join(lines)


def _child_main(arch: str) -> None:
    from ..kernels.triton import INTERPRET
    if INTERPRET:
        raise SystemExit("the compile-report child must run with TRITON_INTERPRET=0")
    rows = _compile_arch(arch)
    print("FLASHLIB-REPORT-JSON:" + json.dumps(rows), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child_main(sys.argv[2])
    else:
        raise SystemExit("usage: python -m flashlib compile-report  (this module's own entry is internal)")
