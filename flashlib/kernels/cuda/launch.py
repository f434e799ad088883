"""Launch geometry, computed once in Python, and the two ways to carry a launch out.

Every kernel has one function here returning :class:`LaunchSpec` s — grid, block, dynamic shared bytes
and the argument list in the kernel's parameter order. Both paths consume the same specs:

* :func:`run_emulated` — CPU tensors: the emulator executable (``build.emulator_binary``) in a child
  process, optionally under ASan or TSan;
* :func:`run_gpu` — CUDA tensors: the same ``.cu`` source compiled at run time with NVRTC through CuPy
  (a few seconds per source, cached for the process; ``torch.utils.cpp_extension.load_inline`` would
  compile a whole PyTorch extension with the host compiler, about a minute per edit — too slow for a
  reader changing a kernel in Colab).

On a machine without a GPU only the last call of :func:`run_gpu` (the launch itself) goes untested.

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

import functools
import os
import pathlib
import re
import struct
import subprocess
import tempfile
import warnings
from dataclasses import dataclass

from ...hardware import flat_programs
from ...tools import toolchain
from . import build, toolkit

__all__ = ["LaunchSpec", "SMEM_BUDGET", "flat_grid", "v1_launch", "v2_launch", "v3_launch", "bwd_tile", "bwd_launch",
           "decode_launch", "run_emulated", "nvrtc_options", "to_cupy", "run_gpu", "EmulatorError"]

# Shared memory per block we allow ourselves: the 48 KB every GPU grants without an opt-in
# (cudaFuncSetAttribute). A T4 could opt into 64 KB; staying at 48 KB keeps one code path everywhere.
SMEM_BUDGET = 48 * 1024

# The kernels' own constants, read from their sources (build.cu_constant), so that Python's geometry
# cannot drift from the .cu: keys per K/V tile in v1 and v2, threads per decode block.
V1_BC = build.cu_constant("fa2_fwd_v1_scalar.cu", "V1_BC")
V2_BC = build.cu_constant("fa2_fwd_v2_wmma.cu", "BC")
DECODE_THREADS = build.cu_constant("decode_v1_splitkv.cu", "THREADS")


def _head_dims(source: str, prefix: str) -> tuple[int, ...]:
    """The head-dim buckets D of the kernels ``<prefix>_d<D>`` that ``source`` defines (its kernel names)."""
    names = build.kernel_names((build.CSRC / source).read_text())
    return tuple(sorted({int(m.group(1)) for n in names if (m := re.fullmatch(rf"{prefix}_d(\d+)", n))}))


def _bucket(d: int, dims: tuple[int, ...], what: str) -> int:
    """The smallest head-dim bucket in ``dims`` that holds d; ValueError naming ``what`` otherwise."""
    dim = next((x for x in dims if x >= d), None)
    if dim is None or d < 1:
        raise ValueError(f"head dim d={d}: {what} supports 1 <= d <= {dims[-1]}")
    return dim


# v3: one kernel per head-dim bucket D (fa2_fwd_v3_<dtype>_d<D>, read from the kernel names), each with
# its own keys per tile V3_BC_D<D>; THREADS per block, 16 query rows per warp.
_V3_SOURCE = "fa2_fwd_v3_mma.cu"
V3_WARPS = build.cu_constant(_V3_SOURCE, "THREADS") // 32
V3_HEAD_DIMS = _head_dims(_V3_SOURCE, "fa2_fwd_v3_f16")
V3_BC = {dim: build.cu_constant(_V3_SOURCE, f"V3_BC_D{dim}") for dim in V3_HEAD_DIMS}
# The backward (fa2_bwd_v1_mma.cu): head-dim buckets read from its kernel names; per bucket, query rows
# per tile of the dK/dV kernel (BWD_BQ_D<D>) and keys per tile of the dQ kernel (BWD_BKV_D<D>).
BWD_SOURCE = "fa2_bwd_v1_mma.cu"
BWD_WARPS = build.cu_constant(BWD_SOURCE, "THREADS") // 32
BWD_HEAD_DIMS = _head_dims(BWD_SOURCE, "fa2_bwd_v1_dq_f16")
BWD_BQ = {dim: build.cu_constant(BWD_SOURCE, f"BWD_BQ_D{dim}") for dim in BWD_HEAD_DIMS}
BWD_BKV = {dim: build.cu_constant(BWD_SOURCE, f"BWD_BKV_D{dim}") for dim in BWD_HEAD_DIMS}
# Every kernel here flattens its (block, head, batch) index into blockIdx.x and decodes it in the kernel,
# so that any B x H that fits in memory launches (with H in y and B in z, B = 100,000 sequences could
# not): flashlib.hardware.CUDA_GRID_MAX holds CUDA's limits.


@dataclass(frozen=True)
class LaunchSpec:
    """One kernel launch: what CUDA's ``kernel<<<grid, block, shared_bytes>>>(args...)`` needs.

    ``args`` are ``("buf", name)`` (a tensor from the buffer table), ``("i32", int)`` or
    ``("f32", float)``, in the kernel's parameter order. ``config`` is a short human description.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_emulator.py.
    """
    source: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple
    config: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def flat_grid(*counts: int) -> tuple[int, int, int]:
    """The 1-D grid ``(prod(counts), 1, 1)``; a kernel decodes blockIdx.x, first count fastest.

    Raises ValueError outside CUDA's gridDim.x limit (:func:`flashlib.hardware.flat_programs`).

    Explained in: notebooks/08_cuda.

    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    return (flat_programs(*counts), 1, 1)


def _forward_args(h, hkv, nq, nk, d, scale, causal) -> tuple:
    """The forward kernels' parameters (v1, v2, v3 share them): q, k, v, o, lse, H, Hkv, nq, nk, d,
    scale, causal."""
    return (("buf", "q"), ("buf", "k"), ("buf", "v"), ("buf", "o"), ("buf", "lse"),
            ("i32", h), ("i32", hkv), ("i32", nq), ("i32", nk), ("i32", d), ("f32", scale), ("i32", int(causal)))


# ---- v1: scalar fp32 ------------------------------------------------------------------------------
def v1_tile(d: int) -> tuple[int, int]:
    """(BR, shared bytes) for v1 at head dim d: the largest BR in 64, 32, 16, 8 that fits 48 KB."""
    ds = d + 1 - (d & 1)
    for br in (64, 32, 16, 8):
        smem = (2 * br + V1_BC) * ds * 4
        if smem <= SMEM_BUDGET:
            return br, smem
    raise ValueError(f"head dim d={d}: v1 cannot fit a tile in {SMEM_BUDGET} bytes (v1 supports d <= 256)")


def v1_launch(b, h, hkv, nq, nk, d, scale, causal) -> list[LaunchSpec]:
    """v1 (``fa2_fwd_v1_f32``): one block per (BR query rows, head, batch),
    one thread per row.

    The grid is 1-D: blockIdx.x = (batch * H + head) * tiles + tile, with
    tiles = ceil(nq / BR).

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    br, smem = v1_tile(d)
    grid = flat_grid(_cdiv(nq, br), h, b)        # (tiles * H * B, 1, 1)
    return [LaunchSpec("fa2_fwd_v1_scalar.cu", "fa2_fwd_v1_f32", grid,
                       (br, 1, 1), smem,
                       _forward_args(h, hkv, nq, nk, d, scale, causal),
                       f"d={d} BR={br} BC={V1_BC}")]


# ---- v2: WMMA fp16/bf16 ---------------------------------------------------------------------------
def v2_tile(d: int) -> tuple[int, int]:
    """(BR, shared bytes) for v2 at head dim d (padded to d16, a multiple of 16), within 48 KB.

    Per block: Q (BR x (d16+8) halves), one K/V buffer (BC x (d16+8) halves), S (BR x (BC+4) floats),
    P (BR x (BC+8) halves) and the O accumulator (BR x (d16+4) floats). BR is 16 rows per warp.
    """
    d16 = _cdiv(d, 16) * 16
    for br in (64, 32, 16):
        smem = (br * (d16 + 8) * 2 + V2_BC * (d16 + 8) * 2 + br * (V2_BC + 4) * 4
                + br * (V2_BC + 8) * 2 + br * (d16 + 4) * 4)
        if smem <= SMEM_BUDGET:
            return br, smem
    raise ValueError(f"head dim d={d}: v2 cannot fit a tile in {SMEM_BUDGET} bytes (v2 supports d <= 256)")


def v2_launch(b, h, hkv, nq, nk, d, scale, causal, dtype: str) -> list[LaunchSpec]:
    """v2 (``fa2_fwd_v2_f16`` / ``fa2_fwd_v2_bf16``): one block of BR/16 warps per Q tile, 1-D grid
    indexed as v1's.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    br, smem = v2_tile(d)
    return [LaunchSpec("fa2_fwd_v2_wmma.cu", f"fa2_fwd_v2_{dtype}", flat_grid(_cdiv(nq, br), h, b), (2 * br, 1, 1),
                       smem, _forward_args(h, hkv, nq, nk, d, scale, causal),
                       f"{dtype} d={d} BR={br} BC={V2_BC}")]


# ---- v3: mma.sync fp16/bf16 -----------------------------------------------------------------------
def v3_tile(d: int) -> tuple[int, int, int, int]:
    """``(D, BR, BC, shared bytes)`` for v3 at head dim d: D is the smallest of the kernel's head-dim
    buckets (:data:`V3_HEAD_DIMS`) >= d, BR = 16 rows x V3_WARPS warps, BC the kernel's keys per tile
    for that D; shared memory holds Q (BR x D), K and V (BC x D each), swizzled, no padding.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_v3.py.
    """
    dim = _bucket(d, V3_HEAD_DIMS, "v3")
    br, bc = 16 * V3_WARPS, V3_BC[dim]
    smem = (br + 2 * bc) * dim * 2
    if smem > SMEM_BUDGET:                  # the kernel's constants, not the caller, are wrong
        raise ValueError(f"v3 at D={dim}: BR={br}, BC={bc} need {smem} bytes of shared memory, "
                         f"over the {SMEM_BUDGET} budget")
    return dim, br, bc, smem


def v3_launch(b, h, hkv, nq, nk, d, scale, causal, dtype: str) -> list[LaunchSpec]:
    """v3 (``fa2_fwd_v3_<dtype>_d<D>``): one block of V3_WARPS warps (16 query rows each) per Q tile,
    1-D grid indexed as v1's; the kernel's D is the head-dim bucket :func:`v3_tile` picks.

    Explained in: notebooks/08b_v3_registers.
    Tested in: tests/kernels/cuda/test_cuda_v3.py.
    """
    dim, br, bc, smem = v3_tile(d)
    return [LaunchSpec(_V3_SOURCE, f"fa2_fwd_v3_{dtype}_d{dim}", flat_grid(_cdiv(nq, br), h, b),
                       (32 * V3_WARPS, 1, 1), smem,
                       _forward_args(h, hkv, nq, nk, d, scale, causal),
                       f"{dtype} d={d} D={dim} BR={br} BC={bc}")]


# ---- the backward: mma.sync fp16/bf16 -------------------------------------------------------------
def bwd_tile(d: int) -> tuple[int, int, int, int, int]:
    """``(D, BQ, BKV, dK/dV shared bytes, dQ shared bytes)`` for the backward at head dim d: D the
    smallest bucket (:data:`BWD_HEAD_DIMS`) >= d; the dK/dV kernel holds 64 keys of K and V and a tile
    of BQ query rows of Q and dO (with their LSE and D_i in fp32), the dQ kernel 64 query rows of Q and
    dO and a tile of BKV keys of K and V; all 16-bit, swizzled, no padding.

    Explained in: notebooks/08c_backward_decoding.
    Tested in: tests/kernels/cuda/test_cuda_bwd.py.
    """
    dim = _bucket(d, BWD_HEAD_DIMS, "the CUDA backward")
    rows = 16 * BWD_WARPS
    bq, bkv = BWD_BQ[dim], BWD_BKV[dim]
    dkdv_smem, dq_smem = (2 * rows + 2 * bq) * dim * 2 + 8 * bq, (2 * rows + 2 * bkv) * dim * 2
    if max(dkdv_smem, dq_smem) > SMEM_BUDGET:     # the kernel's constants, not the caller, are wrong
        raise ValueError(f"backward at D={dim}: BQ={bq}, BKV={bkv} need {dkdv_smem} / {dq_smem} bytes of "
                         f"shared memory, over the {SMEM_BUDGET} budget")
    return dim, bq, bkv, dkdv_smem, dq_smem


def bwd_launch(b, h, hkv, nq, nk, d, scale, causal, dtype: str) -> list[LaunchSpec]:
    """The backward's three launches: ``fa2_bwd_v1_delta_<dtype>`` (D_i = rowsum(dO * O), a warp per row),
    ``fa2_bwd_v1_dkdv_<dtype>_d<D>`` (a block per 64 keys of a kv head, summing its GQA group) and
    ``fa2_bwd_v1_dq_<dtype>_d<D>`` (a block per 64 query rows). Buffers: q, k, v, o, do, lse (in);
    delta (fp32 scratch); dq, dk, dv (out). A launch with no blocks (Nk = 0: no dK/dV rows) is left out.

    Explained in: notebooks/08c_backward_decoding.
    Tested in: tests/kernels/cuda/test_cuda_bwd.py.
    """
    dim, bq, bkv, dkdv_smem, dq_smem = bwd_tile(d)
    rows, threads = 16 * BWD_WARPS, (32 * BWD_WARPS, 1, 1)
    common = (("i32", h), ("i32", hkv), ("i32", nq), ("i32", nk), ("i32", d), ("f32", scale), ("i32", int(causal)))
    ins = (("buf", "q"), ("buf", "k"), ("buf", "v"), ("buf", "do"), ("buf", "lse"), ("buf", "delta"))
    cfg = f"{dtype} d={d} D={dim}"
    specs = []
    if nq:
        specs.append(LaunchSpec(BWD_SOURCE, f"fa2_bwd_v1_delta_{dtype}", flat_grid(_cdiv(nq, BWD_WARPS), h, b), threads,
                                0, (("buf", "o"), ("buf", "do"), ("buf", "delta"), ("i32", nq), ("i32", d)), cfg))
    if nk:
        specs.append(LaunchSpec(BWD_SOURCE, f"fa2_bwd_v1_dkdv_{dtype}_d{dim}", flat_grid(_cdiv(nk, rows), hkv, b),
                                threads, dkdv_smem, (*ins, ("buf", "dk"), ("buf", "dv"), *common),
                                f"{cfg} BK={rows} BQ={bq}"))
    if nq:
        specs.append(LaunchSpec(BWD_SOURCE, f"fa2_bwd_v1_dq_{dtype}_d{dim}", flat_grid(_cdiv(nq, rows), h, b),
                                threads, dq_smem, (*ins, ("buf", "dq"), *common), f"{cfg} BR={rows} BKV={bkv}"))
    return specs


# ---- Flash-Decoding -------------------------------------------------------------------------------
def decode_launch(b, h, hkv, nq, nmax, d, scale, causal, num_splits, dtype: str) -> list[LaunchSpec]:
    """Flash-Decoding: ``decode_split_<dtype>`` then ``decode_combine_<dtype>``.

    Split kernel: one block per (split, head, batch), blockIdx.x = (batch * H + head) * S + split,
    DECODE_THREADS threads (4 warps); dynamic shared memory holds one query row (d floats) and each
    warp's partial state (m, l, O: d + 2 floats). It writes ``o_parts (S, B, H, nq, d)`` and
    ``lse_parts (S, B, H, nq)`` in fp32. Combine kernel: one block per output row,
    blockIdx.x = (batch * H + head) * nq + query, DECODE_THREADS threads over d.

    Explained in: notebooks/08c_backward_decoding.
    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    smem = (d + DECODE_THREADS // 32 * (d + 2)) * 4
    common = (("i32", b), ("i32", h), ("i32", hkv), ("i32", nq), ("i32", nmax), ("i32", d))
    split = LaunchSpec("decode_v1_splitkv.cu", f"decode_split_{dtype}", flat_grid(num_splits, h, b),
                       (DECODE_THREADS, 1, 1), smem,
                       (("buf", "q"), ("buf", "k"), ("buf", "v"), ("buf", "seqlens"), ("buf", "o_parts"),
                        ("buf", "lse_parts"), *common, ("i32", num_splits), ("f32", scale), ("i32", int(causal))),
                       f"{dtype} d={d} splits={num_splits}")
    combine = LaunchSpec("decode_v1_splitkv.cu", f"decode_combine_{dtype}", flat_grid(nq, h, b),
                         (DECODE_THREADS, 1, 1), 0,
                         (("buf", "o_parts"), ("buf", "lse_parts"), ("buf", "o"), ("buf", "lse"),
                          ("i32", b), ("i32", h), ("i32", nq), ("i32", d), ("i32", num_splits)),
                         f"{dtype} d={d} splits={num_splits}")
    return [split, combine]


# ---- the emulator path ----------------------------------------------------------------------------
class EmulatorError(RuntimeError):
    """The emulator (or a sanitizer inside it) stopped a launch; ``report`` holds its stderr.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """

    def __init__(self, message: str, report: str):
        super().__init__(message)
        self.report = report


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def _arg_token(arg, ids) -> str:
    kind, val = arg
    if kind == "buf":
        return f"b{ids[val]}"
    if kind == "i32":
        return f"i{int(val)}"
    if kind == "f32":
        return f"f{_f32_bits(val)}"
    raise ValueError(f"unknown argument kind {kind!r}")


def plan_text(specs, sizes: dict[str, int], inputs: dict[str, str], outputs: dict[str, str]) -> str:
    """The runner's plan: buffers (inputs from files, the rest NaN-filled), launches, outputs."""
    ids = {name: i for i, name in enumerate(sizes)}
    lines = []
    for name, nbytes in sizes.items():
        init = f"file {inputs[name]}" if name in inputs else "nan"
        lines.append(f"buffer {ids[name]} {nbytes} {init}")
    for s in specs:
        toks = " ".join(_arg_token(a, ids) for a in s.args)
        lines.append(f"launch {s.kernel} {' '.join(map(str, s.grid))} {' '.join(map(str, s.block))} "
                     f"{s.shared_bytes} {len(s.args)} {toks}")
    for name, path in outputs.items():
        lines.append(f"out {ids[name]} {path}")
    return "\n".join(lines) + "\n"


def run_emulated(specs, buffers: dict, outputs, *, sanitizer=None, source=None, timeout=None,
                 counters: dict | None = None):
    """Run ``specs`` in the emulator on CPU tensors; fill the tensors named in ``outputs`` in place.

    Args:
        specs: LaunchSpecs of one source, run in order in one child process.
        buffers: name -> contiguous CPU torch tensor (inputs and pre-allocated outputs). Outputs
            start NaN-filled in the emulator, so an element a kernel never writes shows up.
        outputs: names of buffers to copy back.
        sanitizer: None, "address" or "thread".
        source: override the source (a path or ``(name, text)``), e.g. a planted bug.
        counters: a dict to fill with the shared-memory bank conflicts the emulator counted:
            ``{(instruction, "file:line"): {"requests", "wavefronts"}}`` for each ldmatrix call site (a
            request is one 8x8 matrix, eight 16-byte rows; ``wavefronts == requests``: conflict-free).

    Raises:
        EmulatorError: the child failed; the message quotes the first lines of its report.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/cuda/test_cuda_kernels.py.
    """
    import torch

    exe = build.emulator_binary(source if source is not None else specs[0].source, sanitizer)
    with tempfile.TemporaryDirectory(prefix="flashlib-emu-") as tmp:
        tmp = pathlib.Path(tmp)
        sizes, inputs, outs = {}, {}, {}
        for name, t in buffers.items():
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"buffer {name!r} must be a contiguous CPU tensor")
            sizes[name] = t.numel() * t.element_size()
            if name not in outputs:
                path = tmp / f"{name}.bin"
                path.write_bytes(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                inputs[name] = str(path)
        for name in outputs:
            outs[name] = str(tmp / f"{name}.out")
        env = dict(os.environ)
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0:abort_on_error=0")
        env.setdefault("TSAN_OPTIONS", "halt_on_error=1:second_deadlock_stack=1")
        env.pop("FLASHLIB_EMU_COUNTERS", None)
        if counters is not None:
            env["FLASHLIB_EMU_COUNTERS"] = str(tmp / "counters.tsv")
        proc = subprocess.run([str(exe)], input=plan_text(specs, sizes, inputs, outs), text=True,
                              capture_output=True, env=env, timeout=timeout)
        report = proc.stderr
        if proc.returncode != 0 or "WARNING: ThreadSanitizer" in report or "ERROR: AddressSanitizer" in report:
            lines = [ln for ln in report.splitlines() if ln.strip()]
            head = "\n".join(lines[:12])
            raise EmulatorError(f"emulator run of {', '.join(s.kernel for s in specs)} failed "
                                f"(exit {proc.returncode}, sanitizer={sanitizer}):\n{head}", report)
        if counters is not None:
            for line in (tmp / "counters.tsv").read_text().splitlines():
                what, site, requests, waves = line.split("\t")
                counters[(what, site)] = {"requests": int(requests), "wavefronts": int(waves)}
        for name in outputs:
            t = buffers[name]
            data = pathlib.Path(outs[name]).read_bytes()
            if t.numel():
                t.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1)
                                          .reshape(t.view(torch.uint8).shape))
    return buffers


# ---- the GPU path ---------------------------------------------------------------------------------
_GPU_MODULES: dict = {}


@functools.lru_cache(maxsize=None)
def _include_dirs():
    """:func:`toolkit.find_include_dirs`, looked up once per process (a tuple, or None).

    Explained in: notebooks/08_cuda.
    """
    dirs = toolkit.find_include_dirs()
    return None if dirs is None else tuple(dirs)


def nvrtc_options(dirs) -> tuple[str, ...]:
    """The options NVRTC gets for every kernel source on a GPU: C++17, ``csrc`` (for ``ptx.h``) and the
    CUDA header dirs ``dirs`` (:func:`_include_dirs`). One definition, also used by the CPU test that
    compiles every kernel with NVRTC (tests/kernels/cuda/test_cuda_nvrtc.py).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/cuda/test_cuda_nvrtc.py.
    """
    return ("-std=c++17", f"-I{build.CSRC}", *(f"-I{d}" for d in dirs))


class CompileFallbackWarning(UserWarning):
    """NVRTC could not build a kernel source and flashlib compiled it with nvcc instead; the message
    says what failed.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """


# What CuPy raises when NVRTC itself cannot run (as opposed to NVRTC rejecting the source, CuPy's
# CompileException): RuntimeError for "CuPy failed to load libnvrtc.so" (its NVRTCError, CUDARuntimeError
# and CUDADriverError are RuntimeErrors too: loading the compiled module can fail in the driver), OSError
# and ImportError for a library or module that is absent.
_NVRTC_UNAVAILABLE = (RuntimeError, OSError, ImportError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"


def _gpu_module(cupy, source: str, arch: str):
    """Compile ``source`` for ``arch``: NVRTC with the ``-I`` dirs :mod:`flashlib.kernels.cuda.toolkit` finds
    (dirs that hold every header the kernels include, followed through); else nvcc, which knows its own
    headers (``build.nvcc_cubin``, loaded from the cubin), with a :class:`CompileFallbackWarning`
    saying why: no such dirs, NVRTC rejects them (headers newer than the NVRTC that CuPy loads), or
    NVRTC cannot run at all (``_NVRTC_UNAVAILABLE``: libnvrtc missing, the module not loading).
    Before a cubin goes to the driver, nvcc's CUDA version is compared with the driver's
    (:func:`flashlib.kernels.cuda.toolkit.check_cubin_loads`: a CUDA 13 cubin does not load on a 12.x
    driver). With neither compiler: toolkit's RuntimeError naming the missing headers and every place
    tried, or a RuntimeError naming what NVRTC failed with.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    dirs, nvcc = _include_dirs(), toolchain.find_tool("nvcc")
    if dirs is not None:
        try:
            mod = cupy.RawModule(code=(build.CSRC / source).read_text(), backend="nvrtc",
                                 options=nvrtc_options(dirs))
            mod.compile()
            return mod
        except cupy.cuda.compiler.CompileException as exc:
            if nvcc is None:
                raise
            where = ", ".join(map(str, dirs))
            why = f"NVRTC rejected it with the CUDA headers in {where} ({_first_line(exc)})"
        except _NVRTC_UNAVAILABLE as exc:
            if nvcc is None:
                raise RuntimeError(
                    f"backend='cuda' compiles {source} with NVRTC through CuPy, and NVRTC could not run here "
                    f"({_first_line(exc)}); there is no nvcc to compile with instead. Fix: install the NVRTC "
                    "library of CuPy's CUDA (pip install nvidia-cuda-nvrtc-cu12, or -cu13, matching "
                    "cupy-cuda12x/13x), or the CUDA toolkit (its nvcc is used then)") from exc
            why = f"NVRTC could not build it ({_first_line(exc)})"
    elif nvcc is None:
        raise toolkit.not_found_error(toolkit.search(stop=False))
    else:
        why = "no folder holds every CUDA header NVRTC needs (flashlib.kernels.cuda.toolkit.search)"
    toolkit.check_cubin_loads(toolkit.nvcc_cuda_version(toolchain.tool_version(nvcc)),
                              toolkit.driver_cuda_version(cupy), nvcc=nvcc)
    warnings.warn(f"{source}: {why}; compiling it with nvcc ({nvcc}) for {arch} instead",
                  CompileFallbackWarning, stacklevel=2)
    return cupy.RawModule(path=str(build.nvcc_cubin(source, arch)))


def _gpu_function(source: str, kernel: str):
    """The kernel compiled for the current GPU (see :func:`_gpu_module`); modules are cached per
    (source, architecture).

    Explained in: notebooks/08_cuda.
    """
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError("CUDA tensors with backend='cuda' need CuPy, which compiles the kernels at run "
                           "time with NVRTC (Colab ships it; elsewhere: pip install cupy-cuda12x)") from exc
    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    mod = _GPU_MODULES.get((source, arch))
    if mod is None:
        mod = _GPU_MODULES[(source, arch)] = _gpu_module(cupy, source, arch)
    return mod.get_function(kernel)


def to_cupy(cupy, t):
    """A CuPy array over ``t``'s memory (no copy), for a kernel argument.

    ``t.detach()`` first: ``cupy.from_dlpack`` refuses a tensor that requires grad (BufferError), and
    the detached tensor shares ``t``'s storage, so what a kernel writes lands in the caller's tensor.
    2-byte dtypes are passed as int16 (CuPy has no bfloat16; the kernel reads the same bytes).

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    import torch

    t = t.detach()
    if t.element_size() == 2:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def _cupy_stream(cupy, torch_stream):
    """torch's current stream as a CuPy stream, so kernels queue behind torch's work: through the CUDA
    stream protocol (``Stream.from_external``, CuPy >= 14) where both sides have it, else CuPy's older
    ``ExternalStream`` (deprecated in CuPy 14).

    Explained in: notebooks/08_cuda.
    """
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(torch_stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream)


def run_gpu(specs, buffers: dict) -> dict:
    """Run ``specs`` on the GPU that holds the CUDA tensors in ``buffers`` (outputs written in place).

    Everything happens on torch's current stream, entered (as a CuPy stream) *before* the tensors are
    handed to CuPy: ``cupy.from_dlpack`` passes CuPy's current stream to DLPack, and torch makes that
    stream wait for its own when the two differ. Converting first (on CuPy's default, the legacy
    stream) made every call synchronise with the legacy stream, which CUDA-graph capture forbids.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_launch.py, tests/gpu/test_cuda_gpu.py.
    """
    import cupy
    import numpy as np
    import torch

    device = next(iter(buffers.values())).device
    with cupy.cuda.Device(device.index), _cupy_stream(cupy, torch.cuda.current_stream(device)):
        arrays = {name: to_cupy(cupy, t) for name, t in buffers.items()}     # on torch's stream
        for s in specs:
            fn = _gpu_function(s.source, s.kernel)
            if s.shared_bytes > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = s.shared_bytes
            args = tuple(arrays[v] if k == "buf" else (np.int32(v) if k == "i32" else np.float32(v))
                         for k, v in s.args)
            fn(s.grid, s.block, args, shared_mem=s.shared_bytes)
    return buffers
