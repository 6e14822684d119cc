"""MkDocs hooks: publish the committed benchmark results and the changelog from
where they live in the repository, instead of keeping copies under docs/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def on_files(files: Files, config) -> Files:
    site = config["site_dir"]
    for png in sorted(RESULTS.glob("*.png")):  # committed plots only (latest/ is ignored)
        files.append(File(f"results/{png.name}", str(RESULTS.parent), site,
                          config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == "changelog.md":
        return (ROOT / "CHANGELOG.md").read_text()
    return markdown
