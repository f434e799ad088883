# rehearsal.py — run a chapter on a CPU as a reader's GPU would run it: flashlib's device facts set to
#   that GPU (a T4 by default), the kernels in Triton's interpreter.
# Changed from "the chapters run on the CPU that builds the book, and on a GPU only when one is lent":
#   a chapter's GPU branch makes choices the CPU never makes (which dtypes, which config table, whether
#   bfloat16 is refused, how many decode splits), and the first reader on a free Colab T4 met the one
#   that failed (chapter 7 looped over bfloat16, which flashlib refuses below sm_80). Under
#   FLASHLIB_REHEARSE=T4 (flashlib.hardware.rehearse) CPU tensors stand for the T4 in every such choice.
# Idea: a dress rehearsal; the CI-side twin of running a notebook under nbclient, as the GPU tier does.
# Limits: nothing is compiled, so whether a chosen config fits the GPU's shared memory and registers is
#   the compile matrix's to prove (tests/kernels/triton/test_triton_matrix.py), not the rehearsal's; a
#   cell that asks torch itself about CUDA (torch.cuda.is_available()) still hears the truth, False.
# Run: python -m flashlib.testing.rehearsal notebooks/07_triton.ipynb --gpu T4
"""Run a chapter's code cells on a CPU as on a given GPU (:func:`run_notebook`).

Explained in: notebooks/07_triton.
"""
from __future__ import annotations

import os
import pathlib
import re
import time
from unittest import mock

__all__ = ["RehearsalError", "run_notebook", "main"]


class RehearsalError(AssertionError):
    """A chapter's cell raised while a GPU was rehearsed: the cell, the GPU and the error, in one message.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/test_rehearsal.py.
    """


def _error_summary(exc) -> str:
    """The error's name and value, and the last lines of its traceback (nbclient's message is long)."""
    name, value = getattr(exc, "ename", type(exc).__name__), getattr(exc, "evalue", str(exc))
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in str(exc).splitlines()]   # no colours
    return f"{name}: {value}\n" + "\n".join([line for line in lines if line.strip()][-4:])


def run_notebook(path, gpu: str = "T4", *, skip=(), timeout: int = 900):
    """Execute the notebook at ``path`` in a fresh Jupyter kernel whose process rehearses ``gpu`` (one of
    :data:`flashlib.hardware.GPUS`): ``FLASHLIB_REHEARSE=gpu`` and ``TRITON_INTERPRET=1`` in its
    environment, this checkout first on its ``PYTHONPATH``. A code cell whose source contains any of the
    strings in ``skip`` is left out (emptied), e.g. cells that only read the compile report. Returns the
    executed notebook (nbformat) with ``metadata["rehearsal"]``: the GPU and the seconds taken.

    Raises :class:`RehearsalError` naming the notebook, the GPU, the cell and its error at the first cell
    that raises; ValueError for a GPU not in GPUS or a missing notebook; TypeError for a ``skip`` that is
    not a sequence of strings. Needs nbclient, nbformat and ipykernel.

    Explained in: notebooks/appendix_verification.
    Tested in: tests/test_rehearsal.py.
    """
    from .. import hardware
    hardware.get(gpu)                                    # ValueError listing the names
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"path must be a notebook file, got {str(path)!r} (not found)")
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"skip must be a sequence of strings, got {skip!r}")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            if any(s in cell.source for s in skip):
                cell.source = ""
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {hardware.REHEARSE_ENV: gpu, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    try:                     # the kernel process inherits env at its start; ours is restored on exit
        with mock.patch.dict(os.environ, env):
            NotebookClient(nb, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()
    except CellExecutionError as exc:
        where = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                      and any(o.get("output_type") == "error" for o in c.get("outputs", []))), "?")
        raise RehearsalError(f"{path.name}, rehearsing a {gpu} ({hardware.get(gpu).arch}) on a CPU: "
                             f"cell {where} raised {_error_summary(exc)}") from None
    nb.metadata["rehearsal"] = {"gpu": gpu, "seconds": round(time.perf_counter() - t0, 1)}
    return nb


def main(argv=None) -> int:
    """``python -m flashlib.testing.rehearsal NOTEBOOK... [--gpu T4]``: 0 when every notebook runs.

    Explained in: notebooks/07_triton.
    Tested in: tests/test_rehearsal.py.
    """
    import argparse

    from .. import hardware
    parser = argparse.ArgumentParser(prog="python -m flashlib.testing.rehearsal", description=__doc__)
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--gpu", default="T4", choices=sorted(hardware.GPUS))
    args = parser.parse_args(argv)
    failed = 0
    for p in args.notebooks:
        try:
            nb = run_notebook(p, args.gpu)
            print(f"{p}: ran as on a {args.gpu} in {nb.metadata['rehearsal']['seconds']} s")
        except RehearsalError as exc:
            failed += 1
            print(exc)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
