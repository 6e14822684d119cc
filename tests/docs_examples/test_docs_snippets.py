"""The Python examples in README.md and docs/ run as written.

Blocks that call a model or dataset the reader brings (`model`, `dataset`,
`TransformerBlock`, `build_model`) show how to call the library on them and cannot
run alone; every other block runs here, each in fresh globals.
"""

import re

import pytest
from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
READER_SUPPLIED = ("model", "dataset", "TransformerBlock", "build_model")
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _blocks():
    for page in PAGES:
        for k, code in enumerate(BLOCK.findall(page.read_text())):
            if not any(_uses_undefined(name, code) for name in READER_SUPPLIED):
                yield pytest.param(code, id=f"{page.relative_to(REPO)}[{k}]")


def _uses_undefined(name, code):
    return bool(re.search(rf"\b{name}\b", code)) and not re.search(
        rf"^\s*{name}\s*=", code, re.MULTILINE)


@pytest.mark.parametrize("code", list(_blocks()))
def test_snippet_runs(code):
    exec(compile(code, "<snippet>", "exec"), {"__name__": "snippet"})


def test_most_snippets_run():
    """The filter above leaves most examples in: it must not hide them all."""
    total = sum(len(BLOCK.findall(page.read_text())) for page in PAGES)
    assert len(list(_blocks())) >= total // 2


def test_the_api_reference_lists_every_public_name():
    """docs/api.md documents exactly what the package exports, and the export fits a
    screen."""
    import tf_checkpointing

    documented = set(re.findall(r"^::: tf_checkpointing\.(\w+)$",
                                (REPO / "docs" / "api.md").read_text(), re.MULTILINE))
    assert documented == set(tf_checkpointing.__all__)
    assert len(tf_checkpointing.__all__) <= 30
