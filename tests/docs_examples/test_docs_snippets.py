"""The Python examples in README.md and docs/ run as written.

Blocks that call a model or dataset the reader brings (`model`, `dataset`,
`TransformerBlock`, `build_model`) show how to call the library on them and cannot
run alone; every other block runs here, each in fresh globals.
"""

import re

import pytest
from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
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
    """docs/api.md documents exactly what the package exports, each object once: the
    top-level names and those of its submodules `plans` and `debug` (a name in both,
    such as `plan_model`, under either); and the top level fits a screen."""
    import tf_checkpointing
    from tf_checkpointing import debug, plans

    public = {name: getattr(tf_checkpointing, name) for name in tf_checkpointing.__all__}
    for module in (plans, debug):
        public.update({f"{module.__name__.split('.')[-1]}.{name}": getattr(module, name)
                       for name in module.__all__})
    documented = re.findall(r"^::: tf_checkpointing\.([\w.]+)$",
                            (REPO / "docs" / "api.md").read_text(), re.MULTILINE)
    assert set(documented) <= set(public), set(documented) - set(public)
    objects = [id(public[name]) for name in documented]
    assert len(objects) == len(set(objects)), f"documented twice: {documented}"
    assert set(objects) == {id(obj) for obj in public.values()}, (
        sorted(name for name, obj in public.items() if id(obj) not in objects))
    assert len(tf_checkpointing.__all__) <= 14


def test_every_readme_snippet_runs():
    """The README's examples are the first a reader copies: none of them is left out as
    reader-supplied."""
    total = len(BLOCK.findall((REPO / "README.md").read_text()))
    ran = [p for p in _blocks() if p.id.startswith("README.md[")]
    assert total >= 3 and len(ran) == total


def _range(cell):
    """'0.20-0.21' or '0.19' (bold and notes after the number allowed) -> (low, high)."""
    low, _, high = re.match(r"\**([\d.]+(?:-[\d.]+)?)", cell).group(1).partition("-")
    return float(low), float(high or low)


def test_readme_results_table_spans_the_committed_main_job():
    """Each ratio in the README's results table is a range over runs of `python
    benchmarks/run.py`, and the committed run (benchmarks/results/quick.json) is one of
    them; its gradients column says "wrong" and "twice" exactly where that run's gradients
    and BatchNorm statistics differ from plain's. Regenerating the committed results means
    updating the README's table."""
    import json

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Results"):readme.index("## Documentation")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    header, rows = rows[0], rows[1:]
    committed = json.loads((REPO / "benchmarks/results/quick.json").read_text())["results"]
    by_key = {(r["model"], r["strategy"]): r for r in committed}
    columns = {"peak memory x plain": "memory_ratio", "step time x plain": "time_ratio"}
    models = {"GPT-2": "gpt2", "U-Net": "unet", "MLP": "mlp"}
    strategies = {"tf.recompute_grad": "recompute_grad", "checkpointable": "checkpointable",
                  "CheckpointedSequential": "budget_plan"}
    model = None
    seen = set()
    for row in rows:
        model = next((m for label, m in models.items() if row[0].startswith(label)), model)
        strategy = next(s for label, s in strategies.items() if row[1].startswith(f"`{label}"))
        result = by_key[(model, strategy)]
        seen.add((model, strategy))
        for name, key in columns.items():
            low, high = _range(row[header.index(name)])
            assert low <= round(result[key], 2) <= high, (model, strategy, name)
        gradients = row[header.index("gradients vs plain")]
        assert ("wrong" in gradients) == (result["grad_error"] > 1e-5), (model, strategy)
        assert ("twice" in gradients) == ((result["state_error"] or 0) > 0.5), (model, strategy)
    assert seen == {key for key in by_key if key[1] != "plain"}
