"""Building flashlib's CUDA sources: for the CPU emulator with g++, and with nvcc for the compile report.

* :func:`emulator_binary` compiles one ``.cu`` file, unchanged, together with ``emulator.h`` and
  ``runner.cpp`` into a small executable (optionally under AddressSanitizer or ThreadSanitizer). It is
  built once per (source hash, mode) and cached in ``$FLASHLIB_CACHE_DIR`` (default
  ``~/.cache/flashlib``); parallel test workers wait on a file lock instead of compiling twice.
* :func:`nvcc_cubin` compiles a ``.cu`` file to a cubin for one architecture with
  ``nvcc -cubin --resource-usage`` (cached by source hash); :func:`nvcc_usage` disassembles it with
  ``cuobjdump -sass``: registers, spills, static shared memory and tensor-core (HMMA/HGMMA) instruction
  counts per kernel, cached as JSON. A GPU whose CUDA headers NVRTC cannot find loads the cubin.

Why a child process rather than ctypes: a sanitizer runtime must be the first library a process loads,
so an ASan/TSan build cannot be ``dlopen``-ed into a running Python; and an emulator abort (a WMMA
precondition, a divergent barrier, a deadlock) must become a Python exception, not kill the reader's
Jupyter kernel. The executable's plan protocol is described in ``runner.cpp``.

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess

__all__ = ["CSRC", "EMU_DIR", "SANITIZERS", "cache_dir", "find_tool", "require_tool", "kernel_names",
           "harness_text", "emulator_binary", "nvcc_cubin", "nvcc_usage", "nvcc_label"]

EMU_DIR = pathlib.Path(__file__).resolve().parent
CSRC = EMU_DIR / "csrc"
SANITIZERS = (None, "address", "thread")
_SAN_FLAGS = {
    None: ["-O2"],
    "address": ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
    "thread": ["-O1", "-g", "-fsanitize=thread"],
}
_INSTALL_HINT = {
    "g++": "install a C++20 compiler (Debian/Ubuntu: apt-get install g++; Colab has it)",
    "nvcc": "install the CUDA toolkit (Colab has it in /usr/local/cuda/bin)",
    "cuobjdump": "it ships with the CUDA toolkit, and pip's triton wheel carries a copy",
}


def cache_dir() -> pathlib.Path:
    """Where built emulators and compile results live: ``$FLASHLIB_CACHE_DIR`` or ``~/.cache/flashlib``."""
    root = os.environ.get("FLASHLIB_CACHE_DIR") or (pathlib.Path.home() / ".cache" / "flashlib")
    path = pathlib.Path(root) / "cuda"
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_tool(name: str) -> str | None:
    """Path of ``g++``, ``nvcc`` or ``cuobjdump``, or None.

    Looks on PATH, then in ``$CUDA_HOME/bin``, ``/usr/local/cuda/bin`` and nvcc's own directory; for
    ``cuobjdump`` last in the triton wheel (``triton/backends/nvidia/bin``, found without importing
    triton, which would fix its interpreter mode for the whole process).
    """
    env = {"g++": "CXX", "nvcc": "NVCC"}.get(name)
    if env and os.environ.get(env) and shutil.which(os.environ[env]):
        return shutil.which(os.environ[env])
    found = shutil.which(name)
    if found or name == "g++":
        return found
    dirs = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    cands = [pathlib.Path(d) / "bin" / name for d in dirs if d]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(pathlib.Path(nvcc).resolve().parent / name)
    if name == "cuobjdump":
        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            cands.append(pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name)
    for c in cands:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return None


def require_tool(name: str, purpose: str) -> str:
    """:func:`find_tool` or a RuntimeError naming the missing tool, what needs it and how to get it."""
    path = find_tool(name)
    if path is None:
        raise RuntimeError(f"{purpose} needs `{name}`, which was not found on PATH: "
                           f"{_INSTALL_HINT.get(name, 'install it')}")
    return path


_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
_DYN_SMEM_RE = re.compile(
    r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*?)"
    r"\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_]\w*)\s*\[\s*\]\s*;")


def kernel_names(text: str) -> list[str]:
    """The ``extern "C" __global__`` kernels a source defines, in order."""
    return _KERNEL_RE.findall(text)


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


_TOOL_VERSIONS: dict[str, str] = {}


def _tool_version(path: str) -> str:
    if path not in _TOOL_VERSIONS:
        out = subprocess.run([path, "--version"], capture_output=True, text=True)
        _TOOL_VERSIONS[path] = out.stdout.strip()
    return _TOOL_VERSIONS[path]


def nvcc_label() -> str:
    """"nvcc 13.0": the compiler behind the CUDA rows of the compile report (true for it only).

    Explained in: notebooks/08_cuda.
    """
    nvcc = find_tool("nvcc")
    if nvcc is None:
        return "nvcc (not found)"
    m = re.search(r"release (\d+\.\d+)", _tool_version(nvcc))
    return f"nvcc {m.group(1)}" if m else "nvcc"


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with open(str(path) + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _once(path: pathlib.Path, make) -> pathlib.Path:
    """``path``, after ``make()`` has created it unless it exists: under a file lock, so parallel test
    workers wait for one build instead of running two.

    Explained in: notebooks/08_cuda.
    """
    if not path.exists():
        with _locked(path):
            if not path.exists():
                make()
    return path


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
    """
    if sanitizer not in SANITIZERS:
        raise ValueError(f"sanitizer must be one of {SANITIZERS}, got {sanitizer!r}")
    gxx = require_tool("g++", "the CUDA emulator")
    name, text, origin = _source(source)
    harness = harness_text(text, origin)
    flags = ["-std=c++20", "-pthread", "-w", f"-I{EMU_DIR / 'include'}", *_SAN_FLAGS[sanitizer]]
    key = hashlib.sha256("\0".join([harness, _emulator_files_text(), " ".join(flags),
                                    _tool_version(gxx)]).encode()).hexdigest()[:16]
    mode = sanitizer or "plain"
    exe = cache_dir() / f"emu-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{mode}-{key}"

    def make():
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(harness)
        tmp = exe.with_name(exe.name + f".tmp{os.getpid()}")
        proc = subprocess.run([gxx, *flags, str(cpp), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ could not build the emulator for {name} ({mode}):\n"
                               f"{proc.stderr[-6000:]}")
        os.replace(tmp, exe)
    return _once(exe, make)


# ---- nvcc: resource usage and SASS ----------------------------------------------------------------
_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_MMA_RE = re.compile(r"\b(HMMA|HGMMA|IMMA|BMMA|UTCHMMA|UTCMMA)\b")


def _parse_resource_usage(text: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current = out.setdefault(m.group(1), {"registers": None, "stack_bytes": 0, "spill_bytes": 0,
                                                  "static_smem": 0})
            continue
        if current is None:
            continue
        m = _PROPS_RE.search(line)
        if m:
            current["stack_bytes"] = int(m.group(1))
            current["spill_bytes"] = int(m.group(2)) + int(m.group(3))
            continue
        m = _USED_RE.search(line)
        if m:
            current["registers"] = int(m.group(1))
            current["static_smem"] = int(m.group(2) or 0)
    return out


def _count_mma(sass: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    current = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            current = m.group(1)
            counts[current] = 0
        elif current is not None and _MMA_RE.search(line):
            counts[current] += 1
    return counts


def _nvcc_job(source, arch, purpose):
    """``(nvcc, name, text, key)`` for compiling ``source`` for ``arch``; ``key`` hashes the source,
    the arch and nvcc's version (the cache key of everything built from them).

    Explained in: notebooks/08_cuda.
    """
    if not re.fullmatch(r"sm_\d+a?", str(arch)):
        raise ValueError(f"arch must look like 'sm_80', got {arch!r}")
    nvcc = require_tool("nvcc", purpose)
    name, text, _ = _source(source)
    key = hashlib.sha256("\0".join([text, arch, _tool_version(nvcc)]).encode()).hexdigest()[:16]
    return nvcc, name, text, key


def nvcc_cubin(source, arch: str) -> pathlib.Path:
    """Compile ``source`` with ``nvcc -cubin -arch=<arch> --resource-usage`` (once, cached by source,
    arch and nvcc version); returns the cubin's path. ptxas's resource report is kept beside it, in
    ``<cubin>.ptxas.txt``. Used by the compile report and, on a GPU whose CUDA headers NVRTC cannot
    find, to build the kernels (nvcc knows where its own headers are). Raises RuntimeError naming a
    missing nvcc or quoting its errors.

    Explained in: notebooks/08_cuda.
    """
    nvcc, name, text, key = _nvcc_job(source, arch, "compiling flashlib's CUDA kernels with nvcc")
    cubin = cache_dir() / f"nvcc-{name}-{arch}-{key}.cubin"

    def make():
        work = cache_dir() / f"nvcc-{name}-{arch}-{key}-{os.getpid()}"
        work.mkdir(exist_ok=True)
        try:
            src = work / f"{name}.cu"
            src.write_text(text)
            out = work / f"{name}.cubin"
            proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "--resource-usage",
                                   "-o", str(out), str(src)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc could not compile {name} for {arch}:\n{proc.stderr[-6000:]}")
            pathlib.Path(str(cubin) + ".ptxas.txt").write_text(proc.stdout + proc.stderr)
            os.replace(out, cubin)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return _once(cubin, make)


def nvcc_usage(source, arch: str) -> dict[str, dict]:
    """Per-kernel ``{"registers", "stack_bytes", "spill_bytes", "static_smem", "mma_instructions"}``.

    Compiles ``source`` with :func:`nvcc_cubin` and counts tensor-core instructions (HMMA on
    sm_75..sm_89, HGMMA/HMMA on sm_90) in ``cuobjdump -sass``. Cached as JSON by (source, arch, nvcc
    version). Raises RuntimeError naming a missing tool or quoting nvcc's errors.

    Explained in: notebooks/08_cuda.
    """
    _, name, _, key = _nvcc_job(source, arch, "the CUDA compile report")
    cuobjdump = require_tool("cuobjdump", "counting tensor-core instructions in the compile report")
    cached = cache_dir() / f"nvcc-{name}-{arch}-{key}.json"

    def make():
        cubin = nvcc_cubin(source, arch)
        usage = _parse_resource_usage(pathlib.Path(str(cubin) + ".ptxas.txt").read_text())
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True)
        if sass.returncode != 0:
            raise RuntimeError(f"cuobjdump -sass failed on {name} ({arch}): {sass.stderr[-2000:]}")
        mma = _count_mma(sass.stdout)
        for kname, row in usage.items():
            row["mma_instructions"] = mma.get(kname, 0)
        tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(usage, indent=1, sort_keys=True))
        os.replace(tmp, cached)                  # readers that skip the lock never see half a file
    return json.loads(_once(cached, make).read_text())
