"""What a puzzle is, and the checker that runs a reader's function on it and says right or wrong.

A :class:`Puzzle` holds a spec, the signature of the function the reader writes, and the cases it is
checked on: small, adversarial inputs (lengths that are multiples of no block, Nq != Nk both ways, N = 1,
odd head dims, causal rows that see no key, scores large enough to overflow ``exp``), each with what the
float64 oracle expects. :meth:`Puzzle.check` returns a :class:`Result`, one line: correct on all cases,
wrong on the first failing one (and where, by how much), or not attempted yet (the stub still raises
``NotImplementedError``). A reader's mistake never raises out of the checker: a wrong shape, a missing
``return``, NaN or an exception of their own is reported in that line, and so is a function that takes
other arguments than the signature's (before any case runs, naming ``fn`` and both signatures). Only
what cannot be the reader's function at all (not callable) is a TypeError naming ``fn``.

Explained in: notebooks/01_naive_attention.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["Puzzle", "Result"]

CORRECT, WRONG, NOT_ATTEMPTED = "correct", "wrong", "not attempted"


class WrongAnswer(Exception):
    """Raised by a puzzle's ``call`` when the reader's function gives a wrong answer midway (a fold of
    steps whose intermediate output has the wrong shape): reported as wrong on that case, not raised.

    Explained in: notebooks/02_online_softmax.
    Tested in: tests/puzzles/test_puzzles.py.
    """


@dataclass(frozen=True)
class Case:
    """One input of a puzzle: ``args`` for the reader's function and what it must give.

    ``expected`` is an array (or a tuple of them, one per output), an exception class the function must
    raise, or a callable ``verify(outputs) -> message or None`` for answers that are not unique.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    label: str
    args: tuple
    expected: Any
    why: str = ""                  # for an expected exception: the reason, shown when none is raised


@dataclass(frozen=True)
class Result:
    """The checker's verdict; prints as one line, and is true only when every case is right.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    puzzle: str
    status: str                    # "correct", "wrong" or "not attempted"
    cases: int                     # how many cases were checked
    message: str = ""

    def __bool__(self):
        return self.status == CORRECT

    def __str__(self):
        if self.status == CORRECT:
            return f"✔ {self.puzzle}: correct on {self.cases} cases"
        if self.status == NOT_ATTEMPTED:
            return f"… {self.puzzle}: not attempted yet ({self.message})"
        return f"✘ {self.puzzle}: {self.message}"

    __repr__ = __str__


@dataclass(frozen=True)
class Puzzle:
    """A spec, the signature of the function the reader writes, and the cases it is checked on.

    ``cases()`` builds the cases (deterministic: seeded); ``call(fn, case)`` runs the reader's function on
    one case and returns its outputs (default: ``fn(*case.args)``); ``accepts(fn)`` raises TypeError for
    what cannot be the reader's function. ``solution`` names the reference solution as ``module:name``.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    name: str
    chapter: str                   # "notebooks/01_naive_attention"
    title: str
    spec: str                      # one paragraph, Markdown without math (it is shown as a cell output)
    signature: str
    outputs: tuple[str, ...]       # the names of the outputs, as the messages call them
    cases: Callable[[], list]
    solution_ref: str
    call: Callable | None = None
    accepts: Callable | None = None
    atol: float = 1e-6
    rtol: float = 1e-6
    not_attempted_hint: str = "the stub still raises NotImplementedError: write its body and run the cell"

    @property
    def solution(self):
        """The reference solution (imported on first use: the Triton ones import triton)."""
        module, name = self.solution_ref.split(":")
        return getattr(importlib.import_module(module), name)

    def check(self, fn) -> Result:
        """Run ``fn`` on every case and compare with the oracle; the first wrong case is reported.

        Explained in: notebooks/01_naive_attention.
        Tested in: tests/puzzles/test_puzzles.py.
        """
        if self.accepts is not None:
            self.accepts(fn)
        elif not callable(fn):
            raise TypeError(f"fn must be a function {self.signature}, got {type(fn).__name__} {fn!r:.60}")
        cases = self.cases()
        if self.accepts is None and (message := _arguments_problem(fn, self.signature)):
            return Result(self.name, WRONG, len(cases), message)
        for case in cases:
            try:
                with np.errstate(all="ignore"):          # the reader's overflow is reported, not warned
                    got = (self.call or _plain_call)(fn, case)
            except WrongAnswer as exc:
                return Result(self.name, WRONG, len(cases), f"wrong on case {case.label}: {exc}")
            except Exception as exc:                     # noqa: BLE001 - the reader's error, reported
                if _not_implemented(exc):
                    return Result(self.name, NOT_ATTEMPTED, len(cases), _reason(exc, self.not_attempted_hint))
                if isinstance(case.expected, type) and isinstance(exc, case.expected):
                    continue
                return Result(self.name, WRONG, len(cases),
                              f"raised {type(exc).__name__}: {_short(exc)} on case {case.label}")
            message = self._mismatch(got, case)
            if message:
                return Result(self.name, WRONG, len(cases), f"wrong on case {case.label}: {message}")
        return Result(self.name, CORRECT, len(cases))

    def _mismatch(self, got, case):
        if isinstance(case.expected, type):              # an exception was expected, none came
            return f"expected a {case.expected.__name__} ({case.why}), but it returned {got!r:.80}"
        if callable(case.expected):
            return case.expected(got)
        outputs, message = split_outputs(got, self.outputs)
        if message:
            return message
        expected = case.expected if len(self.outputs) > 1 else (case.expected,)
        for name, a, e in zip(self.outputs, outputs, expected):
            message = mismatch(a, e, name, self.atol, self.rtol)
            if message:
                return message
        return None

    def _heading(self) -> str:
        """The title as a sentence: a full stop added unless it ends in one already (or in ? or !)."""
        return self.title if self.title.endswith((".", "?", "!")) else self.title + "."

    def _repr_markdown_(self):
        return f"**{self._heading()}** {self.spec}\n\nWrite `{self.signature}`."

    def __repr__(self):                  # a terminal's form: wrapped at the book's code width
        import textwrap
        return "\n".join([textwrap.fill(f"{self._heading()} {self.spec}", 80),
                          textwrap.fill(f"Write {self.signature}.", 80, subsequent_indent="    ")])


def _arguments_problem(fn, signature: str) -> str | None:
    """Why ``fn`` cannot be called with the parameters ``signature`` names ("merge_states(m_a, l_a, m_b,
    l_b) -> (m, l)"): a reader's def with one parameter too few or too many; None when it can, or
    when Python cannot read its signature (some builtins: the cases will tell)."""
    m = re.match(r"\s*\w+\((.*?)\)", signature)
    if m is None:
        return None
    params = [p.strip() for p in m[1].split(",") if p.strip()]
    try:
        inspect.signature(fn).bind(*params)
    except TypeError as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        try:
            theirs = f"{name}{inspect.signature(fn)}"
        except (TypeError, ValueError):
            theirs = name
        return f"fn must take the arguments of {signature.split(' ->')[0]}, got {theirs} ({e})"
    except ValueError:                                   # no signature to read: the cases will tell
        return None
    return None


def _plain_call(fn, case):
    return fn(*copy.deepcopy(case.args))                 # a copy: the reader may change the inputs


def _not_implemented(exc) -> bool:
    """True for NotImplementedError, also when wrapped (Triton's interpreter wraps a kernel's errors)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _reason(exc, hint):
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc) if isinstance(exc, NotImplementedError) and str(exc) else hint


def _short(exc, limit=160):
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def split_outputs(got, names):
    """``(outputs, None)``: the reader's return value as one value per name; or ``(None, message)``.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    if len(names) == 1:
        return (got,), None
    want = f"a tuple of {len(names)} values ({', '.join(names)})"
    if not isinstance(got, (tuple, list)):
        return None, f"returned {type(got).__name__}, expected {want}"
    if len(got) != len(names):
        return None, f"returned {len(got)} values, expected {want}"
    return tuple(got), None


def as_numbers(x, name):
    """``(array, None)`` for an array-like of numbers (NumPy, torch, lists, scalars); else ``(None, why)``.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    if x is None:
        return None, f"{name} is None (does the function return it?)"
    if type(x).__module__.startswith("torch"):
        x = x.detach().to("cpu").numpy()
    try:
        a = np.asarray(x)
    except (ValueError, TypeError):
        return None, f"{name} is a {type(x).__name__} that is not an array of numbers"
    if a.dtype.kind not in "biuf":
        return None, f"{name} is a {type(x).__name__} of dtype {a.dtype}, expected numbers"
    return a, None


def where(idx) -> str:
    """``row 2`` / ``row 2, column 5`` / ``index (0, 2, 5)``: an element's place, as messages say it."""
    idx = tuple(int(i) for i in idx)
    if len(idx) == 1:
        return f"row {idx[0]}"
    if len(idx) == 2:
        return f"row {idx[0]}, column {idx[1]}"
    return f"index {idx}"


def _at(idx):
    return f" at {where(idx)}" if idx else ""


def mismatch(actual, expected, name="value", atol=1e-6, rtol=1e-6):
    """Why ``actual`` is not ``expected`` in one sentence, or None when it is (within atol + rtol*|e|).

    Masks (bool) and integers must match exactly and have that kind; floats must have no NaN, the same
    infinities (``lse = -inf`` for a row that sees nothing) and be within the tolerance elsewhere.

    Explained in: notebooks/01_naive_attention.
    Tested in: tests/puzzles/test_puzzles.py.
    """
    for tol_name, tol in (("atol", atol), ("rtol", rtol)):
        if isinstance(tol, bool) or not isinstance(tol, numbers.Real):
            raise TypeError(f"{tol_name} must be a real number >= 0, got {type(tol).__name__} {tol!r}")
        if not (math.isfinite(tol) and tol >= 0):
            raise ValueError(f"{tol_name} must be a finite real number >= 0, got {tol!r}")
    a, message = as_numbers(actual, name)
    if message:
        return message
    e = np.asarray(expected)
    if a.shape != e.shape:
        return f"{name} has shape {a.shape}, expected {e.shape}"
    if e.dtype.kind in "biu":
        kinds = {"b": "bool", "i": "an integer dtype", "u": "an integer dtype"}
        if a.dtype.kind != e.dtype.kind and not (e.dtype.kind in "iu" and a.dtype.kind in "iu"):
            return f"{name} has dtype {a.dtype}, expected {kinds[e.dtype.kind]}"
        bad = a != e
        if not bad.any():
            return None
        idx = tuple(np.argwhere(bad)[0]) if bad.ndim else ()
        count = f" ({int(bad.sum())} of {e.size} entries wrong)" if idx else ""
        return f"{name} is wrong{_at(idx)}: expected {e[idx].item()!r}, got {a[idx].item()!r}{count}"
    if a.dtype.kind == "b":
        return f"{name} has dtype bool, expected floating point"
    with np.errstate(all="ignore"):
        return _float_mismatch(a.astype(np.float64), e.astype(np.float64), name, atol, rtol)


def _float_mismatch(a, e, name, atol, rtol):
    nan = np.isnan(a) & ~np.isnan(e)
    if nan.any():
        idx = tuple(np.argwhere(nan)[0])
        return f"{name} is NaN{_at(idx)} (expected {e[idx]:.6g}; {int(nan.sum())} NaN in all)"
    inf = (np.isinf(a) | np.isinf(e)) & (a != e)
    if inf.any():
        idx = tuple(np.argwhere(inf)[0])
        return f"{name}{_at(idx)}: expected {e[idx]:.6g}, got {a[idx]:.6g}"
    finite = np.isfinite(e)
    err = np.where(finite, np.abs(a - e), 0.0)
    excess = err - (atol + rtol * np.abs(np.where(finite, e, 0.0)))
    if (excess > 0).any():
        idx = tuple(np.unravel_index(np.argmax(err), err.shape))
        return f"{name}: max error {err[idx]:.3g}{_at(idx)} (expected {e[idx]:.6g}, got {a[idx]:.6g})"
    return None
