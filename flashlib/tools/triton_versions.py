"""Other Triton releases beside the installed one, each in its own folder, for cross-compiling with them.

A reader's Triton is whatever their torch brought (Colab: 3.2 to 3.6; torch 2.7: 3.3.x), not the one
this project pins, and the same kernel compiles differently on each (registers up to 25 % apart,
fp16 ``tl.dot`` on sm_75 failing on 3.3 only: :mod:`flashlib.kernels.triton.versions`). So the compile
report (:func:`flashlib.tools.compile_report.compile_report` with ``triton=``) and the version matrix
(tests/kernels/triton/test_triton_matrix.py) compile with each release of
:data:`flashlib.kernels.triton.versions.TESTED`: :func:`ensure` installs ``triton==<version>`` from the
package registry with ``pip install --no-deps --target`` into ``<cache>/triton/<version>``
(:func:`flashlib.tools.toolchain.cache_dir`), once, under a lock (parallel test workers wait for one
install) and atomically (a half-finished install is never seen). A child process then puts that folder
first on ``PYTHONPATH``: its ``import triton`` finds that release, with its own ptxas and cuobjdump
(``triton/backends/nvidia/bin``), beside the environment's torch. Only Triton's compiler runs there
(cross-compiling needs no GPU and no torch GPU build); nothing is launched.

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import importlib.metadata
import pathlib
import shutil
import subprocess
import sys

from . import toolchain

__all__ = ["installed_version", "folder", "ensure"]


def installed_version() -> str | None:
    """The version of the ``triton`` installed in this environment (read from its metadata, not
    imported), or None without one.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check(version) -> str:
    from ..kernels.triton import versions# pure Python: imports no triton
    if not isinstance(version, str):
        raise TypeError(f"version must be a str like '3.2.0', got {type(version).__name__} {version!r}")
    try:
        v = versions.parse(version)
    except ValueError:
        v = (0, 0, 0)
    if v[:2] < versions.MINIMUM or ".".join(map(str, v)) != version:
        raise ValueError(f"version must be a full Triton release like '3.2.0', at least "
                         f"{versions.MINIMUM[0]}.{versions.MINIMUM[1]}, got {version!r}")
    return version


def folder(version: str) -> pathlib.Path:
    """Where :func:`ensure` installs ``triton==version``: ``<cache>/triton/<version>``.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    return toolchain.cache_dir("triton") / _check(version)


def ensure(version: str) -> pathlib.Path | None:
    """The folder holding the ``triton`` package of release ``version``, installed there if it is not
    yet (``pip install --no-deps --target``); None for the installed version itself (no folder needed:
    the child process imports the environment's own).

    RuntimeError quoting pip's errors if the install fails (no network, no wheel for this Python).

    Explained in: notebooks/appendix_verification.
    Tested in: tests/tools/test_compile_report.py.
    """
    version = _check(version)
    if version == installed_version():
        return None
    path = folder(version)
    if (path / "triton" / "__init__.py").exists():
        return path

    def install(tmp: pathlib.Path) -> None:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet",
               "--disable-pip-version-check", "--target", str(tmp), f"triton=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / "triton" / "__init__.py").exists():
            raise RuntimeError(f"installing triton=={version} into {path} failed (exit {proc.returncode}): "
                               f"`{' '.join(cmd)}`\n{proc.stderr[-2000:]}")

    with toolchain.locked(path.with_name(f"{version}.lock")):
        if not (path / "triton" / "__init__.py").exists():
            if path.exists():                 # an old, broken folder: build_atomically replaces it
                shutil.rmtree(path, ignore_errors=True)
            toolchain.build_atomically(path, install)
    return path

