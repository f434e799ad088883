"""The bibliography's style: its labels read as the text cites (``[Dao et al., 2022]``), and its links.

The chapters cite in author-year form (``bibtex_reference_style: author_year`` in ``_config.yml``), but
pybtex's bibliography styles label an entry ``[DFE+22]`` (alpha) or ``[1]`` (plain). This extension
registers the pybtex style ``flashbook`` (``bibtex_default_style`` in ``_config.yml``):

- its label is the in-text form: the first author's last name (``A``, ``A and B``, ``A et al.``),
  a comma and the year, so the list's ``[Dao et al., 2022]`` is what a reader saw in the text;
- entries sort by their labels (cited names, year), then title;
- titles keep the capitals they are written with (pybtex lowercases all but the first letter);
- the arXiv id, the DOI and the URL are links, the URL shown only when it is neither of the others.

Checked by: tests/test_references.py.
"""
from __future__ import annotations

import re

from pybtex.plugin import register_plugin
from pybtex.richtext import Text
from pybtex.style.formatting.unsrt import Style as UnsrtStyle
from pybtex.style.labels import BaseLabelStyle
from pybtex.style.sorting import BaseSortingStyle
from pybtex.style.template import field, href, join, optional, sentence, words


def cited_names(entry) -> str:
    """The authors as sphinxcontrib-bibtex's author-year citations name them: last names (with their
    "von" part), ``A``, ``A and B`` or ``A et al.``; the editors or the title when there is no author."""
    for role in ("author", "editor"):
        persons = entry.persons.get(role)
        if persons:
            last = [" ".join(p.prelast_names + p.last_names) for p in persons]
            last = [str(Text.from_latex(name)) for name in last]
            if len(last) == 1:
                return last[0]
            if len(last) == 2:
                return f"{last[0]} and {last[1]}"
            return f"{last[0]} et al."
    return str(Text.from_latex(entry.fields.get("title", "")))


def label(entry) -> str:
    """``Dao et al., 2022``: an entry's label, exactly its in-text citation without brackets."""
    return f"{cited_names(entry)}, {entry.fields.get('year', '')}"


class AuthorYearLabelStyle(BaseLabelStyle):
    """Labels in the in-text author-year form (:func:`label`)."""

    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            yield label(entry)


class AuthorYearSortingStyle(BaseSortingStyle):
    """Entries in the order of their labels: cited names, then year, then title (case ignored)."""

    def sorting_key(self, entry):
        return (cited_names(entry).lower(), entry.fields.get("year", ""), entry.fields.get("title", "").lower())


_ARXIV = re.compile(r"https?://arxiv\.org/abs/(?P<id>[^/?#]+)/?$")
_DOI = re.compile(r"https?://(?:dx\.)?doi\.org/(?P<id>.+)$")


class Style(UnsrtStyle):
    """pybtex's ``unsrt`` with :class:`AuthorYearLabelStyle` labels in :class:`AuthorYearSortingStyle` order,
    titles as written, and the arXiv id, DOI and URL as links."""

    default_label_style = AuthorYearLabelStyle
    default_sorting_style = AuthorYearSortingStyle

    def format_title(self, e, which_field, as_sentence=True):
        title = field(which_field)
        return sentence[title] if as_sentence else title

    def format_web_refs(self, e):
        url = e.fields.get("url", "")
        arxiv, doi = _ARXIV.match(url), _DOI.match(url)
        redundant = (arxiv and arxiv["id"] == e.fields.get("eprint")) or (doi and doi["id"] == e.fields.get("doi"))
        return sentence[
            optional[self.format_eprint(e)],
            optional[self.format_doi(e)],
            *([] if redundant else [optional[self.format_url(e)]]),
        ]

    def format_url(self, e):
        url = field("url", raw=True)
        return words[href(url)[url]]

    def format_eprint(self, e):
        eprint = field("eprint", raw=True)
        return href(join["https://arxiv.org/abs/", eprint])[join["arXiv:", eprint]]


def setup(app):
    register_plugin("pybtex.style.labels", "flashbook", AuthorYearLabelStyle, force=True)
    register_plugin("pybtex.style.formatting", "flashbook", Style, force=True)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
