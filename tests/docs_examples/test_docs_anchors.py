"""Every `docs/PAGE.md#anchor` that the package, the benchmarks, the tests and the
examples cite (in comments, docstrings and messages) names a page that exists and a
heading of it, as MkDocs makes a heading's anchor; and every page stays short.

MkDocs checks the links between pages when it builds the site (`mkdocs build --strict`);
it does not read the code, which is why this test does.
"""

import re
import unicodedata

import pytest
from helpers import REPO

CITING = ("tf_checkpointing", "benchmarks", "tests", "examples")
CITATION = re.compile(
    r"\bdocs/((?:[a-z0-9_-]+/)*[a-z0-9_-]+\.md)(?:#([A-Za-z0-9_-]+(?:\.[A-Za-z0-9_]+)*))?")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def slug(heading):
    """The anchor MkDocs (Python-Markdown's toc extension) gives a heading: its text
    without Markdown, lowercase, punctuation dropped, runs of spaces and hyphens as one
    hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[`*]", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page):
    """The anchors of a page's headings (fenced code left out), and for the generated
    API page the names it documents."""
    text = page.read_text()
    if page.name == "api.md":
        return set(re.findall(r"^::: (tf_checkpointing[\w.]*)$", text, re.MULTILINE))
    found, fenced = set(), False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            name = slug(match.group(2))
            number = 1
            unique = name
            while unique in found:  # MkDocs numbers a repeated heading: name_1, name_2
                unique = f"{name}_{number}"
                number += 1
            found.add(unique)
    return found


def citations():
    """(file, line number, page, anchor or None) for every docs citation."""
    for folder in CITING:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".txt", ".toml", ".cfg") or not path.is_file():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in CITATION.finditer(line):
                    yield path.relative_to(REPO), number, match.group(1), match.group(2)


def test_slug_is_mkdocs_own():
    assert slug("Chunk factor") == "chunk-factor"
    assert slug("XLA's optimization barrier") == "xlas-optimization-barrier"
    assert slug("Save policies per region: `policies=`") == "save-policies-per-region-policies"
    assert slug("oneDNN: a convolution's backward scratch") == (
        "onednn-a-convolutions-backward-scratch")
    assert slug("Keeping the statistics of norms: `reductions_saveable`") == (
        "keeping-the-statistics-of-norms-reductions_saveable")


def test_the_code_cites_docs():
    """The search finds the citations, anchors included: an empty list would pass the
    test below."""
    assert len(list(citations())) >= 30
    cited = [m.groups() for m in CITATION.finditer(
        "(see docs/design.md#chunk-factor). docs/decisions/0019-chunk-factor.md, "
        "``docs/api.md#tf_checkpointing.debug.measure``")]
    assert cited == [("design.md", "chunk-factor"), ("decisions/0019-chunk-factor.md", None),
                     ("api.md", "tf_checkpointing.debug.measure")]


@pytest.mark.parametrize("source,line,page,anchor",
                         [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in citations()])
def test_cited_page_and_anchor_exist(source, line, page, anchor):
    path = REPO / "docs" / page
    assert path.is_file(), f"{source}:{line} cites docs/{page}, which does not exist"
    if anchor is not None:
        assert anchor in anchors(path), (
            f"{source}:{line} cites docs/{page}#{anchor}, which is not a heading of that page")


def test_a_missing_anchor_is_caught():
    design = anchors(REPO / "docs" / "design.md")
    assert "chunk-factor" in design
    assert "no-such-decision" not in design


def test_pages_are_short():
    """A guide reads in minutes: no docs page over 300 lines, the README at most 120."""
    long = {page.relative_to(REPO): n for page in (REPO / "docs").rglob("*.md")
            if (n := len(page.read_text().splitlines())) > 300}
    assert not long
    assert len((REPO / "README.md").read_text().splitlines()) <= 120
