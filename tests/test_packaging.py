"""A wheel built from this repository holds every file flashlib reads at run time.

``pip install -e .`` reads the files from the checkout, so nothing else notices a file that
``[tool.setuptools.package-data]`` forgets; a reader's ``pip install flashlib`` (or git+https) then
fails far from the cause: the v3 forward and the CUDA backward could not compile
(``fa2_fwd_v3_mma.cu:45: fatal error: ptx.h: No such file or directory``). So a real wheel is built here
(``pip wheel --no-build-isolation``, from a fresh copy of the sources: a ``build/`` folder left by an
earlier build would ship stale files), and checked three ways:

* every ``#include`` the CUDA sources reach, followed transitively from the sources themselves (a header
  added later is found with no list to update), is a file under ``flashlib/`` and is in the wheel;
* every file under ``flashlib/`` is in the wheel (the Python code opens some by path: the CUDA sources,
  the emulator's files, the GPT chapter's text);
* from the unpacked wheel, flashlib's own emulator build code writes each kernel's translation unit and
  g++ preprocesses it with the emulator's include flags: every include resolves inside the wheel.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import ROOT, require_module, require_tool
from flashlib.kernels.cuda.build import includes

PACKAGE = ROOT / "flashlib"
CUDA = PACKAGE / "kernels" / "cuda"
# Where an #include is looked up besides the including file's folder: the -I folders of the emulator
# (flashlib.kernels.cuda.build.emulator_binary: include/, csrc/) and of NVRTC/nvcc (csrc/).
SEARCH = (CUDA / "include", CUDA / "csrc")


def include_closure(roots) -> set[pathlib.Path]:
    """The files ``roots`` include, followed transitively, that exist in the repository.

    ``#include "x"`` is looked up in the including file's folder, then in :data:`SEARCH`;
    ``#include <x>`` in :data:`SEARCH` only. A name found in neither is a system or CUDA toolkit header
    (``<stdint.h>``, ``<cuda_fp16.h>`` on a GPU) and is not flashlib's to ship; a quoted name found
    nowhere fails the test (it could only be a file the repository lacks)."""
    seen, todo = set(), [pathlib.Path(r).resolve() for r in roots]
    while todo:
        path = todo.pop()
        for name, quoted in includes(path.read_text()):            # (name, True for "name")
            dirs = ((path.parent,) if quoted else ()) + SEARCH
            found = [d / name for d in dirs if (d / name).is_file()]
            assert found or not quoted, f'{path}: #include "{name}" is found in none of {dirs}'
            if found and found[0].resolve() not in seen:
                seen.add(found[0].resolve())
                todo.append(found[0].resolve())
    return seen


def package_files() -> set[str]:
    """Every file under flashlib/, as wheel paths (``flashlib/...``), bytecode caches left out."""
    return {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """A wheel built by pip from a copy of pyproject.toml, README.md and flashlib/."""
    require_module("pip")                    # a bare Python (venv --without-pip) has none
    require_module("setuptools")             # the build backend; with --no-build-isolation, the venv's own
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(PACKAGE, src / "flashlib", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(tmp / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    (found,) = (tmp / "dist").glob("flashlib-*.whl")
    return found


def test_include_closure_is_computed_from_the_sources():
    """The closure is not trivially empty: v3 includes ptx.h, and the emulator's <cuda_fp16.h> includes
    emulator.h (each found through the rules above, not listed)."""
    got = include_closure(CUDA.glob("csrc/*.cu"))
    assert {CUDA / "csrc" / "ptx.h", CUDA / "include" / "cuda_fp16.h", CUDA / "emulator.h"} <= got


def test_wheel_ships_every_header_the_cuda_sources_include(wheel):
    roots = sorted(CUDA.rglob("*.cu")) + sorted(CUDA.rglob("*.cpp"))
    assert roots, f"no CUDA source found under {CUDA}"
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = include_closure(roots) | {p.resolve() for p in roots}
    outside = sorted(str(p) for p in needed if not p.is_relative_to(PACKAGE.resolve()))
    assert not outside, f"CUDA sources include files outside flashlib/, which no wheel ships: {outside}"
    missing = sorted(p.relative_to(ROOT.resolve()).as_posix() for p in needed
                     if p.relative_to(ROOT.resolve()).as_posix() not in names)
    assert not missing, (f"the wheel lacks files the CUDA build reads: {missing}; add them to "
                         f"[tool.setuptools.package-data] in pyproject.toml")


def test_wheel_ships_every_file_under_flashlib(wheel):
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("flashlib/")}
    missing = sorted(package_files() - names)
    assert not missing, (f"the wheel lacks files under flashlib/: {missing}; add them to "
                         f"[tool.setuptools.package-data] in pyproject.toml (or a package's __init__.py)")


# Run in the unpacked wheel: flashlib's own code writes each kernel's emulator translation unit (the text
# g++ compiles), then g++ -E resolves its includes with the -I flags emulator_binary passes.
_PREPROCESS = r"""
import pathlib, subprocess, sys
import flashlib
from flashlib.kernels.cuda import build
assert pathlib.Path(flashlib.__file__).is_relative_to(sys.argv[1]), flashlib.__file__
for cu in sorted(build.CSRC.glob("*.cu")):
    build.local_includes(cu.read_text())              # part of every cache key: reads the included files
    tu = pathlib.Path(sys.argv[2]) / (cu.stem + ".cpp")
    tu.write_text(build.harness_text(cu.read_text(), str(cu)))
    proc = subprocess.run([sys.argv[3], "-E", "-std=c++20", f"-I{build.EMU_DIR / 'include'}", f"-I{build.CSRC}",
                           str(tu), "-o", "/dev/null"], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{cu.name}: {proc.stderr[-2000:]}")
build._emulator_files_text()
print("ok", len(list(build.CSRC.glob("*.cu"))))
"""


def test_kernels_preprocess_from_the_installed_wheel(wheel, tmp_path):
    """The bug as a reader met it: from an installed (not editable) flashlib, every kernel's includes
    resolve. Before ptx.h was shipped: 'fa2_fwd_v3_mma.cu: ... fatal error: ptx.h: No such file'."""
    gxx = require_tool("g++")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(site)                     # before the venv's editable install of the checkout
    proc = subprocess.run([sys.executable, "-c", _PREPROCESS, str(site), str(tmp_path), gxx],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.split() == ["ok", str(len(list((CUDA / "csrc").glob("*.cu"))))]
