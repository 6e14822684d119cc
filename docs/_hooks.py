"""MkDocs hooks: publish the committed benchmark results and the changelog from
where they live in the repository, instead of keeping copies under docs/.

A page links a committed plot as `../benchmarks/results/NAME.png`, the path that works
in the repository's view of docs/; the site publishes the plot as `results/NAME.png`
beside the pages, and the link is rewritten to it before MkDocs checks it."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# ](../benchmarks/results/NAME.png) in a page: the repository's path to a committed plot.
_RESULT_LINK = re.compile(r"\]\(\.\./benchmarks/results/([\w.-]+\.png)\)")


def on_files(files: Files, config) -> Files:
    site = config["site_dir"]
    for png in sorted(RESULTS.glob("*.png")):  # committed plots only (latest/ is ignored)
        files.append(File(f"results/{png.name}", str(RESULTS.parent), site,
                          config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "changelog.md":
        return (ROOT / "CHANGELOG.md").read_text()
    return _RESULT_LINK.sub(lambda m: f"](results/{m.group(1)})", markdown)
