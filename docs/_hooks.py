"""MkDocs hooks: publish the committed benchmark results and the changelog from
where they live in the repository, instead of keeping copies under docs/.

The committed results (`benchmarks/results/`: the Markdown tables and run notes, the
plots and the JSON they are made from) are published as `results/...` beside the pages.
A page links them by their path in the repository (`../benchmarks/results/quick.md` from docs/,
`../../benchmarks/results/notes/x.md` from docs/decisions/), the link that works when
the repository is browsed; each such link is rewritten to the published copy before
MkDocs checks it, and so are the results pages' and the changelog's links to docs/."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PUBLISHED = (".md", ".png", ".json")
# A Markdown link's target: ](path) or ](path#anchor), with no scheme.
_LINK = re.compile(r"\]\((?![a-z]+:)([^)\s#]+)(#[^)\s]*)?\)")


def on_files(files: Files, config) -> Files:
    site = config["site_dir"]
    for path in sorted(RESULTS.rglob("*")):
        relative = path.relative_to(RESULTS)
        if path.suffix in PUBLISHED and relative.parts[0] != "latest":  # latest/: not committed
            files.append(File(f"results/{relative.as_posix()}", str(RESULTS.parent), site,
                              config["use_directory_urls"]))
    return files


def _repository_path(src_uri: str) -> str:
    """Where a published page's Markdown lives in the repository."""
    if src_uri == "changelog.md":
        return "CHANGELOG.md"
    if src_uri.startswith("results/"):
        return f"benchmarks/{src_uri}"
    return f"docs/{src_uri}"


def _site_path(repository_path: str) -> str | None:
    if repository_path.startswith("benchmarks/results/"):
        return repository_path[len("benchmarks/"):]
    if repository_path.startswith("docs/"):
        return repository_path[len("docs/"):]
    return None


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "changelog.md":
        markdown = (ROOT / "CHANGELOG.md").read_text()
    here = posixpath.dirname(_repository_path(page.file.src_uri))
    site_here = posixpath.dirname(page.file.src_uri)

    def rewrite(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        site = _site_path(posixpath.normpath(posixpath.join(here, target)))
        if site is None:
            return match.group(0)
        return f"]({posixpath.relpath(site, site_here or '.')}{anchor})"

    return _LINK.sub(rewrite, markdown)
