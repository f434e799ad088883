"""GPU tier: every chapter runs top to bottom on this GPU, as a Colab reader runs it.

Chapters that use kernels put their tensors on the GPU when there is one (and interpret on a CPU);
the CPU suite checks their committed outputs with nbval, here we only need each to run without an
error. Needs nbclient and ipykernel, which GPU machines often lack: the test then skips with the
reason (tests/conftest.py's require_module; FLASHLIB_REQUIRE_ALL=1, which make test-gpu sets, makes that
a failure).
"""
from __future__ import annotations

import os
import pathlib

import pytest
from conftest import require_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_chapters():
    assert len(NOTEBOOKS) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_chapter_runs_top_to_bottom_on_the_gpu(path, monkeypatch):
    for module in ("nbclient", "nbformat", "ipykernel"):
        require_module(module)
    import nbformat
    from nbclient import NotebookClient
    # The kernel imports this checkout's flashlib (the chapters' install cell then does nothing).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
