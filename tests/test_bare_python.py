"""The suite runs on a Python that has only torch, triton, pytest and numpy (and what they depend on).

GPU machines often cannot install anything: ``make test-gpu PY=python3`` runs the suite on whatever
Python is there. A test that needs an optional module (yaml, matplotlib, tqdm, IPython, hypothesis,
nbval, ...) must then skip with the reason (conftest's ``need_module``/``require_module``), never error at
collection or fail. This file rebuilds such a Python inside the test environment: a child pytest runs
with a ``sitecustomize`` that hides every installed module torch, triton, pytest, numpy and flashlib do
not need (found from the installed packages' own requirements, so an extra added to pyproject.toml later
is hidden too), with no plugin autoloaded (a bare Python has none), and with FLASHLIB_REQUIRE_ALL unset
(a reader's machine: skips allowed). It collects the whole suite, then runs the files that import
optional modules inside their tests.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

from packaging.requirements import Requirement        # pytest's own dependency: always here
from packaging.utils import canonicalize_name

from conftest import ROOT, require

KEEP = ("torch", "triton", "pytest", "numpy", "flashlib")
# Files whose tests import an optional module while running (bench.run: tqdm; bench.plot: matplotlib;
# display.crisp_figures: IPython), so collecting them is not enough.
RUN_FILES = ("tests/tools/test_bench.py", "tests/tools/test_bench_small.py", "tests/test_display.py")
# Left out: a CPU-only test (it skips where a GPU is) whose `flashlib bench` child builds the whole compile
# report when the kernels changed (minutes on two cores), and imports no optional module.
SLOW = "tests/tools/test_bench.py::test_bench_without_gpu_says_so_and_prints_the_compile_summary"

# Imported at the child's start-up (from PYTHONPATH): every import finder is wrapped so that hidden
# modules and their distributions' metadata are not found, exactly as if they were not installed
# (importlib.util.find_spec returns None, import raises ModuleNotFoundError).
SITECUSTOMIZE = '''
import os, re, sys
_MODULES = frozenset(os.environ["FLASHLIB_TEST_HIDE_MODULES"].split(","))
_DISTS = frozenset(os.environ["FLASHLIB_TEST_HIDE_DISTS"].split(","))


class _Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        find = getattr(self.inner, "find_spec", None)
        return None if name.partition(".")[0] in _MODULES or find is None else find(name, path, target)

    def find_distributions(self, *args, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        return [d for d in (find(*args, **kwargs) if find else ())
                if re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower() not in _DISTS]

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
'''


def kept_distributions(roots=KEEP) -> set[str]:
    """``roots`` and everything they require (markers evaluated here, no extras), as canonical names."""
    keep, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue                                    # e.g. nvidia-* wheels, required by CUDA torch only
        keep.add(name)
        todo += [canonicalize_name(r.name) for r in map(Requirement, requires)
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
    return keep


def hidden() -> tuple[list[str], list[str]]:
    """(top-level modules, distributions) installed here that a bare Python would not have."""
    keep = kept_distributions()
    modules = sorted(m for m, dists in importlib.metadata.packages_distributions().items()
                     if m.isidentifier() and m not in sys.stdlib_module_names
                     and not any(canonicalize_name(d) in keep for d in dists))
    dists = sorted({canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()} - keep)
    return modules, dists


def bare_run(tmp_path, *args, timeout=600):
    """``python -m pytest *args`` from the repository root in the bare Python described above."""
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLASHLIB_REQUIRE_ALL", "PYTEST_ADDOPTS") and not k.startswith("PYTEST_XDIST")}
    for var, names in zip(("FLASHLIB_TEST_HIDE_MODULES", "FLASHLIB_TEST_HIDE_DISTS"), hidden()):
        # already in a bare Python (this file run by the child): what it hides stays hidden
        env[var] = ",".join(sorted({*names, *filter(None, env.get(var, "").split(","))}))
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), *filter(None, [env.get("PYTHONPATH")])]),
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def test_the_bare_python_hides_the_optional_modules_and_keeps_the_four(tmp_path):
    """The optional modules the tests and chapters use, those installed here, are hidden in the child
    (found nowhere, their metadata too); torch, triton, pytest and numpy are still found."""
    optional = ["yaml", "matplotlib", "tqdm", "IPython", "nbval", "nbclient", "nbformat", "hypothesis",
                "transformers", "cupy", "jupyter_book", "pandas"]
    here = [m for m in optional if importlib.util.find_spec(m) is not None]
    require({"yaml", "matplotlib", "tqdm", "IPython", "hypothesis"} <= set(here),
            "the dev extra is not installed: nothing here to hide")
    probe = ("import importlib.util as u, importlib.metadata as md, sys\n"
             f"gone = [m for m in {here!r} if u.find_spec(m) is None]\n"
             "kept = [m for m in ('torch', 'triton', 'pytest', 'numpy') if u.find_spec(m) is not None]\n"
             "try:\n    md.version('matplotlib'); meta = 'found'\n"
             "except md.PackageNotFoundError:\n    meta = 'hidden'\n"
             "try:\n    import yaml; imp = 'imported'\nexcept ModuleNotFoundError:\n    imp = 'refused'\n"
             "print(gone, kept, meta, imp)")
    r = bare_run(tmp_path, "-c", probe)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{here} ['torch', 'triton', 'pytest', 'numpy'] hidden refused"


def test_the_whole_suite_collects_in_a_bare_python(tmp_path):
    r = bare_run(tmp_path, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests")
    tail, last = r.stdout[-4000:] + r.stderr[-2000:], (r.stdout.splitlines() or [""])[-1]
    assert r.returncode == 0 and " error" not in last, tail
    assert int(last.split()[0]) > 100, tail                                 # "813 tests collected in 4s"


def test_tests_that_import_optional_modules_while_running_skip_with_the_reason(tmp_path):
    r = bare_run(tmp_path, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                 "--basetemp", str(tmp_path / "basetemp"), "--deselect", SLOW, *RUN_FILES)
    tail, last = r.stdout[-6000:] + r.stderr[-2000:], (r.stdout.splitlines() or [""])[-1]
    assert r.returncode == 0, tail                                           # no failure, no error
    assert "is not installed" in r.stdout and " passed" in last, tail
