"""The tool chain under flashlib's compilers, in one place: where builds are cached, the lock that makes
parallel processes build once, finding the tools (g++, nvcc, ptxas, cuobjdump, nvdisasm) and their versions,
and reading what they print — ``ptxas -v`` resource usage and the tensor-core instructions in SASS.

Both builders use it: :mod:`flashlib.kernels.cuda.build` (the emulator with g++, cubins with nvcc) and
:mod:`flashlib.tools.compile_report` (Triton's cubins). It is the lower layer: it imports neither of them,
nor torch or triton. The triton wheel's tools are located with ``importlib.util.find_spec``, which finds
the package without importing it (an import would fix Triton's interpreter or compiler mode for the
whole process).

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

__all__ = ["CUDA_TOOLS", "CUDA_DEFAULT", "MMA_OPCODES", "MMA_RE", "cache_dir", "locked", "build_atomically", "once",
           "triton_bin", "find_tool", "require_tool", "run_tool", "tool_version", "tool_label", "parse_ptxas",
           "count_mma"]

CUDA_TOOLS = ("nvcc", "ptxas", "cuobjdump", "nvdisasm")     # looked for in CUDA's folders too
CUDA_DEFAULT = "/usr/local/cuda"                            # where CUDA is installed by default (Colab too)
_ENV_OVERRIDE = {"g++": "CXX", "nvcc": "NVCC"}              # an explicit choice wins
_INSTALL_HINT = {
    "g++": "install a C++20 compiler (Debian/Ubuntu: apt-get install g++; Colab has it)",
    "nvcc": "install the CUDA toolkit (Colab has it in /usr/local/cuda/bin)",
}
_CUDA_HINT = "it ships with the CUDA toolkit, and pip's triton wheel carries a copy"

# Tensor-core instructions as cuobjdump prints them (the names its own opcode table holds): mma.sync
# (HMMA fp16/bf16/tf32, IMMA int8, BMMA 1-bit, DMMA fp64, QMMA fp8, OMMA fp4), Hopper's warpgroup wgmma
# (HGMMA, IGMMA, QGMMA) and Blackwell's tcgen05 (UTCHMMA, UTCMMA).
MMA_OPCODES = ("HMMA", "IMMA", "BMMA", "DMMA", "QMMA", "OMMA", "HGMMA", "IGMMA", "QGMMA", "UTCHMMA", "UTCMMA")
MMA_RE = re.compile(r"\b(" + "|".join(MMA_OPCODES) + r")\b")


# ---- the cache and the build lock ------------------------------------------------------------------
def cache_dir(*parts: str) -> pathlib.Path:
    """``$FLASHLIB_CACHE_DIR`` (default ``~/.cache/flashlib``), joined with ``parts`` and created.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    root = os.environ.get("FLASHLIB_CACHE_DIR") or (pathlib.Path.home() / ".cache" / "flashlib")
    path = pathlib.Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def locked(path):
    """An exclusive lock on the file ``path`` (created if missing) for the ``with`` block: other
    processes, and other threads that open it, wait. Without ``fcntl`` (not POSIX) there is no lock.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    try:
        import fcntl
    except ImportError:                                 # pragma: no cover - not POSIX: no lock
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_atomically(path, make) -> pathlib.Path:
    """``path``, (re)built by ``make(tmp)``: ``make`` writes a temporary file (or folder) ``tmp`` beside
    ``path``, which then replaces ``path`` in one ``os.replace`` — a reader never sees half a file, and a
    ``make`` that raises leaves nothing behind. Callers hold a :func:`locked` lock around it.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    path = pathlib.Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        make(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
    return path


def once(path, make, *, fresh: bool = False) -> pathlib.Path:
    """``path``, built by :func:`build_atomically` with ``make`` unless it exists (or always, with
    ``fresh``), under the lock ``<path>.lock``: parallel test workers wait for one build instead of
    running two.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    path = pathlib.Path(path)
    if path.exists() and not fresh:
        return path
    with locked(path.with_name(path.name + ".lock")):
        if fresh or not path.exists():
            build_atomically(path, make)
    return path


# ---- finding the tools -----------------------------------------------------------------------------
def triton_bin() -> pathlib.Path | None:
    """The triton wheel's ``backends/nvidia/bin`` (ptxas, cuobjdump, nvdisasm), found without
    importing triton; None without triton.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    return pathlib.Path(spec.origin).parent / "backends" / "nvidia" / "bin"


def _executable(path) -> str | None:
    path = pathlib.Path(path)
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _cuda_dirs() -> list[pathlib.Path]:
    """CUDA's ``bin`` folders: ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda``, then the nvcc's own."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), CUDA_DEFAULT]
    dirs = [pathlib.Path(r) / "bin" for r in roots if r]
    nvcc = shutil.which(os.environ.get("NVCC") or "nvcc")
    if nvcc:
        dirs.append(pathlib.Path(nvcc).resolve().parent)
    return dirs


def find_tool(name: str, *, triton_first: bool = False) -> str | None:
    """The path of tool ``name`` (``g++``, ``nvcc``, ``ptxas``, ``cuobjdump``, ``nvdisasm``), or None.

    Looks, in order: at ``$CXX`` (for g++) or ``$NVCC`` (for nvcc); on PATH; then, for the CUDA tools,
    in ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``/usr/local/cuda/bin`` and the folder of the nvcc on
    PATH; last in the triton wheel (:func:`triton_bin`). ``triton_first``: the wheel before PATH — the
    tools of the compiler that made a Triton cubin, so that they read it.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a tool name like 'nvcc', got {name!r}")
    env = _ENV_OVERRIDE.get(name)
    if env and os.environ.get(env) and shutil.which(os.environ[env]):
        return shutil.which(os.environ[env])
    wheel = triton_bin() if name in CUDA_TOOLS else None
    if triton_first and wheel is not None and _executable(wheel / name):
        return _executable(wheel / name)
    found = shutil.which(name)
    if found or name not in CUDA_TOOLS:
        return found
    for folder in _cuda_dirs() + ([wheel] if wheel is not None else []):
        if _executable(folder / name):
            return _executable(folder / name)
    return None


def require_tool(name: str, purpose: str, *, triton_first: bool = False) -> str:
    """:func:`find_tool` or a RuntimeError naming the missing tool, what needs it and how to get it.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    path = find_tool(name, triton_first=triton_first)
    if path is None:
        where = "on PATH, in CUDA's folders or in the triton wheel" if name in CUDA_TOOLS else "on PATH"
        raise RuntimeError(f"{purpose} needs `{name}`, which was not found {where}: "
                           f"{_INSTALL_HINT.get(name, _CUDA_HINT if name in CUDA_TOOLS else 'install it')}")
    return path


def run_tool(name: str, *args, purpose: str, triton_first: bool = False) -> str:
    """The standard output of ``name args...``; RuntimeError naming a missing tool (:func:`require_tool`)
    or quoting the tool's errors when it fails.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    tool = require_tool(name, purpose, triton_first=triton_first)
    proc = subprocess.run([tool, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{purpose}: `{name} {' '.join(map(str, args))}` failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-2000:]}")
    return proc.stdout


_VERSIONS: dict[str, str] = {}


def tool_version(path: str) -> str:
    """What ``path --version`` prints (asked once per process): part of every build's cache key.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    if path not in _VERSIONS:
        out = subprocess.run([path, "--version"], capture_output=True, text=True)
        _VERSIONS[path] = out.stdout.strip()
    return _VERSIONS[path]


def tool_label(name: str) -> str:
    """``"nvcc 13.0"``: the tool and its release, as a compile report names its compiler; ``"nvcc (not
    found)"`` without it.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    path = find_tool(name)
    if path is None:
        return f"{name} (not found)"
    text = tool_version(path)
    m = re.search(r"release (\d+\.\d+)", text) or re.search(r"\b(\d+\.\d+(?:\.\d+)?)\b", text)
    return f"{name} {m.group(1)}" if m else name


# ---- reading what the tools print ------------------------------------------------------------------
_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS_FOR_RE = re.compile(r"Function properties for (\S+)")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?\b(\d+) bytes smem)?")
_FUNCTION_RE = re.compile(r"Function : (\S+)")


def parse_ptxas(log: str) -> dict[str, dict]:
    """Per entry function of a ``ptxas -v`` log (nvcc ``--resource-usage``, Triton's
    ``TRITON_DUMP_PTXAS_LOG``): ``{"registers", "stack_bytes", "spill_stores", "spill_loads",
    "static_smem"}`` in registers per thread and bytes; None where the log does not say.

    The properties of a device function that was not inlined (``Function properties for _Z6helperPfi``,
    printed after its caller's) are not the entry's.

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    out: dict[str, dict] = {}
    entry = props_of = entry_name = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            entry = props_of = out.setdefault(m.group(1), dict.fromkeys(
                ("registers", "stack_bytes", "spill_stores", "spill_loads", "static_smem")))
            entry_name = m.group(1)
            continue
        m = _PROPS_FOR_RE.search(line)
        if m:
            props_of = entry if m.group(1) == entry_name else None
            continue
        m = _PROPS_RE.search(line)
        if m and props_of is not None:
            props_of.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                            spill_loads=int(m.group(3)))
            continue
        m = _USED_RE.search(line)
        if m and entry is not None:
            entry.update(registers=int(m.group(1)), static_smem=int(m.group(2) or 0))
    return out


def count_mma(sass: str, pattern: re.Pattern = MMA_RE) -> dict[str, int]:
    """Tensor-core instructions (:data:`MMA_OPCODES`) per function of ``cuobjdump -sass`` output — or
    the instructions ``pattern`` matches (e.g. ``re.compile(r"\bLDSM\b")``).

    Explained in: notebooks/appendix_verification.
    
    Tested in: tests/tools/test_toolchain.py.
    """
    counts: dict[str, int] = {}
    current = None
    for line in sass.splitlines():
        m = _FUNCTION_RE.search(line)
        if m:
            current = m.group(1)
            counts[current] = 0
        elif current is not None and pattern.search(line):
            counts[current] += 1
    return counts
