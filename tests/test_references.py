"""The bibliography is fit to cite from: book/references.bib complete and free of raw TeX, every
citation of the book resolving to it, and the list's labels (book/_ext/flashbook_bib.py) exactly the
in-text author-year citations sphinxcontrib-bibtex makes, each unique, with the arXiv id, DOI or URL
as links."""
from __future__ import annotations

import json
import re
import sys
import types

import pytest

from conftest import ROOT, need_module

need_module("pybtex")                    # jupyter-book's bibliography dependencies (sphinxcontrib-bibtex)
need_module("sphinxcontrib.bibtex")
from pybtex.database import parse_file  # noqa: E402

sys.path.insert(0, str(ROOT / "book" / "_ext"))
import flashbook_bib  # noqa: E402

BIB = ROOT / "book" / "references.bib"
DATA = parse_file(str(BIB))
ENTRIES = DATA.entries
# Keys that chapters cite or are about to cite (the helpers of issue 21 were given these).
REQUIRED = {"dao2022flashattention", "dao2023flashattention2", "shah2024flashattention3", "dao2023flashdecoding",
            "rabe2021selfattention", "milakov2018online", "liu2023ring", "vaswani2017attention",
            "williams2009roofline", "tillet2019triton", "touvron2023llama", "brandon2023striped",
            "karpathy2024llmc", "karpathy2022nanogpt", "nvidia2025ptx", "nvidia2025cuda", "kwon2023vllm",
            "ye2025flashinfer"}
# Ids checked by hand against the papers' pages; a changed id is a deliberate edit of this table too.
IDS = {"dao2022flashattention": ("eprint", "2205.14135"), "dao2023flashattention2": ("eprint", "2307.08691"),
       "shah2024flashattention3": ("eprint", "2407.08608"), "rabe2021selfattention": ("eprint", "2112.05682"),
       "milakov2018online": ("eprint", "1805.02867"), "liu2023ring": ("eprint", "2310.01889"),
       "vaswani2017attention": ("eprint", "1706.03762"), "touvron2023llama": ("eprint", "2302.13971"),
       "brandon2023striped": ("eprint", "2311.09431"), "kwon2023vllm": ("eprint", "2309.06180"),
       "ye2025flashinfer": ("eprint", "2501.01005"), "williams2009roofline": ("doi", "10.1145/1498765.1498785"),
       "tillet2019triton": ("doi", "10.1145/3315508.3329973")}
_CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")


def _cited() -> dict[str, set[str]]:
    """``{key: pages citing it}`` over the book's Markdown pages and notebooks' Markdown cells."""
    found: dict[str, set[str]] = {}
    pages = [(p, p.read_text()) for p in sorted((ROOT / "book").glob("*.md"))]
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text())
        pages.append((p, "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")))
    for path, text in pages:
        for keys in _CITE.findall(text):
            for key in keys.split(","):
                found.setdefault(key.strip(), set()).add(str(path.relative_to(ROOT)))
    return found


def test_the_keys_the_chapters_use_are_all_there():
    assert REQUIRED <= set(ENTRIES), sorted(REQUIRED - set(ENTRIES))
    missing = {k: v for k, v in _cited().items() if k not in ENTRIES}
    assert not missing, f"cited but not in {BIB.name}: {missing}"


@pytest.mark.parametrize("key", sorted(ENTRIES))
def test_every_entry_is_complete_with_a_link_and_no_raw_tex(key):
    e = ENTRIES[key]
    f = {k.lower(): v for k, v in e.fields.items()}
    assert e.persons.get("author"), f"{key}: no author"
    assert f.get("title") and re.fullmatch(r"\d{4}[a-z]?", f.get("year", "")), f"{key}: title and year"
    assert re.match(r"https://\S+$", f.get("url", "")), f"{key}: no url"
    if e.type in ("article", "inproceedings"):
        assert f.get("doi") or f.get("eprint"), f"{key}: a paper needs a DOI or an arXiv id"
        assert f.get("journal" if e.type == "article" else "booktitle"), f"{key}: where it appeared"
    if "eprint" in f:
        assert f.get("archiveprefix") == "arXiv" and re.fullmatch(r"\d{4}\.\d{4,5}", f["eprint"]), key
        assert "arXiv" not in f.get("journal", ""), f"{key}: the arXiv id belongs in eprint, not the journal"
    if "doi" in f:
        assert re.fullmatch(r"10\.\d{4,}/\S+", f["doi"]), key
    for name in ("title", "booktitle", "journal", "howpublished", "note"):
        assert not re.search(r"\$|\\[a-zA-Z]+\{", f.get(name, "")), f"{key}: raw TeX in its {name}: {f[name]!r}"


@pytest.mark.parametrize("key", sorted(IDS))
def test_ids_are_the_checked_ones(key):
    field, value = IDS[key]
    assert ENTRIES[key].fields[field] == value


def test_triton_and_flashattention_2_are_different_sources():
    """Issue 21: the Triton language was cited as the FlashAttention-2 paper."""
    assert "Triton" in ENTRIES["tillet2019triton"].fields["title"]
    assert "FlashAttention-2" in ENTRIES["dao2023flashattention2"].fields["title"]
    assert "Tillet" in str(ENTRIES["tillet2019triton"].persons["author"][0])


def _formatted():
    style = flashbook_bib.Style()
    return list(style.format_entries(style.sort(ENTRIES.values())))


def test_labels_are_the_in_text_author_year_citations_and_unique():
    from sphinxcontrib.bibtex.style.referencing import PersonStyle
    from sphinxcontrib.bibtex.style.template import join, year
    in_text = join(sep=", ")[PersonStyle().author_or_editor_or_title(full=False), year]
    data = {"style": types.SimpleNamespace(person=PersonStyle())}
    labels = {}
    for formatted in _formatted():
        entry = ENTRIES[formatted.key]
        cited = in_text.format_data(dict(data, entry=entry)).render_as("text")
        assert formatted.label == cited, formatted.key
        labels.setdefault(formatted.label, []).append(formatted.key)
    assert all(len(keys) == 1 for keys in labels.values()), {k: v for k, v in labels.items() if len(v) > 1}
    assert labels["Dao et al., 2022"] == ["dao2022flashattention"] and labels["Dao, 2024"] == ["dao2023flashattention2"]


def test_the_list_is_in_label_order_with_links_and_titles_as_written():
    formatted = _formatted()
    keys = [f.key for f in formatted]
    assert keys == sorted(keys, key=lambda k: flashbook_bib.AuthorYearSortingStyle().sorting_key(ENTRIES[k]))
    html = {f.key: f.text.render_as("html") for f in formatted}
    assert '<a href="https://arxiv.org/abs/2205.14135">arXiv:2205.14135</a>' in html["dao2022flashattention"]
    assert '<a href="https://doi.org/10.1145/3315508.3329973">doi:10.1145/3315508.3329973</a>' in \
        html["tillet2019triton"]
    assert 'href="https://pytorch.org/blog/flash-decoding/"' in html["dao2023flashdecoding"]
    assert html["dao2022flashattention"].count("arxiv.org/abs/2205.14135") == 1     # the url is not repeated
    assert "Ring Attention with Blockwise Transformers" in html["liu2023ring"]       # not lowercased
    assert "O(n²)" in html["rabe2021selfattention"] and "$" not in "".join(html.values())
    for key, text in html.items():
        assert "<a href=" in text, f"{key}: no link"


def test_the_book_uses_this_style():
    config = (ROOT / "_config.yml").read_text()
    assert re.search(r"^\s+bibtex_default_style:\s*flashbook\b", config, re.M)
    assert re.search(r"^\s+bibtex_reference_style:\s*author_year\b", config, re.M)
    assert re.search(r"^\s+flashbook_bib:\s*book/_ext\b", config, re.M)
