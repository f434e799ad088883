"""Every pointer between the library, its tests and its chapters leads somewhere.

Each public function or class of flashlib (a name in its module's ``__all__``, defined there) says where it
is explained ("Explained in: notebooks/NN_name", or a page of book/) and where it is tested
("Tested in: tests/....py"). Here every such pointer must resolve: the file exists and mentions the name.
Chapters use only public modules (no ``flashlib._private`` imports), and nothing points at files readers do
not have.
"""
from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import re

import pytest

import flashlib
from conftest import ROOT, need_module

need_module("matplotlib")  # every public module is imported below, flashlib.figures among them

_EXPLAINED = re.compile(r"Explained in:(.*?)(?:\n\s*\n|Tested in:|$)", re.S)
_TESTED = re.compile(r"Tested in:(.*?)(?:\n\s*\n|Explained in:|$)", re.S)
_CHAPTER = re.compile(r"\b((?:notebooks|book)/[\w.-]+?)(?:\.ipynb|\.md)?(?=[\s,.;:)]|$)")
_TEST_FILE = re.compile(r"\b(tests/[\w/]+\.py)\b")


def _public_objects():
    """(module name, name, object) for every function and class a flashlib module exports."""
    found = []
    for info in pkgutil.walk_packages(flashlib.__path__, "flashlib."):
        if info.name in ("flashlib.__main__", "flashlib.auto.on") or any(
                part.startswith("_") for part in info.name.split(".")):
            continue       # the command line, importing auto.on routes SDPA for good, private modules
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == module.__name__:
                found.append((module.__name__, name, obj))
    return found


PUBLIC = _public_objects()


def _chapter_file(pointer: str):
    for suffix in ("", ".ipynb", ".md"):
        path = ROOT / (pointer + suffix)
        if path.is_file():
            return path
    return None


def chapter_pointers(doc: str) -> list[str]:
    """The chapters named after "Explained in:" in ``doc``."""
    return [c for part in _EXPLAINED.findall(doc) for c in _CHAPTER.findall(part)]


def test_pointers(doc: str) -> list[str]:
    """The test files named after "Tested in:" in ``doc``."""
    return [t for part in _TESTED.findall(doc) for t in _TEST_FILE.findall(part)]


test_pointers.__test__ = False      # a helper, not a test


def test_the_parsers_read_pointers_and_find_none_where_there_are_none():
    doc = """Something.

    Explained in: notebooks/04_flashattention2 and notebooks/05_backward.
    Tested in: tests/ladder/test_fa2.py, tests/test_api.py.
    """
    assert chapter_pointers(doc) == ["notebooks/04_flashattention2", "notebooks/05_backward"]
    assert test_pointers(doc) == ["tests/ladder/test_fa2.py", "tests/test_api.py"]
    assert chapter_pointers("Explained elsewhere.") == [] and test_pointers("no tests") == []


def test_there_are_public_objects_to_check():
    names = {f"{m}.{n}" for m, n, _ in PUBLIC}
    assert {"flashlib.api.attention", "flashlib.ladder.fa2.forward", "flashlib.api.decode"} <= names


@pytest.mark.parametrize("module,name,obj", PUBLIC, ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_public_object_names_a_chapter_that_mentions_it(module, name, obj):
    chapters = chapter_pointers(inspect.getdoc(obj) or "")
    assert chapters, f"{module}.{name}: its docstring has no 'Explained in: notebooks/NN_name'"
    for chapter in chapters:
        path = _chapter_file(chapter)
        assert path is not None, f"{module}.{name}: 'Explained in: {chapter}' names no file"
        mentioned = re.search(rf"\b{re.escape(name)}\b", path.read_text()) is not None
        assert mentioned, f"{module}.{name}: {chapter} never mentions {name}"


@pytest.mark.parametrize("module,name,obj", PUBLIC, ids=[f"{m}.{n}" for m, n, _ in PUBLIC])
def test_public_object_names_a_test_file_that_mentions_it(module, name, obj):
    tests = test_pointers(inspect.getdoc(obj) or "")
    assert tests, f"{module}.{name}: its docstring has no 'Tested in: tests/....py'"
    for test in tests:
        path = ROOT / test
        assert path.is_file(), f"{module}.{name}: 'Tested in: {test}' names no file"
        mentioned = re.search(rf"\b{re.escape(name)}\b", path.read_text()) is not None
        assert mentioned, f"{module}.{name}: {test} never mentions {name}"


def _module_docs():
    for path in sorted((ROOT / "flashlib").rglob("*.py")):
        yield path.relative_to(ROOT), path.read_text()


@pytest.mark.parametrize("path,text", list(_module_docs()), ids=lambda x: str(x)[:60])
def test_every_pointer_written_in_the_library_resolves(path, text):
    for chapter in chapter_pointers(text):
        assert _chapter_file(chapter) is not None, f"{path}: 'Explained in: {chapter}' names no file"
    for test in test_pointers(text):
        assert (ROOT / test).is_file(), f"{path}: 'Tested in: {test}' names no file"


def _notebook_code(path):
    nb = json.loads(path.read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_chapters_use_only_public_modules(path):
    private = re.findall(r"\bflashlib(?:\.\w+)*\._\w+|\bfrom flashlib(?:\.\w+)* import _\w+", _notebook_code(path))
    assert not private, f"{path.name} uses private flashlib names: {sorted(set(private))}"


def test_the_private_import_check_can_fail(tmp_path):
    nb = {"cells": [{"cell_type": "code", "source": ["from flashlib._checks import causal_mask\n"]}]}
    path = tmp_path / "bad.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="private"):
        test_chapters_use_only_public_modules(path)


_ELSEWHERE = re.compile(r"\.\./shared|\bSTYLE\.md\b|\bFACTS(?:\.md)?\b")


@pytest.mark.parametrize("path", sorted(p for d in ("flashlib", "tests", "notebooks", "book")
                                        for p in (ROOT / d).rglob("*")
                                        if p.suffix in (".py", ".ipynb", ".md", ".cu", ".h", ".cpp")
                                        and p.name != "test_pointers.py"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_at_files_readers_do_not_have(path):
    hits = _ELSEWHERE.findall(path.read_text(errors="replace"))
    assert not hits, f"{path.relative_to(ROOT)} refers to {sorted(set(hits))}, which is not in the repository"
