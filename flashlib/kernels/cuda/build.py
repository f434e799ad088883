"""Building flashlib's CUDA sources: for the CPU emulator with g++, and with nvcc for the compile report.

* :func:`emulator_binary` compiles one ``.cu`` file, unchanged, together with ``emulator.h`` and
  ``runner.cpp`` into a small executable (optionally under AddressSanitizer or ThreadSanitizer). It is
  built once per (source hash, mode) and cached in ``$FLASHLIB_CACHE_DIR/cuda`` (default
  ``~/.cache/flashlib``); parallel test workers wait on a file lock instead of compiling twice.
* :func:`nvcc_cubin` compiles a ``.cu`` file to a cubin for one architecture with
  ``nvcc -cubin --resource-usage`` (cached by source hash); :func:`nvcc_usage` disassembles it with
  ``cuobjdump -sass``: registers, spills, static shared memory and tensor-core (HMMA/HGMMA) instruction
  counts per kernel, cached as JSON. A GPU whose CUDA headers NVRTC cannot find loads the cubin.
* :func:`cu_constant` reads an integer constant a source declares (a tile size, the threads per block),
  so that the launch geometry in ``launch.py`` is computed from the kernel's own value.

The cache, the lock, finding g++/nvcc/cuobjdump and reading their output are
:mod:`flashlib.tools.toolchain`'s, shared with the compile report.

Why a child process rather than ctypes: a sanitizer runtime must be the first library a process loads,
so an ASan/TSan build cannot be ``dlopen``-ed into a running Python; and an emulator abort (a WMMA
precondition, a divergent barrier, a deadlock) must become a Python exception, not kill the reader's
Jupyter kernel. The executable's plan protocol is described in ``runner.cpp``.

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import re
import subprocess
import tempfile

from ...tools import toolchain

__all__ = ["CSRC", "EMU_DIR", "SANITIZERS", "cu_constant", "includes", "local_includes", "emulator_binary",
           "nvcc_cubin", "nvcc_usage"]

EMU_DIR = pathlib.Path(__file__).resolve().parent
CSRC = EMU_DIR / "csrc"
SANITIZERS = (None, "address", "thread")
_SAN_FLAGS = {
    None: ["-O2"],
    "address": ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
    "thread": ["-O1", "-g", "-fsanitize=thread"],
}
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
_DYN_SMEM_RE = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*?)"
    r"\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_]\w*)\s*\[\s*\]\s*;")


def kernel_names(text: str) -> list[str]:
    """The ``extern "C" __global__`` kernels a source defines, in order."""
    return _KERNEL_RE.findall(text)


def cu_constant(source, name: str) -> int:
    """The integer constant ``name`` that CUDA source ``source`` declares, as ``constexpr int NAME = 16;``
    or ``#define NAME 16`` at the start of a line: the launch geometry in ``launch.py`` is computed
    from the kernel's own tile sizes instead of a copy kept in step by a comment.

    Args:
        source: as :func:`emulator_binary` (a csrc file name, a path, or a ``(name, text)`` pair).
        name: the constant, e.g. ``"V1_BC"``.

    Raises:
        ValueError naming the file and the constant when the source declares it not once, or not as an
        integer literal.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    _, text, origin = _source(source)
    n = re.escape(name)
    found = re.findall(rf"^[ \t]*(?:static[ \t]+)?constexpr[ \t]+int[ \t]+{n}[ \t]*=[ \t]*(\d+)[ \t]*;"
                       rf"|^[ \t]*#[ \t]*define[ \t]+{n}[ \t]+(\d+)\b", text, re.M)
    if len(found) != 1:
        raise ValueError(f"{origin} must declare the constant {name} once, as `constexpr int {name} = "
                         f"<integer>;` or `#define {name} <integer>`; found {len(found)} such declarations")
    return int("".join(found[0]))


def harness_text(text: str, origin: str) -> str:
    """The C++ translation unit the emulator compiles for CUDA source ``text`` (file ``origin``).

    It includes ``emulator.h``, then the source — with ``#line`` so that compiler errors and sanitizer
    reports name the real ``.cu`` lines — then registers every ``extern "C"`` kernel and includes the
    runner's ``main``. The one rewrite: ``extern __shared__ T name[];`` becomes a pointer to the
    launch's dynamic shared-memory buffer (C++ has no storage class for "shared by a block, sized at
    launch"); it stays on its line.
    """
    names = kernel_names(text)
    if not names:
        raise ValueError(f"{origin}: no extern \"C\" __global__ kernel found")
    body = _DYN_SMEM_RE.sub(
        lambda m: f"{m.group(1)}* const {m.group(2)} = reinterpret_cast<{m.group(1)}*>(::emu::dynamic_smem());",
        text)
    regs = "\n".join(f"FLASHLIB_EMU_KERNEL({n})" for n in names)
    return (f'#include "{EMU_DIR / "emulator.h"}"\n#line 1 "{origin}"\n{body}\n'
            f'#line 1 "flashlib-emulator-registrations"\n{regs}\n#include "{EMU_DIR / "runner.cpp"}"\n')


def _emulator_files_text() -> str:
    parts = [(EMU_DIR / "emulator.h").read_text(), (EMU_DIR / "runner.cpp").read_text()]
    parts += [p.read_text() for p in sorted((EMU_DIR / "include").glob("*.h"))]
    return "\n".join(parts)


_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"\n]+)[>"]', re.M)


def includes(text: str) -> list[tuple[str, bool]]:
    """``(name, quoted)`` for every ``#include`` line of ``text``: ``quoted`` for ``"name"``, False
    for ``<name>``.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    return [(name.strip(), mark == '"') for mark, name in _INCLUDE_RE.findall(text)]


def local_includes(text: str) -> list[str]:
    """The texts of the ``csrc`` files ``text`` includes with quotes, followed through (``ptx.h``; the
    forward v3 file that the backward builds on): part of every cache key, so that editing an included
    file rebuilds everything that includes it.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/cuda/test_cuda_bwd.py.
    """
    seen, out, todo = set(), [], [text]
    while todo:
        for name, quoted in includes(todo.pop(0)):
            path = CSRC / name
            if quoted and name not in seen and path.is_file():
                seen.add(name)
                out.append(path.read_text())
                todo.append(out[-1])
    return out


def _cache() -> pathlib.Path:
    return toolchain.cache_dir("cuda")


def _source(source) -> tuple[str, str, str]:
    """(name, text, origin) of a source given as a csrc file name, a path, or a (name, text) pair."""
    if isinstance(source, tuple):
        name, text = source
        return str(name), str(text), str(name)
    path = pathlib.Path(source)
    if not path.is_absolute() and not path.exists():
        path = CSRC / path
    if not path.is_file():
        raise ValueError(f"source must be a file in {CSRC}, a path, or a (name, text) pair; got {source!r}")
    return path.stem, path.read_text(), str(path.resolve())


def emulator_binary(source, sanitizer: str | None = None) -> pathlib.Path:
    """Build (once, cached) the emulator executable for ``source`` in mode ``sanitizer``.

    Args:
        source: a file name in ``flashlib/kernels/cuda/csrc`` (``"fa2_fwd_v1_scalar.cu"``), a path, or a
            ``(name, text)`` pair for source text that lives nowhere on disk (a planted bug).
        sanitizer: None, ``"address"`` (ASan: out-of-bounds, use-after-free) or ``"thread"`` (TSan:
            data races between the emulated CUDA threads).

    Returns:
        The executable's path. Raises RuntimeError with g++'s diagnostics if the source does not compile.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/kernels/cuda/test_cuda_emulator.py.
    """
    if sanitizer not in SANITIZERS:
        raise ValueError(f"sanitizer must be one of {SANITIZERS}, got {sanitizer!r}")
    gxx = toolchain.require_tool("g++", "the CUDA emulator")
    name, text, origin = _source(source)
    harness = harness_text(text, origin)
    flags = ["-std=c++20", "-pthread", "-w", f"-I{EMU_DIR / 'include'}", f"-I{CSRC}", *_SAN_FLAGS[sanitizer]]
    key = hashlib.sha256("\0".join([harness, *local_includes(text), _emulator_files_text(), " ".join(flags),
                                    toolchain.tool_version(gxx)]).encode()).hexdigest()[:16]
    mode = sanitizer or "plain"
    exe = _cache() / f"emu-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{mode}-{key}"

    def make(tmp):
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(harness)
        proc = subprocess.run([gxx, *flags, str(cpp), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ could not build the emulator for {name} ({mode}):\n"
                               f"{proc.stderr[-6000:]}")
    return toolchain.once(exe, make)


# ---- nvcc: resource usage and SASS ----------------------------------------------------------------
def _nvcc_job(source, arch, purpose):
    """``(nvcc, name, text, key)`` for compiling ``source`` for ``arch``; ``key`` hashes the source and
    the files it includes from csrc, the arch and nvcc's version (the cache key of everything built
    from them).

    Explained in: notebooks/08_cuda.
    """
    if not re.fullmatch(r"sm_\d+a?", str(arch)):
        raise ValueError(f"arch must look like 'sm_80', got {arch!r}")
    nvcc = toolchain.require_tool("nvcc", purpose)
    name, text, _ = _source(source)
    key = hashlib.sha256("\0".join([text, *local_includes(text), arch, toolchain.tool_version(nvcc)])
                         .encode()).hexdigest()[:16]
    return nvcc, name, text, key


def nvcc_cubin(source, arch: str) -> pathlib.Path:
    """Compile ``source`` with ``nvcc -cubin -arch=<arch> --resource-usage`` (once, cached by source,
    arch and nvcc version); returns the cubin's path. ptxas's resource report is kept beside it, in
    ``<cubin>.ptxas.txt``. Used by the compile report and, on a GPU whose CUDA headers NVRTC cannot
    find, to build the kernels (nvcc knows where its own headers are). Raises RuntimeError naming a
    missing nvcc or quoting its errors.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    nvcc, name, text, key = _nvcc_job(source, arch, "compiling flashlib's CUDA kernels with nvcc")
    cubin = _cache() / f"nvcc-{name}-{arch}-{key}.cubin"

    def make(tmp):
        with tempfile.TemporaryDirectory(prefix=f"nvcc-{name}-", dir=_cache()) as work:
            src = pathlib.Path(work) / f"{name}.cu"
            src.write_text(text)
            proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "--resource-usage", f"-I{CSRC}",
                                   "-o", str(tmp), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc could not compile {name} for {arch}:\n{proc.stderr[-6000:]}")
        pathlib.Path(str(cubin) + ".ptxas.txt").write_text(proc.stdout + proc.stderr)
    return toolchain.once(cubin, make)


def nvcc_usage(source, arch: str) -> dict[str, dict]:
    """Per-kernel ``{"registers", "stack_bytes", "spill_bytes", "static_smem", "mma_instructions",
    "ldsm_instructions", "ldgsts_instructions"}``.

    Compiles ``source`` with :func:`nvcc_cubin`, reads ptxas's report (``spill_bytes``: spill stores
    plus loads) and counts, in ``cuobjdump -sass``, tensor-core instructions (HMMA on sm_75..sm_89,
    HGMMA/HMMA on sm_90), ldmatrix (LDSM) and cp.async (LDGSTS). Cached as JSON by (source, arch, nvcc version). Raises RuntimeError naming a
    missing tool or quoting nvcc's errors.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_compile.py.
    """
    _, name, _, key = _nvcc_job(source, arch, "the CUDA compile report")
    purpose = "counting tensor-core instructions in the compile report"
    toolchain.require_tool("cuobjdump", purpose)             # before a compile that could not be read

    def make(tmp):
        cubin = nvcc_cubin(source, arch)
        ptxas = toolchain.parse_ptxas(pathlib.Path(str(cubin) + ".ptxas.txt").read_text())
        sass = toolchain.run_tool("cuobjdump", "-sass", cubin, purpose=purpose)
        counts = {field: toolchain.count_mma(sass, pattern) for field, pattern in _SASS_COUNTS.items()}
        usage = {kname: {"registers": u["registers"], "stack_bytes": u["stack_bytes"],
                         "spill_bytes": None if u["spill_stores"] is None else u["spill_stores"] + u["spill_loads"],
                         "static_smem": u["static_smem"],
                         **{field: c.get(kname, 0) for field, c in counts.items()}}
                 for kname, u in ptxas.items()}
        tmp.write_text(json.dumps(usage, indent=1, sort_keys=True))
    return json.loads(toolchain.once(_cache() / f"nvcc-{name}-{arch}-{key}.sass-counts.json", make).read_text())


# SASS instructions nvcc_usage counts per kernel: tensor-core mma (HMMA/HGMMA...), ldmatrix (LDSM) and
# cp.async (LDGSTS).
_SASS_COUNTS = {"mma_instructions": toolchain.MMA_RE, "ldsm_instructions": re.compile(r"\bLDSM\b"),
                "ldgsts_instructions": re.compile(r"\bLDGSTS\b")}
