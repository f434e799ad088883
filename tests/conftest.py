"""Shared test helpers: skip-or-fail for missing tools, and the device Triton runs on.

On a reader's machine a test that needs a missing tool (ptxas, nvcc, a Python package) is skipped with
the reason. CI sets ``FLASHLIB_REQUIRE_ALL=1``: there the same test FAILS, so that nothing is silently
not tested. Every test that needs a tool goes through :func:`require` (or :func:`require_tool`).

:data:`DEVICE` is where tests put the tensors that reach Triton's kernels (``backend="triton"`` or
``"auto"``, flashlib.auto, models, torch.compile of flashlib's ops, bench): "cuda" when
flashlib.kernels.triton compiles (a GPU is present), "cpu" when it interprets. The same suite thus runs the
interpreter on a CPU machine and the compiled kernels on a GPU one (``from conftest import DEVICE``).
"""
from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]     # the repository
REQUIRE_ALL = os.environ.get("FLASHLIB_REQUIRE_ALL", "") not in ("", "0")

# Triton's mode (interpreter or compiler) is fixed by its first import in a process. torch.compile
# imports triton too; let flashlib choose first in every test process (interpreter when no GPU).
if importlib.util.find_spec("triton") is not None:
    import flashlib.kernels.triton  # noqa: E402,F401
    DEVICE = "cpu" if flashlib.kernels.triton.INTERPRET else "cuda"
else:
    DEVICE = "cpu"      # no triton: only the reference backend runs, on CPU tensors


def require(available: bool, reason: str) -> None:
    """Skip the calling test with ``reason`` if not ``available``; fail it under FLASHLIB_REQUIRE_ALL."""
    if available:
        return
    if REQUIRE_ALL:
        pytest.fail(f"{reason} (FLASHLIB_REQUIRE_ALL is set: a missing tool fails the test)", pytrace=False)
    pytest.skip(reason)


def require_tool(name: str) -> str:
    """The path of tool ``name`` where flashlib itself finds it (flashlib.tools.toolchain.find_tool: PATH,
    the CUDA toolkit's folders, the triton wheel), else skip/fail via :func:`require`."""
    from flashlib.tools.toolchain import find_tool
    path = find_tool(name)
    require(path is not None, f"{name} not found (looked where flashlib.tools.toolchain.find_tool looks)")
    return path


def need_module(name: str) -> None:
    """Call at the top of a test module that imports ``name`` (e.g. hypothesis) before importing it: the
    module is skipped, with the reason, where ``name`` is missing (a GPU machine may have only torch,
    triton and pytest: ``make test-gpu PY=python3``); under FLASHLIB_REQUIRE_ALL it fails to collect."""
    if importlib.util.find_spec(name) is not None:
        return
    reason = f"Python module {name!r} is not installed, and this test module needs it"
    if REQUIRE_ALL:
        raise ImportError(f"{reason} (FLASHLIB_REQUIRE_ALL is set: a missing tool fails)")
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str) -> None:
    """Skip/fail via :func:`require` unless Python module ``name`` is installed. It is found, not
    imported: importing triton here would fix its interpreter/compiler mode for the whole worker."""
    require(importlib.util.find_spec(name) is not None, f"Python module {name!r} is not installed")


def run_cli(*args, timeout: int = 900):
    """``python -m flashlib *args`` in a fresh interpreter from the repository root, without
    TRITON_INTERPRET (the command chooses Triton's mode itself, as on a reader's machine)."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "flashlib", *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def require_pinned_triton() -> None:
    """Skip, with the reason, a test of a fact about the Triton version the test environment pins
    (constraints.txt): a GPU machine's own Triton (``make test-gpu PY=python3``) may compile differently.
    Where the pin is installed (CI, ``make test``) the test runs."""
    import importlib.metadata
    import re
    pin = re.search(r"^triton==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    have = importlib.metadata.version("triton")
    if pin is None or have != pin.group(1):
        pytest.skip(f"a fact about triton {pin.group(1) if pin else '?'} (constraints.txt); this is {have}")
