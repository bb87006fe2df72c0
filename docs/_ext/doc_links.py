"""Links for the pages that docstrings name in plain text.

Docstrings are read in a terminal too, so they name a page of this site as a path and a section
title: ``(docs/mathematics.rst, "Causal attention")``, ``(docs/scaling.rst)``, and the paper's
equations as ``paper eq. 3``. On the site these become links: the path to the page
(``:doc:``), the title to its section (a ``:ref:`` to the label ``page:title`` that this extension
gives every section of the hand-written pages, or to the explicit label of a titled paragraph),
and "paper" to the arXiv abstract. A title that matches no section is left to ``sphinx -n`` to
report.
"""

from __future__ import annotations

import re

from docutils import nodes

PAPER_URL = "https://arxiv.org/abs/2512.11411"

# Titled paragraphs (bold run-in titles, not sections) that carry an explicit label, and short names
# of sections.
PARAGRAPH_LABELS = {
    ("scaling", "Dask"): "scaling-dask",
    ("backends", "Threads"): "threads",
    ("backends", "JAX on the CPU"): "jax-cpu",
    ("backends", "First call"): "first-call",
    ("backends", "Accumulation"): "precision",
}

_MATH = re.compile(r":math:`([^`]*)`")
_PAGE_AND_TITLE = re.compile(r'(?<![`/\w])docs/(\w+)\.rst,(\s+)"([^"]+)"')
_PAGE = re.compile(r"(?<![`/\w])docs/(\w+)\.rst(?![`\w])")
_PAPER = re.compile(r"\bpaper eq\. (\d+)")


def section_label(docname: str, title: str) -> str:
    """The label this extension gives the section ``title`` of ``docname``."""
    return nodes.fully_normalize_name(f"{docname}:{title}")


def _plain(rawtitle: str) -> str:
    # "Slicing in :math:`\mathbb{R}^d`" is named "Slicing in R^d" in docstrings
    return _MATH.sub(lambda m: m.group(1).replace(r"\mathbb{R}", "R").replace("\\", ""), rawtitle)


def register_sections(app, document) -> None:
    docname = app.env.current_document.docname
    if docname.startswith(("generated/", "auto_examples/")):
        return
    domain = app.env.domains.standard_domain
    for section in document.findall(nodes.section):
        title = section[0]
        name = section_label(docname, _plain(getattr(title, "rawsource", "") or title.astext()))
        if name not in domain.labels:            # a repeated title links to its first section
            domain.anonlabels[name] = docname, section["ids"][0]
            domain.labels[name] = docname, section["ids"][0], title.astext()


def _link_section(match: re.Match) -> str:
    page, space, title = match.groups()
    label = PARAGRAPH_LABELS.get((page, title)) or section_label(page, title)
    return f":ref:`{title} <{label}>`{space}in :doc:`/{page}`"


def link_text(text: str) -> str:
    """``text`` with the plain mentions of pages, sections and paper equations made links."""
    text = _PAGE_AND_TITLE.sub(_link_section, text)
    text = _PAGE.sub(lambda m: f":doc:`/{m.group(1)}`", text)
    return _PAPER.sub(lambda m: f"`paper <{PAPER_URL}>`__ eq. {m.group(1)}", text)


def process_docstring(app, what, name, obj, options, lines) -> None:
    linked = link_text("\n".join(lines)).split("\n")
    if linked != lines:
        lines[:] = linked


def setup(app):
    app.connect("doctree-read", register_sections)
    app.connect("autodoc-process-docstring", process_docstring)
    return {"parallel_read_safe": False, "parallel_write_safe": True}
