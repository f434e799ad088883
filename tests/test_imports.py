"""flashlib's import graph has no cycle, and importing flashlib imports neither torch nor triton.

Every ``import`` / ``from ... import`` of a flashlib module counts — at module level and inside
functions (an import inside a function still ties the two modules together) — with relative imports
resolved. ``from package import name`` is an edge to the submodule ``package.name`` when there is one,
else to ``package`` itself.
"""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

from conftest import ROOT


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """``{module: the modules of the package it imports}`` for every ``.py`` under ``package_dir``."""
    root = package_dir.parent
    files = {module_name(p, root): p for p in sorted(package_dir.rglob("*.py"))}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:                           # from . / .. / .x import ...
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - (node.level - 1)] + [node.module or ""]).strip(".")
                else:
                    base = node.module
                targets += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                            for alias in node.names]
        edges = set()
        for target in targets:
            while target and target not in files:        # flashlib.x.y.attr -> flashlib.x.y; torch -> ""
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None when there is none (depth-first search)."""
    state, path = {}, []                                  # state: 1 on the current path, 2 finished

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_cycles_and_only_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None    # a diamond
    assert find_cycle({"a": {"b"}, "b": {"b"}}) == ["b", "b"]
    assert find_cycle({"x": {"a"}, "a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def test_import_graph_counts_imports_in_functions_and_resolves_relative_ones(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("import os\n\ndef f():\n    from .sub import b\n    return b\n")
    (pkg / "sub" / "__init__.py").write_text("X = 1\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import a\n    from ..sub import X\n"
                                      "    import pkg.a.f\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(),
                     "pkg.sub.b": {"pkg.a", "pkg.sub"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]


def test_flashlib_has_no_import_cycle():
    graph = import_graph(ROOT / "flashlib")
    assert {"flashlib.api", "flashlib._ops", "flashlib.backends", "flashlib.validation"} <= set(graph)
    assert "flashlib.backends" in graph["flashlib.api"] and "flashlib.validation" in graph["flashlib.api"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_importing_flashlib_imports_neither_torch_nor_triton():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", "import sys, flashlib; "
                        "print('torch' in sys.modules, 'triton' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]
