"""The repository's address: one place (_config.yml), every use agreeing with it, Colab links well formed,
`set-repo` rewriting every use, the publishing workflow refusing the placeholder. The book's two states:
with the placeholder, no launch or repository button and a note on the landing page saying how to
publish; after `set-repo`, both buttons (the Colab links pointing at the repository) and no note. Both
are checked in the config and, for a small book built by jupyter-book, in the HTML."""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import urllib.parse

import pytest

from conftest import ROOT, need_module
from flashlib.__main__ import main
from flashlib.tools.publish import (COLAB, INTRO, NOTE_END, NOTE_START, PLACEHOLDER, buttons, check, colab_links,
                                    configured_buttons, publish_note, repo_url, set_repo, setup_cell,
                                    validate_url)

need_module("yaml")                     # a jupyter-book dependency: the reference reader of the config
import yaml  # noqa: E402


def _copy(tmp_path):
    """The files the address lives in, copied to ``tmp_path``: the notebooks that have code (a page
    still without any is test_this_checkout_agrees_with_its_one_address's to report)."""
    for name in ("_config.yml", "_toc.yml", "README.md", "book/intro.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "notebooks").mkdir()
    for path in sorted((ROOT / "notebooks").glob("[!._]*.ipynb")):
        if any(c["cell_type"] == "code" for c in json.loads(path.read_text())["cells"]):
            shutil.copy(path, tmp_path / "notebooks" / path.name)
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
    # a chapter's further pages (sections: - glob: notebooks/07[b-z]_*) get their links too
    pages = [str(p.relative_to(ROOT).with_suffix("")) for part in toc["parts"] for c in part["chapters"]
             for sec in c.get("sections", []) for p in ROOT.glob(sec["glob"] + ".ipynb")]
    assert any("07b_" in p for p in pages)
    links = colab_links()
    assert sorted(links) == sorted(f + ".ipynb" for f in chapters + pages) and len(links) >= 10
    assert list(links).index("notebooks/07b_backward_decoding.ipynb") == \
        list(links).index("notebooks/07_triton.ipynb") + 1           # in the book's order
    owner, name = validate_url(repo["url"])
    book = repo.get("path_to_book", "").strip("/")
    assert config["launch_buttons"]["colab_url"] == ("" if repo["url"] == PLACEHOLDER else COLAB)
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
    publishing = readme[readme.index("## Publishing"):].split("\n## ")[0]
    assert "**Not yet published.**" in publishing and "**Published.**" in publishing     # both states
    assert 'colab_url: ""' in publishing and "use_repository_button: true" in publishing
    assert "(intro-publishing)=\n## Publishing your own copy" in intro and "publish_note" in intro
    assert "python -m flashlib info" in intro and "python -m flashlib check" in intro


# The two states of the book: placeholder (no buttons, a note) and published (buttons, no note).

def _yaml_buttons(root):
    config = yaml.safe_load((root / "_config.yml").read_text())
    return config["launch_buttons"].get("colab_url"), config["html"].get("use_repository_button")


def test_this_checkout_s_buttons_and_note_follow_its_address():
    url = repo_url()
    assert configured_buttons() == buttons(url)
    colab, repo_button = _yaml_buttons(ROOT)                # as jupyter-book reads them
    assert (colab, repo_button) == (buttons(url)["colab_url"], buttons(url)["use_repository_button"])
    intro = (ROOT / INTRO).read_text()
    assert f"{NOTE_START}\n{publish_note(url)}{NOTE_END}" in intro
    if url == PLACEHOLDER:
        assert not colab and repo_button is False and "make set-repo URL=" in publish_note(url)


def test_the_placeholder_means_no_buttons_and_a_note_saying_how_to_publish():
    assert buttons(PLACEHOLDER) == {"colab_url": "", "use_repository_button": False}
    assert buttons("https://github.com/jane/book") == {"colab_url": COLAB, "use_repository_button": True}
    note = publish_note(PLACEHOLDER)
    assert note.startswith(":::{admonition}") and note.endswith(":::\n") and "make set-repo URL=" in note
    assert "no launch" in note and "no repository button" in note
    assert publish_note("https://github.com/jane/book") == ""
    with pytest.raises(ValueError):
        buttons("https://github.com/jane/book/")
    with pytest.raises(TypeError):
        publish_note(None)


def test_set_repo_turns_the_buttons_on_removes_the_note_and_can_go_back(tmp_path):
    root = _copy(tmp_path)
    set_repo(PLACEHOLDER, root)                           # the placeholder state, whatever this checkout has
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert _yaml_buttons(root) == ("", False) and "not published yet" in (root / INTRO).read_text()
    assert check(root) == []
    changed = set_repo("https://github.com/jane/attention-book", root)
    assert {"_config.yml", INTRO} <= set(changed)
    assert _yaml_buttons(root) == (COLAB, True)
    intro = (root / INTRO).read_text()
    assert f"{NOTE_START}\n{NOTE_END}" in intro and "not published yet" not in intro
    assert check(root) == [] and set_repo("https://github.com/jane/attention-book", root) == []
    assert all(link.startswith("https://colab.research.google.com/github/jane/attention-book/blob/main/notebooks/")
               for link in colab_links(root).values())
    set_repo(PLACEHOLDER, root)                           # and back: byte for byte the placeholder state
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before


def test_a_button_or_note_out_of_step_with_the_address_is_found(tmp_path):
    root = _copy(tmp_path)
    set_repo(PLACEHOLDER, root)
    config = root / "_config.yml"
    config.write_text(config.read_text().replace("use_repository_button: false", "use_repository_button: true"))
    [problem] = check(root)
    assert "html.use_repository_button is True" in problem and "placeholder" in problem
    set_repo(PLACEHOLDER, root)
    assert check(root) == []
    set_repo("https://github.com/jane/book", root)
    intro = root / INTRO
    intro.write_text(intro.read_text().replace(NOTE_START + "\n", NOTE_START + "\n" + publish_note(PLACEHOLDER)))
    [problem] = check(root)
    assert problem.startswith(f"{INTRO}: the publishing note")
    set_repo("https://github.com/jane/book", root)
    assert check(root) == []


def test_set_repo_writes_nothing_when_a_place_it_must_write_is_missing(tmp_path):
    root = _copy(tmp_path)
    intro = root / INTRO
    intro.write_text(intro.read_text().replace(NOTE_END, ""))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="publishing note markers"):
        set_repo("https://github.com/jane/book", root)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert any("no publishing note markers" in p for p in check(root))
    intro.write_text(intro.read_text() + NOTE_END + "\n")
    (root / "notebooks" / "99_stub.ipynb").write_text(json.dumps({"cells": [], "metadata": {}}))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="99_stub.ipynb: no code cell"):
        set_repo("https://github.com/jane/book", root)
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert any(p.startswith("notebooks/99_stub.ipynb: no code cell") for p in check(root))


def _tiny_book(root, url):
    """A two-page book with this checkout's configuration: the landing page (with the note's markers)
    and one chapter notebook whose first cell is the setup cell; execution off."""
    for name in ("_config.yml", "README.md"):
        shutil.copy(ROOT / name, root / name)
    shutil.copytree(ROOT / "book" / "_ext", root / "book" / "_ext", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "book" / "_static", root / "book" / "_static")
    shutil.copy(ROOT / "book" / "references.bib", root / "book" / "references.bib")
    config = root / "_config.yml"
    config.write_text(re.sub(r"execute_notebooks:\s*\S+", 'execute_notebooks: "off"', config.read_text()))
    (root / "_toc.yml").write_text("format: jb-book\nroot: book/intro\nparts:\n  - caption: Chapters\n"
                                   "    chapters:\n      - file: notebooks/01_tiny\n")
    (root / INTRO).write_text(f"# Tiny\n\n(intro-publishing)=\n## Publishing\n\n{NOTE_START}\n{NOTE_END}\n")
    (root / "notebooks").mkdir()
    nb = {"cells": [{"cell_type": "markdown", "id": "a1", "metadata": {}, "source": ["# 1. Tiny\n"]},
                    {"cell_type": "code", "id": "a2", "metadata": {}, "execution_count": None, "outputs": [],
                     "source": setup_cell(url).splitlines(keepends=True)}],
          "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (root / "notebooks" / "01_tiny.ipynb").write_text(json.dumps(nb))
    set_repo(url, root)


def _build(root):
    import subprocess
    import sys
    jb = pathlib.Path(sys.executable).with_name("jupyter-book")
    if not jb.exists():
        pytest.skip("jupyter-book is not installed next to this Python (make book installs it)")
    r = subprocess.run([str(jb), "build", str(root), "-W", "-n", "--keep-going"], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    html = root / "_build" / "html"
    return (html / "book" / "intro.html").read_text(), (html / "notebooks" / "01_tiny.html").read_text()


def test_a_built_book_shows_buttons_only_once_published(tmp_path):
    """A real jupyter-book build (about 10 s each): the placeholder state has no Colab link, no
    repository button and the note; after set-repo, the Colab link of the chapter, the repository
    button and no note."""
    need_module("jupyter_book")
    placeholder, published = tmp_path / "placeholder", tmp_path / "published"
    for root, url in ((placeholder, PLACEHOLDER), (published, "https://github.com/jane/attention-book")):
        root.mkdir()
        _tiny_book(root, url)
    intro, chapter = _build(placeholder)
    for page in (intro, chapter):
        assert "colab.research.google.com" not in page and "btn-source-repository-button" not in page
        assert f'href="{PLACEHOLDER}' not in page          # no link to the placeholder
    assert "not published yet" in intro and "set-repo</span>" in intro and "URL=https://github.com/THEM/REPO" in intro
    intro, chapter = _build(published)
    colab = "https://colab.research.google.com/github/jane/attention-book/blob/main/notebooks/01_tiny.ipynb"
    assert f'href="{colab}"' in chapter
    for page in (intro, chapter):
        assert 'href="https://github.com/jane/attention-book"' in page and "btn-source-repository-button" in page
    assert "not published yet" not in intro
