"""What the kernels compile to, on every GPU a reader meets — measured by the compiler, with no GPU.

:func:`compile_report` compiles each kernel for each architecture (Triton's ``GPUTarget``
cross-compilation: PTX, then ``ptxas`` to a cubin), then reads what the hardware would get: registers
and spill bytes (``ptxas -v``), shared memory (Triton's allocation plus any static), and the
tensor-core instructions in the SASS (``cuobjdump -sass``: HMMA on sm_75–89, HGMMA on sm_90).
``ptxas`` and ``cuobjdump`` ship in the triton wheel (``triton/backends/nvidia/bin``).

Triton's mode is fixed per process at its first import (interpreter or compiler), so the compiling is
always done in child processes (as many at a time as there are cores), which also keeps a notebook that
interprets kernels free to go on interpreting. A child can compile with another Triton release
(``triton="3.2.0"``): :mod:`flashlib.tools.triton_versions` installs it into its own folder, which the
child puts first on ``PYTHONPATH``. Every version is asked what its JIT would compile (pointers,
strides and the head dim specialised as divisible by 16: up to 3.2 through an ``AttrsDescriptor``, from
3.3 through a dict), and every version's ``ptxas -v`` is read the same way, from the ptxas run that
made the cubin (:class:`_PtxasLogs`; ``TRITON_DUMP_PTXAS_LOG`` exists only from 3.5). Rows are cached
on disk (``$FLASHLIB_CACHE_DIR`` or ``~/.cache/flashlib``), one file per (Triton version, arch, dtype),
keyed by a hash of the kernel sources and this file: edit a kernel and its rows are compiled afresh.
The version matrix (:func:`matrix_rows`, tests/kernels/triton/test_triton_matrix.py) compiles every
config the tables can choose, with every tested Triton, through the same cache.

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
kernels (tensor descriptors: fa2_fwd_v4_tma, fa2_bwd_v5_tma) have, and only on sm_90.

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

__all__ = ["ARCHS", "KEYS", "DTYPES", "ROW_PRODUCERS", "compile_report", "triton_rows", "triton_specs",
           "sass_excerpt", "format_report", "summary", "compilers", "dtype_refusal", "kernel_refusal",
           "tile_bytes", "matrix_jobs", "matrix_rows",
           "matrix_table"]

ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
KEYS = ("backend", "kernel", "config", "arch", "ok", "registers", "spill_bytes", "shared_bytes",
        "mma_instructions", "tensor_cores")
REPORT_HEAD_DIM = 128                                # the problem the report compiles for: d = 128,
                                                     # causal (every kernel in its heavier variant)

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

# The constexpr values of the problem the report compiles (causal, true fp32 dots; the decode combine for
# 16 splits; the TMA forward (version 4) as it runs by default, not warp-specialized); BLOCK_M and BLOCK_N
# come from each kernel's config; a job's BLOCK_D is its head dim and its UPCAST the launcher's rule
# (_upcast), these being the defaults. A constexpr the kernel gives a default (KernelSpec.defaults) is
# compiled at it unless named here; a spec's constants (KernelSpec.constants) always at theirs.
REPORT_CONSTEXPRS = dict(CAUSAL=True, BLOCK_D=REPORT_HEAD_DIM, UPCAST=False, PRECISION="ieee", BLOCK_S=16,
                         WARP_SPECIALIZE=False)
# The decode split kernel stacks a kv head's query rows (group · Nq of them) into one program, with
# split_block_m's rows: its config's block_m is only a cap. The report compiles it as it runs when a model
# generates one token with 4 query heads per kv head (Llama's 32/8): 16 rows, not the cap. (The version
# matrix compiles the cap: the most rows a program can take.)
REPORT_DECODE_ROWS = (4, 1)                        # (group, Nq)
# TMA copies in the SASS (sm_90+): tensor loads (UTMALDG) and stores (UTMASTG) issued through a descriptor.
TMA_RE = re.compile(r"\bUTMA(LDG|STG)\b")
# cp.async copies (sm_80+): the loads Triton's pipeliner stages ahead; only aligned (divisible-by-16) ones.
LDGSTS_RE = re.compile(r"\bLDGSTS\b")
DTYPES = ("fp16", "bf16", "fp32")                  # Triton's names for the inputs' dtypes
REPORT_DTYPES = ("fp16", "fp32")                   # the default report: bf16 on request (dtypes=)
ELEM_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
TORCH_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
MATRIX_HEAD_DIMS = (64, 128, 256)                  # the version matrix: every table's head-dim classes
# The TMA kernels' inputs: fa2_fwd_v4_tma.supported refuses any other dtype (fp32 runs versions 1 and 2), so the
# version matrix compiles no fp32 TMA kernel (its row would stand for nothing flashlib launches).
TMA_DTYPES = ("fp16", "bf16")


def triton_specs() -> tuple:
    """Every Triton kernel's KernelSpec (flashlib.kernels.triton.spec), in the report's order.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    from ..kernels.triton import decode_v3 as decode, fa2_bwd_v2, fa2_bwd_v5_tma, fa2_fwd_v1, fa2_fwd_v4_tma
    return (fa2_fwd_v1.SPEC, fa2_fwd_v4_tma.SPEC, fa2_bwd_v2.PREPROCESS_SPEC, fa2_bwd_v2.DKDV_SPEC, fa2_bwd_v5_tma.DKDV_SPEC,
            fa2_bwd_v2.DQ_SPEC,
            decode.SPLIT_SPEC, decode.COMBINE_SPEC)


def compile_specs() -> tuple:
    """Every KernelSpec a compile job may name: the report's (:func:`triton_specs`) and the kernels
    compiled only when a job asks for them (their own tests do): the ragged backward's dK/dV and dQ
    (VARLEN fixed on, their own grids) and decode's append kernel. The child process looks a job's
    spec up here, so any of them compiles through :func:`_rows_of` and its cache.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_varlen_bwd.py.
    """
    from ..kernels.triton import decode_v3, fa2_bwd_v2
    return (*triton_specs(), fa2_bwd_v2.DKDV_VARLEN_SPEC, fa2_bwd_v2.DQ_VARLEN_SPEC, decode_v3.APPEND_SPEC)


def _is_tma(spec) -> bool:
    """The kernels through tensor descriptors (tl.make_tensor_descriptor: triton >= 3.4)."""
    return spec.name.endswith("_tma")


def _in_matrix(spec, arch: str, version: str, dtype: str) -> bool:
    """The version matrix compiles the TMA kernels only where they run: sm_90+, triton >= 3.4, and
    16-bit inputs (:data:`TMA_DTYPES`)."""
    from ..kernels.triton import versions
    cc = int(arch.removeprefix("sm_").rstrip("a"))
    return not _is_tma(spec) or (dtype in TMA_DTYPES and cc >= 90
                                 and versions.has_tensor_descriptors(version))


def _check_dtypes(dtypes) -> tuple[str, ...]:
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    dtypes = tuple(dtypes)
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise ValueError(f"dtypes must be a non-empty sequence of {DTYPES}, got {dtypes!r}")
    return dtypes


def _version(triton) -> str:
    """``triton=`` checked: a full release like "3.2.0" (None: the installed one)."""
    from . import triton_versions
    if triton is None:
        found = triton_versions.installed_version()
        if found is None:
            raise RuntimeError("the compile report needs triton (pip install triton), or triton='3.6.0'")
        return found
    triton_versions.folder(triton)                      # ValueError/TypeError for a bad version
    return triton


def _upcast(dtype: str, arch: str, version: str) -> bool:
    """The UPCAST the launcher passes on a GPU: fp32 tiles into tl.dot where fp16/bf16 ones do not
    compile (sm_75 with triton 3.3), as configs.upcast_tiles decides it for every launcher."""
    from ..kernels.triton import configs
    return bool(configs.upcast_tiles(TORCH_NAMES[dtype], arch, version))


def dtype_refusal(dtype: str, arch: str, version: str) -> str | None:
    """Why flashlib refuses ``dtype`` on ``arch`` with this Triton before compiling anything
    (configs.check_dtype_arch: bfloat16 below sm_80), or None.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_matrix.py.
    """
    from ..kernels.triton import configs
    try:
        configs.check_dtype_arch(TORCH_NAMES[dtype], arch, version=version)
    except ValueError as exc:
        return str(exc)
    return None


def tile_bytes(dtype: str, arch: str, version: str) -> int:
    """The bytes per tile element the launcher budgets shared memory for (configs.tile_plan): 4 where
    fp16/bf16 tiles are loaded as fp32 (:func:`_upcast`), else the dtype's size.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_matrix.py.
    """
    return 4 if _upcast(dtype, arch, version) else ELEM_BYTES[dtype]


def kernel_refusal(spec, arch: str, dtype: str, version: str, block_d: int) -> str | None:
    """Why flashlib refuses ``spec``'s kernel there before launching (configs.refusal, e.g. the fp16
    dK/dV at d > 128 on sm_75 with triton 3.3), or None.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_matrix.py.
    """
    from ..kernels.triton import configs
    if spec.config is None:
        return None
    return configs.refusal(spec.config, arch, block_d, TORCH_NAMES[dtype], version)


def _job(spec, arch: str, dtype: str, version: str, block_d: int, cfg, *, upcast=None) -> dict:
    """One compile as plain data (it crosses to the child process, and keys the cache)."""
    values = {**spec.defaults, **REPORT_CONSTEXPRS, **spec.constants, "BLOCK_D": block_d,
              "UPCAST": _upcast(dtype, arch, version) if upcast is None else bool(upcast),
              **spec.block_constexprs(cfg)}
    missing = [n for n in spec.constexprs if n not in values]
    if missing:
        raise ValueError(f"the compile report has no value for {spec.name}'s constexprs {missing}: "
                         "add them to REPORT_CONSTEXPRS")
    constexprs = {n: values[n] for n in spec.constexprs}
    return {"kernel": spec.name, "arch": arch, "dtype": dtype, "triton": version, "block_d": block_d,
            "config": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages], "constexprs": constexprs,
            "label": _config_label(spec, constexprs, cfg, dtype, block_d)}


def _job_id(job: dict) -> str:
    return hashlib.sha256(json.dumps(job, sort_keys=True).encode()).hexdigest()[:16]


def _triton_jobs(arch: str, dtype: str = "fp16", version=None) -> list[tuple]:
    """``[(KernelSpec, signature, constexprs, config)]``: every Triton kernel as its spec describes it
    (flashlib.kernels.triton.spec), with the config ``configs`` picks for ``arch`` (or its fixed one), at
    d = :data:`REPORT_HEAD_DIM`; the TMA kernels only with a Triton that has tensor descriptors."""
    from ..kernels.triton import configs, decode_v3 as decode, versions
    version = _version(version)
    jobs = []
    for s in triton_specs():
        if _is_tma(s) and not versions.has_tensor_descriptors(version):
            continue
        cfg = s.fixed if s.config is None else \
            configs.arch_config(s, arch, REPORT_HEAD_DIM, tile_bytes(dtype, arch, version))
        if s is decode.SPLIT_SPEC:                   # the rows it really runs with (REPORT_DECODE_ROWS)
            cfg = dataclasses.replace(cfg, block_m=decode.split_block_m(cfg.block_m, *REPORT_DECODE_ROWS))
        job = _job(s, arch, dtype, version, REPORT_HEAD_DIM, cfg)
        jobs.append((s, s.signature(dtype), job["constexprs"], cfg))
    return jobs


def matrix_jobs(version: str, arch: str, dtype: str, block_ds=MATRIX_HEAD_DIMS, *, full=None) -> list[dict]:
    """Every compile the version matrix makes for one (Triton, arch, dtype): each kernel with each config
    its table can choose on ``arch`` (configs.arch_candidates, per head-dim class in ``block_ds``), the
    decode split at its row cap; the TMA kernels only on sm_90+ with tensor descriptors and for fp16/bf16
    (:data:`TMA_DTYPES`: fp32 never reaches them). ``[]`` where
    :func:`dtype_refusal` refuses the dtype; none for a (kernel, head dim) :func:`kernel_refusal`
    refuses. Tile tables are read with the launcher's :func:`tile_bytes`. A config chosen at several
    head dims is compiled at the largest
    (its tiles, so its shared memory and registers, grow with the head dim), unless ``full`` (default:
    ``FLASHLIB_MATRIX=full`` in the environment) asks for every head dim.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_matrix.py.
    """
    from ..kernels.triton import configs
    full = os.environ.get("FLASHLIB_MATRIX", "") == "full" if full is None else full
    if dtype_refusal(dtype, arch, version) is not None:
        return []
    jobs, elem_bytes = {}, tile_bytes(dtype, arch, version)
    for s in (s for s in triton_specs() if _in_matrix(s, arch, version, dtype)):
        for block_d in sorted(block_ds, reverse=True):
            if kernel_refusal(s, arch, dtype, version, block_d) is not None:
                continue                                 # matrix_rows records the refusal
            cfgs = [s.fixed] if s.config is None else configs.arch_candidates(s, arch, block_d, elem_bytes)
            for cfg in cfgs:
                key = (s.name, cfg) if not full else (s.name, cfg, block_d)
                jobs.setdefault(key, _job(s, arch, dtype, version, block_d, cfg))
    return list(jobs.values())


def _config_label(spec, constexprs: dict, cfg, dtype: str = "fp16", block_d: int = REPORT_HEAD_DIM) -> str:
    """"M128-N64-w8-s3 d128 fp16 causal" for a kernel with a config table, "M64-w4 d128 fp16" for one
    with fixed blocks; "fp32->fp16" where the kernel reads fp32 (the decode combine's partials);
    " fp32-tiles" where fp16/bf16 tiles are loaded as fp32 (UPCAST)."""
    if spec.config is None:
        blocks = [f"{n.removeprefix('BLOCK_')}{v}" for n, v in constexprs.items()
                  if n.startswith("BLOCK_") and n != "BLOCK_D"]
        blocks = "-".join(blocks + [f"w{cfg.num_warps}"])
    else:
        blocks = str(cfg)
    first = next(iter(spec.pointers.values()))
    shown = dtype if first == "in" else f"{first}->{dtype}"
    tiles = " fp32-tiles" if constexprs.get("UPCAST") and dtype != "fp32" else ""
    return f"{blocks} d{block_d} {shown}" + (" causal" if constexprs.get("CAUSAL") else "") + tiles


def _cuobjdump(cubin, *args) -> str:
    """``cuobjdump args cubin``, with the triton wheel's own copy first (the tools of the ptxas that made
    the cubin)."""
    return toolchain.run_tool("cuobjdump", *args, cubin, purpose="reading Triton's cubin in the compile report",
                              triton_first=True)


class _PtxasLogs:
    """Stands in for ``subprocess`` inside Triton's NVIDIA backend: runs everything as before, and keeps
    what ptxas printed with ``-v`` (Triton writes it to a log file it deletes on success; only 3.5+ can
    print it, TRITON_DUMP_PTXAS_LOG). So every version's rows are read from the ptxas run that made the
    cubin, with Triton's own flags (3.9 adds --regAllocOptLevel=2, which changes registers)."""

    def __init__(self, real):
        self._real, self.logs = real, []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def run(self, cmd, *args, **kwargs):
        proc = self._real.run(cmd, *args, **kwargs)
        err = kwargs.get("stderr")
        if isinstance(cmd, (list, tuple)) and cmd and "ptxas" in os.path.basename(str(cmd[0])) \
                and hasattr(err, "name") and os.path.exists(err.name):
            self.logs.append(pathlib.Path(err.name).read_text())
        return proc


def _compile_job(job: dict, specs: dict, logs: _PtxasLogs) -> dict:
    """Compile one job (in this process, which must be in Triton's compile mode) into its row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from ..kernels.triton import versions
    spec, arch, dtype = specs[job["kernel"]], job["arch"], job["dtype"]
    fn, cc = spec.fn, int(arch.removeprefix("sm_").rstrip("a"))
    signature, constexprs = spec.signature(dtype), job["constexprs"]
    row = {"backend": "triton", "kernel": spec.name, "config": job["label"], "arch": arch, "dtype": dtype,
           "block_d": job["block_d"], "compiler": f"triton {triton.__version__}", "ok": False,
           "registers": None, "spill_bytes": None, "shared_bytes": None, "mma_instructions": None,
           "tensor_cores": spec.uses_dot and versions.mma_on_tensor_cores(arch, triton.__version__) and
           (constexprs.get("PRECISION") == "tf32" or not (dtype == "fp32" or constexprs.get("UPCAST"))),
           "stack_bytes": None, "tma_instructions": None, "error": None, "_sass": ""}
    # What Triton's JIT would specialise for this problem: pointers and strides (and D, the head dim) are
    # multiples of 16; the sequence lengths and head counts are left general.
    divisible = [i for i, n in enumerate(fn.arg_names)
                 if signature[n].startswith("*") or n.startswith("stride") or n == "D"]
    if versions.astsource_takes_attrs_dict(triton.__version__):
        src = ASTSource(fn, signature, constexprs, {(i,): [["tt.divisibility", 16]] for i in divisible})
    else:                                               # triton <= 3.2: an AttrsDescriptor, no constexprs
        from triton.backends.compiler import AttrsDescriptor    # in the signature (the JIT's own format)
        props = {"tt.divisibility": divisible, "tt.equal_to": []}
        attrs = AttrsDescriptor.from_dict({"arg_properties": props, "cls": "AttrsDescriptor"})
        src = ASTSource(fn, {n: t for n, t in signature.items() if t != "constexpr"}, constexprs, attrs)
    m, n, warps, stages = job["config"]
    del logs.logs[:]
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):     # 3.5+ may print the ptxas log too
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
    except Exception as exc:                        # a kernel that does not compile is a row too
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        return row
    row["compile_seconds"] = round(time.perf_counter() - t0, 2)
    log = "\n".join(logs.logs)
    ptxas = toolchain.parse_ptxas(log).get(kernel.name, {})
    row.update(registers=ptxas.get("registers"), spill_bytes=ptxas.get("spill_stores"),
               stack_bytes=ptxas.get("stack_bytes"))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / f"{spec.name}.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = _cuobjdump(cubin, "-sass")
        static = ptxas.get("static_smem")               # ptxas -v's "bytes smem" (Triton's is dynamic)
        if static is None:
            found = re.search(r"SHARED:(\d+)", _cuobjdump(cubin, "--dump-resource-usage"))
            static = int(found.group(1)) if found else 0
    row["shared_bytes"] = int(kernel.metadata.shared) + static
    row["mma_instructions"] = sum(toolchain.count_mma(sass).values())
    row["tma_instructions"] = sum(toolchain.count_mma(sass, TMA_RE).values())
    row["ldgsts_instructions"] = sum(toolchain.count_mma(sass, LDGSTS_RE).values())   # cp.async: pipelined
    row["_sass"] = "\n".join(_sass_window(sass, 12))
    row["ok"] = row["spill_bytes"] is not None
    if not row["ok"]:
        row["error"] = "compiled, but the ptxas -v log of its cubin was not caught: " + log[-300:]
    return row


def _sass_window(sass: str, n: int) -> list[str]:
    """``n`` SASS lines around the first tensor-core instruction (else the first FFMA: sm_75 Triton)."""
    lines = [re.sub(r"\s+", " ", re.sub(r"/\* 0x[0-9a-f]+ \*/", "", ln)).strip()
             for ln in sass.splitlines() if "/*" in ln and ";" in ln]
    first = next((i for i, ln in enumerate(lines) if toolchain.MMA_RE.search(ln)),
                 next((i for i, ln in enumerate(lines) if " FFMA " in ln), 0))
    start = max(0, first - 2)
    return lines[start:start + n]


# --------------------------------------------------------------------------------- the child processes

_MARKER = "FLASHLIB-REPORT-ROW:"


def _source_hash() -> str:
    """A hash of the kernel sources and of the report's own code (the Triton version is a separate part
    of the cache key: each version's rows live in their own files)."""
    h = hashlib.sha256()
    for path in sorted((_PKG / "kernels" / "triton").glob("*.py")) + [pathlib.Path(__file__).resolve(),
                                                           _PKG / "hardware.py", _PKG / "tools" / "toolchain.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def _run_child(version: str, jobs: list[dict]) -> list[dict]:
    """Compile ``jobs`` with triton ``version`` in child processes, one after another, reading each row as
    it is printed. A compiler that aborts the process (LLVM ERROR: triton 3.3 on sm_75) costs its job
    only: that job becomes a failed row quoting the error, and a new child goes on with the rest."""
    from . import triton_versions
    folder = triton_versions.ensure(version)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_ALWAYS_COMPILE="1",
               TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_DUMP_PTXAS_LOG", None)
    paths = ([str(folder)] if folder else []) + [str(_PKG.parent)] + \
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    rows, todo = [], list(jobs)
    while todo:
        with tempfile.TemporaryDirectory(prefix="flashlib-report-") as tmp:
            env["TRITON_CACHE_DIR"] = tmp               # fresh: no cross-process cache races
            proc = subprocess.run([sys.executable, "-m", "flashlib.tools.compile_report", "--child"],
                                  input=json.dumps(todo), capture_output=True, text=True, env=env, cwd=tmp)
        done = [json.loads(ln[len(_MARKER):]) for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
        rows += done
        todo = todo[len(done):]
        if todo and proc.returncode == 0:
            raise RuntimeError(f"the compile-report child (triton {version}) stopped early:\n"
                               f"{proc.stderr[-3000:]}")
        if todo:                                        # it crashed on todo[0]
            if not done and "Traceback" in proc.stderr and "LLVM ERROR" not in proc.stderr:
                raise RuntimeError(f"compiling with triton {version} failed in the child process:\n"
                                   f"{proc.stderr[-3000:]}")
            lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
            why = next((ln for ln in lines if "ERROR" in ln), lines[-1] if lines else "")
            why = f"the compiler aborted (exit {proc.returncode}): {why.strip()[:300]}"
            rows.append(_failed_row(todo.pop(0), why))
    return rows


def _failed_row(job: dict, error: str) -> dict:
    return {"backend": "triton", "kernel": job["kernel"], "config": job["label"], "arch": job["arch"],
            "dtype": job["dtype"], "block_d": job["block_d"], "compiler": f"triton {job['triton']}",
            "ok": False, "registers": None, "spill_bytes": None, "shared_bytes": None,
            "mma_instructions": None, "tensor_cores": None, "stack_bytes": None, "tma_instructions": None,
            "error": error, "_sass": ""}


def _cache_file(folder, version: str, arch: str, dtype: str, source: str) -> pathlib.Path:
    return folder / f"triton-{version}-{arch}-{dtype}-{source}.json"


def _rows_of(jobs: list[dict], cache: bool = True, workers: int | None = None) -> list[dict]:
    """The rows of ``jobs`` (from :func:`matrix_jobs` or the report), in order: read from the disk cache
    (one file per Triton version, arch and dtype, keyed by the sources' hash; identical jobs compile
    once), the missing ones compiled in child processes, ``workers`` at a time (default: the cores),
    each Triton version in its own children. Under one lock: parallel test workers wait, then read."""
    folder, source = toolchain.cache_dir("compile-report"), _source_hash()
    ids = [_job_id(j) for j in jobs]
    with toolchain.locked(folder / "triton.lock"):
        files: dict[tuple, dict] = {}
        for j in jobs:
            key = (j["triton"], j["arch"], j["dtype"])
            if key not in files:
                path = _cache_file(folder, *key, source)
                files[key] = json.loads(path.read_text()) if cache and path.exists() else {}
        missing = {i: j for i, j in zip(ids, jobs) if i not in files[(j["triton"], j["arch"], j["dtype"])]}
        tasks = []
        workers = max(1, workers or os.cpu_count() or 1)
        for version in dict.fromkeys(j["triton"] for j in missing.values()):
            todo = sorted((j for j in missing.values() if j["triton"] == version),
                          key=lambda j: -j["block_d"] * max(j["config"][0], 16) * max(j["config"][1], 16))
            chunks = [todo[k::workers] for k in range(min(workers, len(todo)))]
            tasks += [(version, c) for c in chunks]
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:   # threads wait on child processes
            for (_, chunk), rows in zip(tasks, pool.map(lambda t: _run_child(*t), tasks)):
                for job, row in zip(chunk, rows):        # rows come back in the jobs' order
                    files[(job["triton"], job["arch"], job["dtype"])][_job_id(job)] = row
        for (version, arch, dtype), rows in files.items():
            path = _cache_file(folder, version, arch, dtype, source)
            if missing:
                toolchain.build_atomically(path, lambda tmp: tmp.write_text(json.dumps(rows)))
            for stale in folder.glob(f"triton-{version}-{arch}-{dtype}-*.json"):
                if stale != path:                       # rows of older kernel sources
                    stale.unlink(missing_ok=True)
    return [dict(files[(j["triton"], j["arch"], j["dtype"])][i]) for i, j in zip(ids, jobs)]


def triton_rows(archs=ARCHS, *, cache: bool = True, triton=None, dtypes=("fp16",)) -> list[dict]:
    """The Triton kernels' rows (see :func:`compile_report`, which asks for fp16 and fp32), with the
    private ``_sass`` excerpts: per arch and dtype, each kernel with the config the tables pick at
    d = 128 (none for a dtype that flashlib refuses on that arch, see :func:`dtype_refusal`).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    archs, dtypes, version = _check_archs(archs), _check_dtypes(dtypes), _version(triton)
    jobs = []
    for arch in archs:
        for dtype in dtypes:
            if dtype_refusal(dtype, arch, version) is None:
                jobs += [_job(s, arch, dtype, version, REPORT_HEAD_DIM, cfg)
                         for s, _, _, cfg in _triton_jobs(arch, dtype, version)]
    return _rows_of(jobs, cache)


def cuda_rows(archs=ARCHS, *, cache: bool = True) -> list[dict]:
    """The CUDA C++ kernels' rows (nvcc -cubin per architecture; flashlib.kernels.cuda caches per source)."""
    from ..kernels import cuda
    return cuda.compile_rows(tuple(archs))


ROW_PRODUCERS: list[Callable] = [triton_rows, cuda_rows]


def compile_report(archs=ARCHS, *, cache: bool = True, triton=None, dtypes=REPORT_DTYPES) -> list[dict]:
    """One row per (kernel, config, arch, dtype): what each kernel compiles to on each architecture.

    Args:
        archs: architectures like ``("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")``.
        cache: reuse rows cached on disk for these exact kernel sources (False: compile afresh).
        triton: the Triton release that compiles the Triton rows, e.g. ``"3.6.0"`` (Colab's), installed
            beside this one on first use (:func:`flashlib.tools.triton_versions.ensure`); None: the
            installed one.
        dtypes: the inputs' dtypes of the Triton rows, from ``("fp16", "bf16", "fp32")``; a dtype
            flashlib refuses on an arch (bf16 below sm_80) has no rows there.

    Returns:
        A list of dicts with keys ``backend`` ("triton"), ``kernel``, ``config`` (block sizes, warps,
        stages, head dim 128, dtype), ``arch``, ``ok`` (compiled), ``registers`` per thread,
        ``spill_bytes`` (ptxas spill stores), ``shared_bytes`` (per block), ``mma_instructions``
        (tensor-core instructions in the SASS), ``tensor_cores`` (whether this row is expected to use
        them: :func:`flashlib.kernels.triton.versions.mma_on_tensor_cores` for kernels with a matmul —
        on sm_75 from triton 3.3 on tl.dot becomes FFMA, up to 3.2 HMMA), ``compiler`` (e.g.
        "triton 3.9.0": the report is true for that version only) — plus ``dtype`` and ``block_d`` (Triton
        rows), ``stack_bytes``, ``compile_seconds`` and ``error`` (None when ok).

    Compiles in child processes (see the module docstring); the first call takes a few minutes on
    two cores, later calls read the cache.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/tools/test_compile_report.py.
    """
    import inspect
    archs = _check_archs(archs)
    extra = dict(triton=triton, dtypes=_check_dtypes(dtypes))
    rows = []
    for producer in ROW_PRODUCERS:
        takes = inspect.signature(producer).parameters
        kwargs = {k: v for k, v in extra.items() if k in takes}
        rows += [{k: v for k, v in row.items() if not k.startswith("_")}
                 for row in producer(archs, cache=cache, **kwargs)]
    return rows


def compilers(rows) -> str:
    """One line naming the compilers behind ``rows``: the report holds for these versions only.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/tools/test_compile_report.py.
    """
    names = sorted({r.get("compiler", "?") for r in rows})
    return ("compiled by " + ", ".join(names) + " (a report is true for its compiler versions only: "
            "another Triton can allocate up to 2x the shared memory or registers)")


def sass_excerpt(kernel: str = "fa2_fwd", arch: str = "sm_80", *, dtype: str = "fp16", triton=None) -> str:
    """A dozen SASS lines of ``kernel`` compiled for ``arch``, around its first tensor-core instruction
    (HMMA, HGMMA; on sm_75 with triton >= 3.3, where tl.dot has none, around its first FFMA).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    for row in triton_rows((arch,), triton=triton, dtypes=(dtype,)):
        if row["kernel"] == kernel:
            return row["_sass"]
    raise ValueError(f"kernel must be one of the report's kernels, got {kernel!r}")


def format_report(rows) -> str:
    """The rows as a fixed-width table, after a line naming the compilers (:func:`compilers`); the
    CUDA C++ rows also show their ldmatrix (LDSM) counts, the Triton rows their TMA copies
    (UTMALDG/UTMASTG); both their cp.async copies (LDGSTS).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    def wide(key, least):                           # a column as wide as its longest value
        return max([least, *(len(str(r.get(key, ""))) for r in rows)])
    cols = [("backend", 7), ("kernel", wide("kernel", 20)), ("arch", 5), ("config", wide("config", 30)),
            ("ok", 5), ("registers", 4), ("spill_bytes", 6), ("shared_bytes", 7), ("mma_instructions", 5),
            ("ldsm_instructions", 4), ("ldgsts_instructions", 6), ("tma_instructions", 3), ("tensor_cores", 5)]
    heads = {"registers": "regs", "spill_bytes": "spill", "shared_bytes": "smem", "mma_instructions": "mma",
             "ldsm_instructions": "ldsm", "ldgsts_instructions": "ldgsts", "tma_instructions": "tma",
             "tensor_cores": "TC"}
    out = [compilers(rows), "  ".join(f"{heads.get(c, c):<{w}}" for c, w in cols)]
    for r in rows:                                  # ldsm: the CUDA C++ rows only; tma: Triton's
        out.append("  ".join(f"{str(r.get(c, '-')):<{w}}" for c, w in cols))
    return "\n".join(out)


def summary(rows) -> str:
    """Per arch (and dtype, where rows have one) and kernel: registers / spill bytes / shared KB (limit),
    and mma count — one line each.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/tools/test_compile_report.py.
    """
    lines = []
    for arch, dtype in dict.fromkeys((r["arch"], r.get("dtype")) for r in rows):
        limit = ARCH_SMEM_LIMIT.get(arch)
        parts = []
        for r in (r for r in rows if r["arch"] == arch and r.get("dtype") == dtype):
            if not r["ok"]:
                parts.append(f"{r['kernel']}: FAILED")
                continue
            parts.append(f"{r['kernel']} {r['registers']}r/{r['spill_bytes']}sp/"
                         f"{r['shared_bytes'] / 1024:.0f}KB/{r['mma_instructions']}mma")
        head = f"{arch} {dtype}" if dtype else arch
        lines.append(f"{head} (smem limit {limit} KB): " + ", ".join(parts))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- the version matrix

# torch 2.7's Triton (3.3.x) differs from its neighbours on sm_75 only (tl.dot needs fp32 tiles there:
# versions.dot_needs_fp32_tiles); to keep the matrix's cold run short it is compiled for sm_75 only.
MATRIX_ARCHS = {"3.3.1": ("sm_75",)}


def matrix_rows(tritons=None, archs=ARCHS, dtypes=DTYPES, *, cache: bool = True,
                workers: int | None = None) -> list[dict]:
    """The version matrix: for each Triton in ``tritons`` (default versions.TESTED), arch (limited by
    :data:`MATRIX_ARCHS`) and dtype, a row per compile of :func:`matrix_jobs` with ``fits`` (its
    shared memory within the arch's limit, hardware.ARCH_SMEM_LIMIT), or one row with ``refused``
    (:func:`dtype_refusal`'s reason) where flashlib refuses the dtype. Cached like the report (a row compiles
    once for both); the missing rows compile in ``workers`` child processes at a time.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_matrix.py.
    """
    from ..kernels.triton import versions
    tritons = versions.TESTED if tritons is None else tuple(tritons)
    archs, dtypes = _check_archs(archs), _check_dtypes(dtypes)
    jobs, refused = [], []
    for v in tritons:
        for arch in (a for a in archs if a in MATRIX_ARCHS.get(v, archs)):
            for dtype in dtypes:
                why = dtype_refusal(dtype, arch, _version(v))
                if why is not None:
                    refused.append({"backend": "triton", "kernel": "*", "arch": arch, "dtype": dtype,
                                    "compiler": f"triton {v}", "ok": False, "refused": why})
                    continue
                for s in (s for s in triton_specs() if _in_matrix(s, arch, v, dtype)):
                    for block_d in MATRIX_HEAD_DIMS:
                        why = kernel_refusal(s, arch, dtype, v, block_d)
                        if why is not None:
                            refused.append({"backend": "triton", "kernel": s.name, "arch": arch,
                                            "dtype": dtype, "block_d": block_d, "compiler": f"triton {v}",
                                            "ok": False, "refused": why})
                jobs += matrix_jobs(v, arch, dtype)
    rows = [{k: val for k, val in r.items() if not k.startswith("_")} for r in _rows_of(jobs, cache, workers)]
    for r in rows:
        r["fits"] = bool(r["ok"]) and r["shared_bytes"] <= ARCH_SMEM_LIMIT[r["arch"]] * 1024
    return rows + refused


def matrix_table(rows) -> str:
    """:func:`matrix_rows` as a table: per Triton version and arch, for each dtype, how many compiles
    compiled and fit the arch's shared memory, the most bytes spilled, and how many (kernel, head dim)
    flashlib refuses before launching; or "refuses" (the dtype).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/triton/test_triton_matrix.py.
    """
    dtypes = [d for d in DTYPES if any(r.get("dtype") == d for r in rows)]
    keys = dict.fromkeys((r["compiler"], r["arch"]) for r in rows)
    lines = []
    for compiler, arch in sorted(keys, key=lambda k: (_version_key(k[0]), k[1])):
        cells = []
        for d in dtypes:
            mine = [r for r in rows if (r["compiler"], r["arch"], r.get("dtype")) == (compiler, arch, d)]
            refused = [r for r in mine if "refused" in r]
            built = [r for r in mine if "refused" not in r]
            if any(r["kernel"] == "*" for r in refused):
                cell = "refuses"
            elif not mine:
                cell = "-"
            else:
                ok = sum(bool(r["ok"]) for r in built)
                fit = sum(bool(r.get("fits")) for r in built)
                spill = max((r["spill_bytes"] or 0 for r in built if r["ok"]), default=0)
                cell = f"{ok}/{len(built)} compile, {fit} fit, {spill}B sp" + \
                    (f", {len(refused)} refused" if refused else "")
            cells.append(cell)
        lines.append((compiler, arch, cells))
    width = max([len(d) for d in dtypes] + [len(c) for *_, cells in lines for c in cells])
    out = [f"{'compiler':<13} {'arch':<6} " + "  ".join(f"{d:<{width}}" for d in dtypes)]
    out += [f"{c:<13} {a:<6} " + "  ".join(f"{x:<{width}}" for x in cells) for c, a, cells in lines]
    return "\n".join(ln.rstrip() for ln in out)


def _version_key(compiler: str) -> tuple:
    """Sort key of a "triton 3.2.0" compiler name: by version."""
    from ..kernels.triton import versions
    return versions.parse(compiler.split()[-1])


def _child_main() -> None:
    """Compile the jobs (JSON on stdin), printing each row as soon as it is made."""
    from ..kernels.triton import INTERPRET
    if INTERPRET:
        raise SystemExit("the compile-report child must run with TRITON_INTERPRET=0")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    # The backend's own module namespace (up to 3.3 Triton loads it outside sys.modules): its make_cubin's.
    namespace = type(make_backend(GPUTarget("cuda", 80, 32))).make_cubin.__globals__
    logs = _PtxasLogs(namespace["subprocess"])
    namespace["subprocess"] = logs                      # catch ptxas -v (see _PtxasLogs)
    specs = {s.name: s for s in compile_specs()}
    for job in json.loads(sys.stdin.read()):
        print(_MARKER + json.dumps(_compile_job(job, specs, logs)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--child"]:
        _child_main()
    else:
        raise SystemExit("usage: python -m flashlib compile-report  (this module's own entry is internal)")
