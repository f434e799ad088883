"""The repository's address: one place (_config.yml), every use agreeing with it, Colab links well formed,
`set-repo` rewriting every use, the publishing workflow refusing the placeholder."""
from __future__ import annotations

import json
import re
import shutil
import urllib.parse

import pytest

from conftest import ROOT, need_module
from flashlib.__main__ import main
from flashlib.tools.publish import (PLACEHOLDER, check, colab_links, repo_url, set_repo, setup_cell,
                                    validate_url)

need_module("yaml")                     # a jupyter-book dependency: the reference reader of the config
import yaml  # noqa: E402


def _copy(tmp_path):
    """The files the address lives in, copied to ``tmp_path``."""
    for name in ("_config.yml", "_toc.yml", "README.md", "book/intro.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns(".*", "_*"))
    return tmp_path


def test_this_checkout_agrees_with_its_one_address():
    assert check() == []
    assert repo_url() == yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


def test_the_placeholder_is_detected_and_a_foreign_repository_refused():
    problems = check(expect="someone/flashbook")
    if repo_url() == PLACEHOLDER:
        assert any("placeholder" in p and "make set-repo" in p for p in problems), problems
    else:
        assert any("but this is someone/flashbook" in p for p in problems), problems


def test_the_publisher_s_own_address_passes_and_a_wrong_branch_does_not(tmp_path):
    root = _copy(tmp_path)
    set_repo("https://github.com/Jane-Doe/my.book", root)
    assert check(root, expect="jane-doe/My.Book", branch="main") == []     # GitHub ignores case
    [problem] = check(root, expect="Jane-Doe/my.book", branch="gh-pages")
    assert "repository.branch is 'main'" in problem


def test_set_repo_rewrites_every_use_and_leaves_no_old_address(tmp_path):
    root = _copy(tmp_path)
    old_owner, old_repo = validate_url(repo_url(root))
    old_notebooks = {p.name: json.loads(p.read_text()) for p in (root / "notebooks").glob("*.ipynb")}
    changed = set_repo("https://github.com/jane/attention-book", root)
    assert "_config.yml" in changed and len([c for c in changed if c.startswith("notebooks/")]) == len(old_notebooks)
    assert repo_url(root) == "https://github.com/jane/attention-book"
    assert check(root) == [] and check(root, expect="jane/attention-book") == []
    for name in ("_config.yml", "README.md", "book/intro.md", *(f"notebooks/{n}" for n in old_notebooks)):
        assert f"{old_owner}/{old_repo}" not in (root / name).read_text(), name
    for path in (root / "notebooks").glob("*.ipynb"):
        nb, old = json.loads(path.read_text()), old_notebooks[path.name]
        code = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
        assert "".join(nb["cells"][code[0]]["source"]) == setup_cell("https://github.com/jane/attention-book")
        for i, (cell, before) in enumerate(zip(nb["cells"], old["cells"], strict=True)):   # all else kept
            if i == code[0]:
                cell, before = dict(cell, source=""), dict(before, source="")
            assert cell == before
        assert {k: v for k, v in nb.items() if k != "cells"} == {k: v for k, v in old.items() if k != "cells"}
    assert set_repo("https://github.com/jane/attention-book", root) == []       # a second run: no change


def test_a_use_that_disagrees_is_found(tmp_path):
    root = _copy(tmp_path)
    readme = root / "README.md"
    readme.write_text(readme.read_text() + '\n```bash\npip install "flashlib @ git+https://github.com/x/y"\n```\n')
    nb_path = root / "notebooks" / "01_naive_attention.ipynb"
    nb = json.loads(nb_path.read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["source"] = "".join(cell["source"]).replace(validate_url(repo_url(root))[0] + "/", "x/")
    nb_path.write_text(json.dumps(nb))
    problems = check(root)
    assert any(p.startswith("README.md:") and "x/y" in p for p in problems), problems
    assert any(p.startswith("notebooks/01_naive_attention.ipynb:") for p in problems), problems
    set_repo(repo_url(root), root)                  # the fix the message names
    assert check(root) == []


@pytest.mark.parametrize("url", ["https://github.com/OWNER/flashbook/", "https://github.com/OWNER/flashbook.git",
                                 "http://github.com/a/b", "https://gitlab.com/a/b", "github.com/a/b",
                                 "https://github.com/a", "https://github.com/a/b/tree/main", "https://github.com/-a/b",
                                 "https://github.com/a--b/c", "https://github.com/a/..", "https://github.com/a b/c", ""])
def test_malformed_addresses_are_refused(url, tmp_path):
    with pytest.raises(ValueError, match=r"url must be .*https://github.com/OWNER/REPO.*got " + re.escape(repr(url))):
        validate_url(url)
    root = _copy(tmp_path)
    before = (root / "_config.yml").read_text()
    with pytest.raises(ValueError):
        set_repo(url, root)
    assert (root / "_config.yml").read_text() == before          # nothing half-written
    with pytest.raises(SystemExit) as exited:                    # argparse's usage error, exit code 2
        main(["set-repo", url])
    assert exited.value.code == 2


def test_a_non_string_address_is_a_type_error():
    with pytest.raises(TypeError, match="url must be a str"):
        validate_url(None)


@pytest.mark.parametrize("expect, branch, error, message", [
    ("not a repo", None, ValueError, r"expect must be a GitHub repository OWNER/REPO.*got 'not a repo'"),
    ("a/b/c", None, ValueError, r"expect must be .*got 'a/b/c'"),
    ("", None, ValueError, r"expect must be .*got ''"),
    (3, None, TypeError, r"expect must be a str OWNER/REPO or None, got int"),
    (None, "", ValueError, r"branch must be a branch name .*got str ''"),
    (None, 1, TypeError, r"branch must be a branch name .*got int 1")])
def test_check_refuses_a_malformed_expected_repository_or_branch(expect, branch, error, message):
    """Before: ``check(expect="not a repo")`` told the reader to run `make set-repo
    URL=https://github.com/not a repo`, a command that cannot work."""
    with pytest.raises(error, match=message):
        check(expect=expect, branch=branch)


def test_colab_links_are_well_formed_for_every_chapter_of_the_toc():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo, toc = config["repository"], yaml.safe_load((ROOT / "_toc.yml").read_text())
    chapters = [c["file"] for part in toc["parts"] for c in part["chapters"]
                if (ROOT / (c["file"] + ".ipynb")).is_file()]
    links = colab_links()
    assert sorted(links) == sorted(f + ".ipynb" for f in chapters) and len(links) >= 10
    owner, name = validate_url(repo["url"])
    book = repo.get("path_to_book", "").strip("/")
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    for path, link in links.items():
        parts = urllib.parse.urlsplit(link)
        assert (parts.scheme, parts.netloc, parts.query, parts.fragment) == ("https", "colab.research.google.com", "", "")
        assert parts.path == f"/github/{owner}/{name}/blob/{repo['branch']}/" + (book + "/" if book else "") + path
        assert (ROOT / book / path).is_file() and "//" not in parts.path and " " not in link


def test_the_setup_cell_uses_the_checkout_then_an_installed_flashlib_then_pip(tmp_path):
    src = setup_cell("https://github.com/jane/attention-book")
    compile(src, "<setup>", "exec")
    assert '"flashlib @ git+https://github.com/jane/attention-book"' in src
    checkout = src.index('sys.path.insert(0, str(root))')
    assert checkout < src.index('find_spec("flashlib") is None') < src.index("pip")
    with pytest.raises(ValueError):
        setup_cell("https://github.com/jane/attention-book/")


def test_the_setup_cell_runs_in_a_checkout_and_where_flashlib_is_installed(tmp_path, monkeypatch):
    """Executed for real: in notebooks/ of this checkout it puts the checkout first on sys.path; elsewhere,
    with flashlib importable, it installs nothing (pip would fail: the subprocess call is replaced)."""
    import subprocess
    import sys
    src = setup_cell(repo_url())
    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT / "notebooks")
    exec(src, {})
    assert sys.path[0] == str(ROOT) and calls == []
    monkeypatch.chdir(tmp_path)                         # not a checkout; flashlib is installed (or on path)
    exec(src, {})
    assert calls == []


def test_the_workflow_checks_the_address_first_then_tests_builds_and_publishes():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "book.yml").read_text())
    on = wf.get("on", wf.get(True))                     # YAML 1.1 reads the key `on` as True
    assert {"push", "pull_request"} <= set(on)
    steps = wf["jobs"]["build"]["steps"]
    runs = [s.get("run", "") for s in steps]
    first = next(i for i, r in enumerate(runs) if r)
    assert re.search(r'python -m flashlib check-repo --expect "\$\{\{ github\.repository \}\}"', runs[first])
    assert any("make test" in r or ".ci/run" in r for r in runs[first + 1:])
    assert "3.11" in wf["jobs"]["build"]["container"]
    deploy = wf["jobs"]["deploy"]
    assert deploy["needs"] == "build" and "default_branch" in deploy["if"] and deploy["permissions"]["pages"] == "write"
    assert any(s.get("uses", "").startswith("actions/deploy-pages@") for s in deploy["steps"])
    assert any(s.get("uses", "").startswith("actions/upload-pages-artifact@") and s["with"]["path"] == "_build/html"
               for s in steps)


def test_check_repo_command_fails_with_a_clear_message_on_the_placeholder(capsys):
    code = main(["check-repo", "--expect", "someone/else"])
    err = capsys.readouterr().err
    assert code == 1 and "cannot be published" in err and "make set-repo URL=https://github.com/someone/else" in err
    assert main(["check-repo"]) == 0
    out = capsys.readouterr().out
    assert all(link in out for link in colab_links().values())


def test_the_book_says_how_to_publish_and_what_to_run_first():
    readme, intro = (ROOT / "README.md").read_text(), (ROOT / "book" / "intro.md").read_text()
    assert "## Publishing" in readme and "make set-repo URL=" in readme and "GitHub Pages" in readme
    assert "python -m flashlib info" in intro and "python -m flashlib check" in intro
