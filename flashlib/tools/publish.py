"""Where the book is published: the repository's address, set in one place and used everywhere.

The address is ``repository: url:`` in ``_config.yml``. Jupyter Book builds every chapter's Colab link
from it (``colab.research.google.com/github/OWNER/REPO/blob/BRANCH/notebooks/NN_name.ipynb``, see
:func:`colab_links`) and the repository button; each chapter's first code cell (:func:`setup_cell`)
installs flashlib from it in Colab; the README names it. ``python -m flashlib set-repo URL``
(``make set-repo URL=...``, :func:`set_repo`) rewrites every one of those uses; :func:`check` lists
what disagrees. Until a publisher sets it, the address is :data:`PLACEHOLDER`, whose owner ``OWNER``
marks it as not yet real: the publishing workflow refuses it, and refuses an address that is not the
repository it runs in.

The address also decides what the built book shows (:func:`buttons`): while it is the placeholder, no
launch (Colab) button and no repository button, which would lead nowhere, and the landing page carries
:func:`publish_note`, which says how to publish; once ``set-repo`` has set a real address, both buttons
and no note. ``set_repo`` writes both states, ``check`` refuses a mix. Standard library only: it runs
before anything else is installed.

Explained in: book/intro.
Tested in: tests/tools/test_publish.py.
"""
from __future__ import annotations

import json
import pathlib
import re

__all__ = ["PLACEHOLDER", "setup_cell", "colab_links", "check", "set_repo",
           "buttons", "configured_buttons", "publish_note"]   # and validate_url, repo_url

ROOT = pathlib.Path(__file__).resolve().parents[2]      # a checkout: _config.yml, notebooks/, README.md
PLACEHOLDER = "https://github.com/OWNER/flashbook"       # the address until `make set-repo URL=...`
COLAB = "https://colab.research.google.com"

# GitHub's rules: an owner is 1-39 letters, digits and single inner hyphens; a repository name is
# letters, digits, '.', '-', '_' (not '.' or '..'; a trailing '.git' is a clone URL, not the address).
_URL = re.compile(r"https://github\.com/(?P<owner>[A-Za-z0-9](?:-?[A-Za-z0-9]){0,38})/(?P<repo>[A-Za-z0-9._-]{1,100})")
# The address's uses in prose, whatever address they hold now: install specs, clones and Colab links.
_USE = re.compile(r"(?P<pre>git\+|git clone |colab\.research\.google\.com/)(?P<url>(?:https://)?github\.com/|github/)"
                  r"(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+?)(?=\.git\b|[/\s\"'`)@]|$)")
_CONFIG_URL = re.compile(r"^(repository:\s*\n(?:[ \t]+.*\n|\s*\n)*?[ \t]+url:[ \t]*)(\S+)", re.M)
_TEXTS = ("README.md", "book/intro.md")        # prose that names the address
INTRO = "book/intro.md"                        # the landing page: publish_note() sits between the markers
# The buttons in _config.yml that lead to the repository: `launch_buttons: colab_url:` (the Colab button)
# and `html: use_repository_button:`, each a line `key: value` inside its section.
_BUTTON_LINES = {"colab_url": "launch_buttons", "use_repository_button": "html"}
NOTE_START = "<!-- publish-note: shown while the address is the placeholder; `make set-repo` removes it -->"
NOTE_END = "<!-- /publish-note -->"
_NOTE = re.compile(re.escape(NOTE_START) + r"\n(?P<body>.*?)" + re.escape(NOTE_END), re.S)


def validate_url(url) -> tuple[str, str]:
    """``(owner, repo)`` of a repository address ``https://github.com/OWNER/REPO``; a TypeError or a
    ValueError naming what came otherwise (no trailing slash or ``.git``, no other host or path).

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str like 'https://github.com/OWNER/REPO', got {type(url).__name__}")
    m = _URL.fullmatch(url)
    if m is None or m["repo"] in (".", "..") or m["repo"].endswith(".git"):
        raise ValueError(f"url must be a GitHub repository address https://github.com/OWNER/REPO (https, no "
                         f"trailing '/' or '.git', nothing after REPO), got {url!r}")
    return m["owner"], m["repo"]


def _config(root) -> str:
    path = pathlib.Path(root) / "_config.yml"
    if not path.is_file():
        raise FileNotFoundError(f"no _config.yml in {path.parent}: the repository's address lives in a checkout "
                                f"of the book (an installed flashlib has none)")
    return path.read_text()


def _config_value(text: str, key: str, default: str) -> str:
    """``repository: <key>:`` of _config.yml (a line scan: PyYAML may not be installed yet)."""
    m = re.search(rf"^repository:\s*\n(?:[ \t]+.*\n|\s*\n)*?[ \t]+{key}:[ \t]*(\S*)", text, re.M)
    return m[1].strip("\"'") if m else default


def repo_url(root=ROOT) -> str:
    """The repository's address: ``repository: url:`` in ``root/_config.yml``.

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    return _config_value(_config(root), "url", "")


def _button_line(section: str, key: str) -> re.Pattern:
    return re.compile(rf"^({section}:[ \t]*\n(?:[ \t]+.*\n|[ \t]*\n)*?[ \t]+{key}:[ \t]*)(\"[^\"]*\"|\S*)", re.M)


def buttons(url: str) -> dict:
    """The built book's buttons that lead to repository ``url``, as ``_config.yml`` must set them:
    ``{"colab_url": ..., "use_repository_button": ...}``. Off for :data:`PLACEHOLDER` (``""`` and
    ``False``: no button that leads nowhere), on for a real address (``https://colab.research.google.com``
    and ``True``).

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    validate_url(url)
    live = url != PLACEHOLDER
    return {"colab_url": COLAB if live else "", "use_repository_button": live}


def configured_buttons(root=ROOT) -> dict:
    """What ``root/_config.yml`` sets for the :func:`buttons` (a line scan; ``None`` for a missing line).

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    text = _config(root)
    found = {}
    for key, section in _BUTTON_LINES.items():
        m = _button_line(section, key).search(text)
        value = m[2].strip("\"'") if m else None
        found[key] = value if key == "colab_url" or value is None else value.lower() == "true"
    return found


def publish_note(url: str) -> str:
    """The landing page's note for repository ``url``: for :data:`PLACEHOLDER`, an admonition saying
    that the book is not published, why it shows no launch or repository button and what to run;
    for a real address, nothing. It sits in ``book/intro.md`` between two comment lines,
    ``NOTE_START`` and ``NOTE_END``, which :func:`set_repo` keeps.

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    validate_url(url)
    if url != PLACEHOLDER:
        return ""
    return f"""\
:::{{admonition}} This copy of the book is not published yet
:class: note
Its repository address is still the placeholder `{PLACEHOLDER}`, so its pages
show no launch (Colab) button and no repository button: they would lead nowhere. To publish it,
push the repository to GitHub and run `make set-repo URL=https://github.com/THEM/REPO`; that sets
the address, turns both buttons on and removes this note ({{ref}}`intro-publishing`).
:::
"""


def setup_cell(url: str) -> str:
    """The source of every chapter's first code cell for repository ``url``: flashlib from the checkout
    the notebook sits in, else the installed one, else ``pip install`` from ``url`` (Colab).

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    validate_url(url)
    return f'''\
# Setup: flashlib from this checkout, else the installed one,
# else install it from the repository (Colab).
import importlib.util, pathlib, subprocess, sys
# a local checkout: notebooks/ sits beside flashlib/
root = pathlib.Path.cwd().resolve().parent
if (root / "flashlib" / "__init__.py").is_file():
    sys.path.insert(0, str(root))
elif importlib.util.find_spec("flashlib") is None:
    pkg = "flashlib @ git+{url}"
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", pkg])
    importlib.invalidate_caches()    # let this running kernel see the package
import flashlib
flashlib.display.crisp_figures()     # figures at twice the resolution'''


def _chapters(root) -> list[str]:
    """The notebooks of ``root/_toc.yml`` in its order (``root:`` and ``file:`` lines, and the pages a
    chapter's ``glob:`` line matches), as paths relative to ``root``."""
    root = pathlib.Path(root)
    found = []
    for kind, name in re.findall(r"^\s*(?:-\s*)?(root|file|glob):\s*(\S+)\s*$",
                                 (root / "_toc.yml").read_text(), re.M):
        if kind == "glob":
            found += sorted(str(p.relative_to(root)) for p in root.glob(name + ".ipynb"))
        elif (root / (name + ".ipynb")).is_file():
            found.append(name + ".ipynb")
    return found


def colab_links(root=ROOT) -> dict[str, str]:
    """``{notebook path: Colab link}`` for every chapter of ``_toc.yml``, built as Jupyter Book builds
    its launch buttons: ``colab_url/github/OWNER/REPO/blob/BRANCH/path_to_book/PATH``.

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    text = _config(root)
    owner, repo = validate_url(repo_url(root))
    branch = _config_value(text, "branch", "master")           # sphinx-book-theme's default
    book = _config_value(text, "path_to_book", "").strip("/")
    prefix = f"{COLAB}/github/{owner}/{repo}/blob/{branch}/" + (book + "/" if book else "")
    return {path: prefix + path for path in _chapters(root)}


def _notebooks(root):
    return sorted((pathlib.Path(root) / "notebooks").glob("*.ipynb"))


def _first_code_cell(nb: dict) -> dict | None:
    """The cell that must be :func:`setup_cell`; None for a notebook without code (a page in progress)."""
    return next((c for c in nb.get("cells", []) if c.get("cell_type") == "code"), None)


def check(root=ROOT, *, expect: str | None = None, branch: str | None = None) -> list[str]:
    """Every way the uses of the address disagree with ``_config.yml`` (empty: they agree): a malformed
    address, a chapter whose first code cell is not :func:`setup_cell`, an install, clone or Colab link
    in the README or the intro naming another repository. ``expect="OWNER/REPO"`` (the repository
    publishing the book) also refuses :data:`PLACEHOLDER` and any other repository; ``branch`` (its
    default branch) must be ``repository: branch:``, the branch the Colab links open.

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    if expect is not None:
        if not isinstance(expect, str):
            raise TypeError(f"expect must be a str OWNER/REPO or None, got {type(expect).__name__}")
        try:
            validate_url(f"https://github.com/{expect}")
        except ValueError:
            raise ValueError(f"expect must be a GitHub repository OWNER/REPO, like someone/flashbook, "
                             f"got {expect!r}") from None
    if branch is not None and (not isinstance(branch, str) or not branch.strip()):
        raise (TypeError if not isinstance(branch, str) else ValueError)(
            f"branch must be a branch name (a non-empty str) or None, got {type(branch).__name__} {branch!r}")
    root = pathlib.Path(root)
    url = repo_url(root)
    try:
        owner, repo = validate_url(url)
    except ValueError as e:
        return [f"_config.yml repository.url: {e}"]
    problems = []
    if expect is not None:
        if url == PLACEHOLDER:
            problems.append(f"_config.yml repository.url is still the placeholder {PLACEHOLDER}: run "
                            f"`make set-repo URL=https://github.com/{expect}` and commit (README: Publishing)")
        elif f"{owner}/{repo}".lower() != expect.lower():
            problems.append(f"_config.yml repository.url is {url}, but this is {expect}: run "
                            f"`make set-repo URL=https://github.com/{expect}` and commit (README: Publishing)")
    configured = _config_value(_config(root), "branch", "master")
    if branch is not None and branch != configured:
        problems.append(f"_config.yml repository.branch is {configured!r}, but the default branch is {branch!r}: "
                        f"the Colab links would open a branch that is not published")
    want = setup_cell(url)
    for path in _notebooks(root):
        cell = _first_code_cell(json.loads(path.read_text()))
        if cell is None:
            problems.append(f"{path.relative_to(root)}: no code cell; its first code cell must be the setup cell "
                            f"(flashlib.tools.publish.setup_cell), or the chapter cannot run in Colab")
        elif "".join(cell["source"]) != want:
            problems.append(f"{path.relative_to(root)}: the first code cell is not the setup cell for {url} "
                            f"(run `make set-repo URL={url}`)")
    for name in _TEXTS:
        for m in _USE.finditer((root / name).read_text()):
            if (m["owner"], m["repo"]) != (owner, repo):
                problems.append(f"{name}: {m[0]!r} names {m['owner']}/{m['repo']}, not {owner}/{repo}")
    state = "the placeholder" if url == PLACEHOLDER else "a real address"
    have = configured_buttons(root)
    for key, want in buttons(url).items():
        if have[key] != want:
            problems.append(f"_config.yml {_BUTTON_LINES[key]}.{key} is {have[key]!r}, but the address is {state}, "
                            f"which needs {want!r} (run `make set-repo URL={url}`)")
    note = _NOTE.search((root / INTRO).read_text())
    if note is None:
        problems.append(f"{INTRO}: no publishing note markers ({NOTE_START} ... {NOTE_END}) for set-repo to fill")
    elif note["body"] != publish_note(url):
        problems.append(f"{INTRO}: the publishing note is not the one for {state} (run `make set-repo URL={url}`)")
    return problems


def set_repo(url: str, root=ROOT) -> list[str]:
    """Make ``url`` the repository's address: rewrite ``_config.yml``'s ``repository: url:`` and its
    buttons (:func:`buttons`: on for a real address, off for :data:`PLACEHOLDER`), every chapter's setup
    cell (its source only; outputs and the rest of the notebook are kept), every install, clone and
    Colab link in the README and the intro, and the intro's :func:`publish_note`. Returns the files it
    changed; a second run changes nothing.

    Explained in: book/intro.
    Tested in: tests/tools/test_publish.py.
    """
    owner, repo = validate_url(url)
    root = pathlib.Path(root)
    changed = []

    def write(path: pathlib.Path, old: str, new: str) -> None:
        if new != old:
            path.write_text(new)
            changed.append(str(path.relative_to(root)))

    config = root / "_config.yml"
    text = _config(root)                      # FileNotFoundError saying why (an installed flashlib)
    if not _CONFIG_URL.search(text):
        raise ValueError(f"{config}: no 'repository:' section with a 'url:' line to rewrite")
    for key, section in _BUTTON_LINES.items():
        if not _button_line(section, key).search(text):
            raise ValueError(f"{config}: no '{section}:' section with a '{key}:' line to set")
    intro = root / INTRO
    intro_text = intro.read_text()
    if not _NOTE.search(intro_text):
        raise ValueError(f"{intro}: no publishing note markers to fill: a line {NOTE_START} and, below it, "
                         f"a line {NOTE_END}")
    new = _CONFIG_URL.sub(lambda m: m[1] + url, text, count=1)
    for key, value in buttons(url).items():
        # as YAML: true/false, "" for the empty string (a bare `colab_url:` would be null)
        value = ("true" if value else "false") if isinstance(value, bool) else value or '""'
        new = _button_line(_BUTTON_LINES[key], key).sub(lambda m, v=value: m[1] + v, new, count=1)
    notebooks = {path: path.read_text() for path in _notebooks(root)}
    for path, nb_text in notebooks.items():
        if _first_code_cell(json.loads(nb_text)) is None:
            raise ValueError(f"{path}: no code cell to make the setup cell (a chapter starts with it)")
    write(config, text, new)
    source = setup_cell(url).splitlines(keepends=True)
    for path, text in notebooks.items():
        nb = json.loads(text)
        _first_code_cell(nb)["source"] = source
        write(path, text, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")     # as nbformat writes
    note = publish_note(url)
    for name in _TEXTS:
        path = root / name
        text = path.read_text()
        new = _USE.sub(lambda m: f"{m['pre']}{m['url']}{owner}/{repo}", text)
        if name == INTRO:
            new = _NOTE.sub(lambda m: f"{NOTE_START}\n{note}{NOTE_END}", new, count=1)
        write(path, text, new)
    return changed
