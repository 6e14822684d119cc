"""The user-path benchmark's table and targets (see ``user_path.py``).

Example:
    >>> rows = [dict(model="stack", mode="graph", strategy=s, first_peak_mib=f,
    ...              first_seconds=1.0, peaks_mib=[p, p, p])
    ...         for s, f, p in (("plain", 10, 10), ("per-block", 4, 3), ("min", 5, 3))]
    >>> print(table(rows).splitlines()[2])
    | stack | tf.function | 10.0 | 3.0 (0.30x) | 3.0 (0.30x, 1.00x per-block) | - | 0.50x |
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

MODE_NAMES = {"graph": "tf.function", "xla": "XLA"}


def _find(rows: list[dict], model: str, mode: str, strategy: str) -> Optional[dict]:
    for row in rows:
        if (row["model"], row["mode"], row["strategy"]) == (model, mode, strategy):
            return row if "error" not in row else None
    return None


def _peak(row: Optional[dict]) -> Optional[float]:
    """The median of a strategy's steps after the first."""
    return statistics.median(row["peaks_mib"]) if row else None


def table(rows: list[dict]) -> str:
    lines = ["| model | mode | plain | per-block | min | halfway budget: peak | "
             "first step, min / plain |",
             "|---|---|---|---|---|---|---|"]
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in rows):
        plain, block, least, half = (_find(rows, model, mode, s)
                                     for s in ("plain", "per-block", "min", "halfway"))
        p, b, m, h = (_peak(r) for r in (plain, block, least, half))
        cells = [model, MODE_NAMES.get(mode, mode), f"{p:.1f}" if p else "-"]
        cells.append(f"{b:.1f} ({b / p:.2f}x)" if b and p else "-")
        cells.append(f"{m:.1f} ({m / p:.2f}x, {m / b:.2f}x per-block)" if m and p and b
                     else "-")
        if half and h:
            worst = max(half["peaks_mib"]) / half["budget_mib"]
            cells.append(f"{half['budget_mib']:.1f}: {h:.1f} ({worst:.2f}x)")
        else:
            cells.append("-")
        cells.append(f"{least['first_peak_mib'] / plain['first_peak_mib']:.2f}x"
                     if least and plain else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[dict]) -> list[str]:
    """Issue 48's targets, each with its measurement."""
    out = []
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in rows):
        plain, block, least, half = (_find(rows, model, mode, s)
                                     for s in ("plain", "per-block", "min", "halfway"))
        where = f"{model} {MODE_NAMES.get(mode, mode)}"
        if least and block:
            m, b = _peak(least), _peak(block)
            # 5%: a tf.function step's peak moves by that much from step to step with
            # the executor's order (the same selection measured twice).
            out.append(f"{where}: min {m:.1f} MiB <= per-block {b:.1f} MiB (+5%): "
                       f"{'met' if m <= b * 1.05 else 'NOT met'} ({m / b:.3f}x)")
        if half:
            worst = max(half["peaks_mib"]) / half["budget_mib"]
            out.append(f"{where}: halfway budget {half['budget_mib']:.1f} MiB accepted, "
                       f"every step <= 1.05x: {'met' if worst <= 1.05 else 'NOT met'} "
                       f"({worst:.3f}x)")
        if least and plain:
            ratio = least["first_peak_mib"] / plain["first_peak_mib"]
            out.append(f"{where}: first (planning) step {least['first_peak_mib']:.1f} MiB "
                       f"<= 1.1x plain's first {plain['first_peak_mib']:.1f}: "
                       f"{'met' if ratio <= 1.1 else 'NOT met'} ({ratio:.3f}x)")
    for model in dict.fromkeys(r["model"] for r in rows):
        graph, xla = _find(rows, model, "graph", "min"), _find(rows, model, "xla", "min")
        if graph and xla:
            ratio = _peak(xla) / _peak(graph)
            out.append(f"{model}: XLA min {_peak(xla):.1f} MiB <= 1.25x tf.function min "
                       f"{_peak(graph):.1f}: {'met' if ratio <= 1.25 else 'NOT met'} "
                       f"({ratio:.2f}x)")
    return out


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "whole_model_user_path.json").write_text(json.dumps(rows, indent=1) + "\n")
    errors = [f"- {r['model']} {r['mode']} {r['strategy']}: {r['error']}"
              for r in rows if "error" in r]
    details = ["| model | mode | strategy | first step MiB | first step s | "
               "peaks MiB | plan |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            continue
        plan = (f"{r['regions']} regions, {r['blocks']} blocks, predicted "
                f"{r['predicted_mib']:.1f}" if "regions" in r else "")
        details.append(f"| {r['model']} | {MODE_NAMES.get(r['mode'], r['mode'])} | "
                       f"{r['strategy']} | {r['first_peak_mib']:.1f} | "
                       f"{r['first_seconds']:.1f} | "
                       f"{', '.join(f'{p:.1f}' for p in r['peaks_mib'])} | {plan} |")
    text = "\n\n".join([
        "# Whole models on the user's path: `compile(jit_compile=...)` + `train_on_batch`",
        "Written by `benchmarks/whole_model/user_path.py` (what each column measures: its "
        "docstring). Each strategy in a process of its own, applied as the README shows; "
        "no plan made ahead: `budget=` plans on the first `train_on_batch`. Peaks in MiB "
        "(BFC allocator, above what was allocated before the step), the median of five "
        "steps after the first.",
        table(rows),
        "## Targets (issue 48)",
        "\n".join(f"- {t}" for t in targets(rows)) or "- none measured",
        "## Every run",
        "\n".join(details),
    ] + (["## Errors", "\n".join(errors)] if errors else []))
    (out / "whole_model_user_path.md").write_text(text + "\n")
