"""A griffe extension for the API reference: the package's docstrings title their
doctests "Example:" (singular), which griffe's Google parser reads as an admonition
of plain Markdown; renamed "Examples:", they render as code."""

from __future__ import annotations

import re
from typing import Any

import griffe

# "Example:" or "Example (a note that may run over
# several lines):" directly followed by a doctest.
_TITLE = re.compile(r"^([ \t]*)Example\b(.*?):[ \t]*\n(?=[ \t]*>>>)", re.MULTILINE | re.DOTALL)


def _examples(match: re.Match) -> str:
    indent, note = match.group(1), match.group(2).strip()
    if not note:
        return f"{indent}Examples:\n"
    lines = " ".join(line.strip() for line in note.splitlines())
    return f"{indent}Examples:\n{indent}    Example {lines}:\n\n"


class DoctestExamples(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _TITLE.sub(_examples, obj.docstring.value)
