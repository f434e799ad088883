"""Finding the CUDA headers that NVRTC needs to compile flashlib's kernels on a GPU.

NVRTC compiles a kernel in memory but does not know where the CUDA headers live: the caller passes
``-I`` directories. Which directory is right is less obvious than it looks. CuPy's
``cupy.cuda.get_cuda_path()`` may answer with a pip wheel's folder (``site-packages/nvidia/cu13``)
whose ``include/mma.h`` includes ``crt/mma.h`` — a file that wheel does not ship — while a complete
toolkit sits in ``/usr/local/cuda``. So a directory qualifies here only if it really holds every file
the kernels include, followed through the headers themselves (:func:`missing_headers`).

Candidates, tried in this order (the first complete one wins; :func:`search` reports each):

1. ``$CUDA_PATH``, then ``$CUDA_HOME`` (a toolkit root: its ``include``);
2. the toolkit of the ``nvcc`` on ``PATH`` (``<nvcc, symlinks resolved>/../../include``);
3. the usual install prefixes: ``/usr/local/cuda``, ``/usr/local/cuda-*`` newest version first,
   ``/opt/cuda``, ``/usr``;
4. NVIDIA's pip wheels: every ``nvidia/*/include`` folder of one ``sys.path`` entry, together (the
   ``nvidia-cuda-runtime`` wheel has ``mma.h``, the ``nvidia-cuda-nvcc`` wheel has ``crt/``; passing
   both as ``-I`` is what a compiler needs);
5. CuPy's ``cupy.cuda.get_cuda_path()``.

A toolkit root also contributes its ``targets/*/include`` folders (conda's layout). When nothing
qualifies, ``flashlib.kernels.cuda.launch`` compiles with ``nvcc`` instead (nvcc knows its own headers), and
without nvcc raises :func:`not_found_error`'s RuntimeError: the missing headers, every place tried, and
how to fix it.

Explained in: notebooks/08_cuda.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import sys
from dataclasses import dataclass

from .build import CSRC, includes

__all__ = ["Candidate", "includes", "required_headers", "missing_headers", "candidates", "search",
           "find_include_dirs", "explain", "not_found_error", "PREFIXES"]

PREFIXES = ("/usr/local/cuda", "/usr/local/cuda-*", "/opt/cuda", "/usr")



@dataclass(frozen=True)
class Candidate:
    """One place tried: where it came from, its include dirs, and what it lacks (empty: it qualifies).

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    origin: str
    dirs: tuple[pathlib.Path, ...]
    missing: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return bool(self.dirs) and not self.missing


def required_headers(sources=None) -> tuple[str, ...]:
    """The headers the kernels include, read from their ``#include`` lines (so the list cannot drift).

    ``sources``: paths of ``.cu`` files (default: every file in ``flashlib/kernels/cuda/csrc``).

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    paths = sorted(CSRC.glob("*.cu")) if sources is None else [pathlib.Path(p) for p in sources]
    # flashlib's own headers (csrc/ptx.h) travel with the kernels (-I csrc), not with the toolkit
    return tuple(sorted({name for p in paths for name, _ in includes(p.read_text()) if not (CSRC / name).is_file()}))


def missing_headers(dirs, headers=None) -> tuple[str, ...]:
    """What ``-I dirs`` lacks of ``headers`` (default :func:`required_headers`), followed through.

    Every header found is read in turn, and each file *it* includes with quotes — the toolkit's own
    files, like ``mma.h``'s ``"crt/mma.h"`` — must be found too, next to the including file or in
    ``dirs`` (the preprocessor's order). Angle-bracket includes inside toolkit headers (``<utility>``,
    ``<nv/target>``) are left to the compiler: NVRTC provides them or the headers skip them under
    ``__CUDACC_RTC__``. Returns names such as ``"crt/mma.h (included by mma.h)"``; empty when complete.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    dirs = [pathlib.Path(d) for d in dirs]
    todo = [(name, None) for name in (required_headers() if headers is None else headers)]
    seen, missing = set(), []
    while todo:
        name, parent = todo.pop(0)
        where = [parent.parent] if parent is not None else []
        found = next((d / name for d in where + dirs if (d / name).is_file()), None)
        key = found.resolve() if found is not None else name    # a missing file is named once
        if key in seen:
            continue
        seen.add(key)
        if found is None:
            missing.append(name if parent is None else f"{name} (included by {_short(parent, dirs)})")
            continue
        text = found.read_text(errors="replace")
        todo += [(inc, found) for inc, quoted in includes(text) if quoted]
    return tuple(missing)


def _short(path: pathlib.Path, dirs) -> str:
    for d in dirs:
        try:
            return str(path.relative_to(d))
        except ValueError:
            pass
    return str(path)


def _version_key(path: pathlib.Path):
    """Sort key for ``/usr/local/cuda-12.4``: its version numbers (``cuda-13.0`` > ``cuda-12.10``).

    Explained in: notebooks/08_cuda.
    """
    return [int(n) for n in re.findall(r"\d+", path.name)]


def _prefix_dirs(prefixes) -> list[pathlib.Path]:
    out = []
    for p in prefixes:
        if "*" in str(p):
            base = pathlib.Path(p)
            out += sorted(base.parent.glob(base.name), key=_version_key, reverse=True)
        else:
            out.append(pathlib.Path(p))
    return out


def _root_dirs(root) -> tuple[pathlib.Path, ...]:
    """The include dirs of a toolkit root: ``root/include``, plus ``root/targets/*/include``.

    Explained in: notebooks/08_cuda.
    """
    root = pathlib.Path(root)
    out = {}
    for d in (root / "include", *sorted(root.glob("targets/*/include"))):
        if d.is_dir():
            out.setdefault(d.resolve(), d)          # a symlinked duplicate is passed once
    return tuple(out.values())


def _cupy_cuda_path() -> str | None:
    try:
        import cupy
        return cupy.cuda.get_cuda_path()
    except Exception:                   # no CuPy, or no CUDA for it: this candidate is simply absent
        return None


def candidates(env=None, *, prefixes=PREFIXES, site_dirs=None, cupy_cuda_path=_cupy_cuda_path):
    """``(origin, dirs)`` pairs in the order :func:`search` tries them (see the module docstring).

    Args:
        env: the environment to read ``CUDA_PATH``, ``CUDA_HOME`` and ``PATH`` from (default
            ``os.environ``).
        prefixes: install prefixes; an entry with ``*`` is globbed and sorted newest version first.
        site_dirs: folders that may hold NVIDIA's ``nvidia/`` wheels (default ``sys.path``).
        cupy_cuda_path: a function returning CuPy's CUDA path or None.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    env = os.environ if env is None else env
    out = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if env.get(var):
            out.append((f"${var}={env[var]}", _root_dirs(env[var])))
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        out.append((f"the nvcc on PATH ({nvcc})", _root_dirs(pathlib.Path(nvcc).resolve().parent.parent)))
    out += [(str(p), _root_dirs(p)) for p in _prefix_dirs(prefixes)]
    for site in (sys.path if site_dirs is None else site_dirs):
        wheels = sorted(pathlib.Path(site or ".").glob("nvidia/*/include"))
        if wheels:
            out.append((f"NVIDIA pip wheels in {site}", tuple(wheels)))
    cupy_path = cupy_cuda_path()
    if cupy_path:
        out.append((f"cupy.cuda.get_cuda_path() = {cupy_path}", _root_dirs(cupy_path)))
    return out


def search(env=None, *, headers=None, stop=True, **where) -> list[Candidate]:
    """Try :func:`candidates` in order; returns a :class:`Candidate` per place tried, up to and
    including the first complete one (all of them with ``stop=False``). ``where``: as :func:`candidates`.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    tried, checked = [], {}
    for origin, dirs in candidates(env, **where):
        key = tuple(d.resolve() for d in dirs)  # /usr/local/cuda and /usr/local/cuda-13.0: read once
        if key not in checked:
            checked[key] = missing_headers(dirs, headers) if dirs else ()
        tried.append(Candidate(origin, dirs, checked[key]))
        if stop and tried[-1].ok:
            break
    return tried


def find_include_dirs(env=None, **kw) -> list[pathlib.Path] | None:
    """The ``-I`` directories of the first complete candidate (one dir, or a wheel set), or None.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    tried = search(env, **kw)
    return list(tried[-1].dirs) if tried and tried[-1].ok else None


def explain(tried) -> str:
    """One line per :class:`Candidate` tried: where, which dirs, what it lacks.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/test_ops.py.
    """
    lines = []
    for c in tried:
        if not c.dirs:
            lines.append(f"  - {c.origin}: no include folder there")
            continue
        state = "complete" if c.ok else "missing " + ", ".join(c.missing)
        lines.append(f"  - {c.origin}: {', '.join(map(str, c.dirs))}: {state}")
    return "\n".join(lines) if lines else "  (no candidate existed)"


def not_found_error(tried, headers=None) -> RuntimeError:
    """The RuntimeError for "no include directory qualifies and there is no nvcc": the headers the
    kernels need, every place tried with what it lacked, and how to fix it.

    Explained in: notebooks/appendix_verification.

    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    need = ", ".join(required_headers() if headers is None else headers)
    return RuntimeError(
        f"backend='cuda' compiles flashlib's kernels with NVRTC, which needs the CUDA headers {need} "
        f"(and the toolkit files they include), but no folder tried holds them all, and there is no "
        f"nvcc to compile with instead. Tried, in order:\n{explain(tried)}\n"
        "Fix: install the CUDA toolkit (it puts everything in /usr/local/cuda), or "
        "`pip install nvidia-cuda-nvcc-cu12` (or -cu13, matching your CUDA) next to "
        "nvidia-cuda-runtime, or set CUDA_PATH to a complete toolkit.")


# ---- nvcc's CUDA against the driver's --------------------------------------------------------------
def nvcc_cuda_version(version_text: str) -> tuple[int, int]:
    """``(major, minor)`` of the CUDA release ``nvcc --version`` printed (``"... release 12.4, V12.4.131"``
    -> ``(12, 4)``); ValueError quoting the text when it names none.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    if not isinstance(version_text, str):
        raise TypeError(f"version_text must be what `nvcc --version` printed (a str), got "
                        f"{type(version_text).__name__}")
    m = re.search(r"release (\d+)\.(\d+)", version_text)
    if m is None:
        raise ValueError(f"version_text: expected `nvcc --version` output with 'release X.Y', got "
                         f"{version_text[-200:]!r}")
    return int(m.group(1)), int(m.group(2))


def driver_cuda_version(cupy) -> tuple[int, int]:
    """``(major, minor)`` of the newest CUDA the installed driver runs: ``cudaDriverGetVersion`` through
    CuPy (12040 -> ``(12, 4)``).

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_launch.py.
    """
    v = int(cupy.cuda.runtime.driverGetVersion())
    return v // 1000, (v % 1000) // 10


def check_cubin_loads(nvcc_version: tuple[int, int], driver_version: tuple[int, int], *,
                      nvcc: str = "nvcc") -> None:
    """Refuse, before compiling, a cubin the driver would not load: one built by an nvcc of a newer CUDA
    major release than the driver's (a CUDA 13 cubin on a 12.x driver fails to load). Within one major
    release a cubin from a newer minor loads (CUDA's minor-version compatibility, NVIDIA's "CUDA
    Compatibility" guide), so that passes. PTX would not help: the driver's JIT refuses PTX of a newer
    CUDA too. The RuntimeError names both versions and the two fixes.

    Explained in: notebooks/08_cuda.
    Tested in: tests/kernels/cuda/test_cuda_toolkit.py.
    """
    for name, v in (("nvcc_version", nvcc_version), ("driver_version", driver_version)):
        if not (isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, int) for x in v)):
            raise TypeError(f"{name} must be a (major, minor) tuple of ints, got {v!r}")
    if nvcc_version[0] > driver_version[0]:
        n, d = "%d.%d" % nvcc_version, "%d.%d" % driver_version
        raise RuntimeError(
            f"backend='cuda' would compile the kernels with {nvcc} (CUDA {n}), but this GPU's driver runs "
            f"CUDA up to {d}: a cubin built by CUDA {nvcc_version[0]} does not load on a "
            f"{driver_version[0]}.x driver. Fix: put an nvcc of CUDA {driver_version[0]}.x first on PATH "
            f"(or set CUDA_PATH to that toolkit), or upgrade the driver to one for CUDA {n}")
