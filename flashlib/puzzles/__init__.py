"""Puzzles that check themselves: a spec, a stub the reader fills in, a checker against the oracle.

Chapters 1-7, 9 and 10 end with two to four puzzles each. In a chapter::

    from flashlib import puzzles
    puzzles.get("merge_states")                  # shows the spec and the signature to write

    def merge_states(m_a, l_a, m_b, l_b):
        raise NotImplementedError                # the reader's code goes here

    puzzles.check("merge_states", merge_states)  # "... not attempted yet", "✘ ... wrong on case ...", "✔ ..."

The reference solutions are in :mod:`flashlib.puzzles.solutions` (NumPy, chapters 1-6),
:mod:`flashlib.puzzles.triton_solutions` (Triton kernels, chapter 7),
:mod:`flashlib.puzzles.variant_solutions` (NumPy, chapter 9) and
:mod:`flashlib.puzzles.serving_solutions` (NumPy, chapter 10); the chapters hide them in a dropdown.
The cases are in :mod:`flashlib.puzzles.ladder_puzzles`, :mod:`flashlib.puzzles.triton_puzzles`,
:mod:`flashlib.puzzles.variant_puzzles` and :mod:`flashlib.puzzles.serving_puzzles`; the checker is
:mod:`flashlib.puzzles.core`.

Explained in: notebooks/01_naive_attention (and the Puzzles section of chapters 1 to 7, 9 and 10).
"""
from __future__ import annotations

from . import ladder_puzzles, serving_puzzles, triton_puzzles, variant_puzzles
from .core import Puzzle, Result

__all__ = ["PUZZLES", "get", "check", "Puzzle", "Result"]

PUZZLES: dict[str, Puzzle] = {p.name: p for p in ladder_puzzles.PUZZLES + triton_puzzles.PUZZLES
                               + variant_puzzles.PUZZLES + serving_puzzles.PUZZLES}


def get(name: str) -> Puzzle:
    """The puzzle called ``name``; shown in a notebook, it renders its spec and signature.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a puzzle's name (str), got {type(name).__name__}")
    if name not in PUZZLES:
        raise ValueError(f"name must be one of {sorted(PUZZLES)}, got {name!r}")
    return PUZZLES[name]


def check(name: str, fn) -> Result:
    """Check the reader's ``fn`` on every case of puzzle ``name``; the result prints as one line.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    return get(name).check(fn)

