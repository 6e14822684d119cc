"""The whole-model benchmark's table, target checks, JSON and plot (`run.py` writes
them after a run, `run.py --rerender` again from its JSON), through the shared
`benchmarks/report.py`.

Example:
    >>> rows = [dict(model="m", strategy="plain", xla=False, peak_mib=10.0, step_s=1.0),
    ...         dict(model="m", strategy="budget=min", xla=False, peak_mib=4.0, step_s=1.3,
    ...              budget_mib=4.2, predicted_mib=4.1, fraction=0.0)]
    >>> print(markdown_table(rows).splitlines()[2][:51])
    | m | plain | tf.function | - | 10.0 | - | - | 1.00
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Optional

from benchmarks.report import cell, environment, pyplot, save_figure, table

# peak MiB: the median of the measured steps' peaks (the allocator's chunks); max MiB:
# the largest of them; tensors MiB: the peak of the requested bytes of one more step
# (what the planner models; see peaks.py).
_HEAD = ("model", "strategy", "step", "budget MiB", "peak MiB", "max MiB", "tensors MiB",
         "peak x plain", "predicted MiB", "predicted / measured", "predicted / tensors",
         "step x plain", "regions", "plan s")


def _plain(rows: list[dict], model: str, xla: bool) -> Optional[dict]:
    return next((r for r in rows if r["model"] == model and r["strategy"] == "plain"
                 and r.get("xla") == xla and "peak_mib" in r), None)


def _speed(row: dict, plain: dict) -> float:
    """Step time x plain: the interleaved rounds' median where they ran (one process
    timing both, so the machine's load cancels), else the two processes' medians."""
    return row.get("step_x_plain_interleaved") or row["step_s"] / plain["step_s"]


def markdown_table(rows: list[dict]) -> str:
    """One row per strategy measured (a failed model: one short row with its error)."""
    return table(_HEAD, (_cells(r, rows) for r in rows))


def _cells(r: dict, rows: list[dict]) -> list[str]:
    if "peak_mib" not in r:
        return [r["model"], r["strategy"], "-",
                f"failed: {r.get('error', '')[-200:].splitlines()[-1:]}"]
    plain = _plain(rows, r["model"], r.get("xla", False))
    pred, tensors = r.get("predicted_mib"), r.get("tensor_peak_mib")
    batch = f" (batch {r['batch']})" if "batch" in r else ""
    return [r["model"], r["strategy"] + batch, "XLA" if r.get("xla") else "tf.function",
            cell(r.get("budget_mib"), "{:.1f}"), f"{r['peak_mib']:.1f}",
            cell(r.get("peak_max_mib"), "{:.1f}"), cell(tensors, "{:.1f}"),
            cell(r["peak_mib"] / plain["peak_mib"] if plain else None, "{:.2f}"),
            cell(pred, "{:.1f}"), cell(pred / r["peak_mib"] if pred else None, "{:.2f}"),
            cell(pred / tensors if pred and tensors else None, "{:.2f}"),
            cell(_speed(r, plain) if plain else None, "{:.2f}"),
            cell(r.get("regions"), "{:d}"), cell(r.get("plan_s"), "{:.1f}")]


def targets(rows: list[dict], parallel: int = 1) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for each issue-13 target the rows can answer."""
    out = []

    def find(model: str, strategy: str, xla: bool = False) -> Optional[dict]:
        return next((r for r in rows if r["model"] == model and r["strategy"] == strategy
                     and r.get("xla", False) == xla and "peak_mib" in r), None)

    for model in ("resnet50", "unet"):
        least, hand = find(model, "budget=min"), find(model, "hand-written per-block")
        if least and hand:
            ratio = least["peak_mib"] / hand["peak_mib"]
            out.append((f"{model}: budget='min' peak <= 0.8x hand-written per-block",
                        f"{ratio:.2f}x ({least['peak_mib']:.0f} vs {hand['peak_mib']:.0f} MiB)",
                        ratio <= 0.8))
        per_layer = [r for r in rows if r["model"] == model
                     and r["strategy"].startswith("per-layer") and "peak_mib" in r]
        if least and per_layer:
            lowest = min(per_layer, key=lambda r: r["peak_mib"])
            out.append((f"{model}: budget='min' below every per-layer selection",
                        f"{least['peak_mib']:.0f} MiB vs {lowest['peak_mib']:.0f} "
                        f"({lowest['strategy']})", least["peak_mib"] < lowest["peak_mib"]))
    for r in rows:
        if r.get("budget_mib") is None or "peak_mib" not in r or r["strategy"] == "budget=min":
            continue
        where = f"{r['model']} {r['strategy']}{' XLA' if r.get('xla') else ''}"
        # Every step must fit the budget: the largest of the measured steps' peaks.
        over = r.get("peak_max_mib", r["peak_mib"]) / r["budget_mib"]
        out.append((f"{where}: every step's peak <= 1.05x budget", f"{over:.2f}x",
                    over <= 1.05))
        if r.get("predicted_mib"):
            err = r["predicted_mib"] / r["peak_mib"] - 1
            out.append((f"{where}: predicted within 10%", f"{err:+.0%}", abs(err) <= 0.10))
            if r.get("tensor_peak_mib"):  # not a target: where the error comes from
                err = r["predicted_mib"] / r["tensor_peak_mib"] - 1
                out.append((f"{where}: (predicted within 10% of the tensors' peak)",
                            f"{err:+.0%}", abs(err) <= 0.10))
    for model in sorted({r["model"] for r in rows}):
        for xla in (False, True):
            half, plain = find(model, "budget 0.50", xla), _plain(rows, model, xla)
            if half and plain:
                speed = _speed(half, plain)
                out.append((f"{model}{' XLA' if xla else ''}: halfway budget step time <= 1.2x "
                            "plain", f"{speed:.2f}x", speed <= 1.2))
    for r in rows:  # issue 50: half of plain's peak, at most 1.10x its step time
        if r["strategy"] == "budget 1/2 plain":
            where = f"{r['model']}{' XLA' if r.get('xla') else ''}"
            plain = _plain(rows, r["model"], r.get("xla", False))
            if "peak_mib" not in r or not plain:
                out.append((f"{where}: budget 1/2 plain: step <= 1.10x plain, peak <= "
                            "0.525x plain", r.get("error", "not measured"), False))
                continue
            speed, share = _speed(r, plain), r["peak_mib"] / plain["peak_mib"]
            out.append((f"{where}: budget 1/2 plain: step <= 1.10x plain, peak <= 0.525x "
                        "plain", f"{speed:.2f}x, peak {share:.3f}x",
                        speed <= 1.10 and share <= 0.525))
    for r in rows:  # policies on the decoder at half the plain peak
        if r["strategy"] == "budget 1/2 plain policies=auto" and "peak_mib" in r:
            plain = _plain(rows, r["model"], False)
            speed = _speed(r, plain) if plain else float("nan")
            out.append((f"{r['model']}: budget 1/2 plain with policies: step <= 1.15x plain "
                        "within the budget", f"{speed:.2f}x, peak "
                        f"{r['peak_mib'] / r['budget_mib']:.2f}x budget",
                        speed <= 1.15 and r["peak_mib"] <= r["budget_mib"]))
    big = find("resnet50", "budget=min, batch x2.5")
    if big:
        out.append(("resnet50: batch 40 (2.5x) fits plain's batch-16 peak",
                    f"{big['peak_mib']:.0f} vs {big['plain_batch16_peak_mib']:.0f} MiB",
                    big["peak_mib"] <= big["plain_batch16_peak_mib"]))
    for model in sorted({r["model"] for r in rows}):  # issue 33: XLA saves what tf.function does
        for strategy in ("budget=min", "hand-written per-block"):
            graph, xla = find(model, strategy), find(model, strategy, xla=True)
            if graph and xla:
                ratio = xla["peak_mib"] / graph["peak_mib"]
                out.append((f"{model} {strategy}: XLA peak <= 1.25x tf.function's",
                            f"{ratio:.2f}x ({xla['peak_mib']:.1f} vs {graph['peak_mib']:.1f} MiB)",
                            ratio <= 1.25))
        for xla in (False, True):  # per-block: apply_checkpointing(model, [Block])
            least, hand = (find(model, "budget=min", xla=xla),
                           find(model, "hand-written per-block", xla=xla))
            if model == "gpt2" and least and hand:
                out.append(_at_most_the_blocks(model, xla, least, hand))
    least = find("resnet50", "budget=min")
    if least and least.get("plan_s") is not None:
        load = "" if parallel <= 1 else ", shared with another model"
        out.append((f"resnet50: planning < 60 s (2 cores{load})",
                    f"{least['plan_s']:.0f} s", least["plan_s"] < 60))
    return out


def _at_most_the_blocks(model: str, xla: bool, least: dict,
                        hand: dict) -> tuple[str, str, bool]:
    """The target that ``budget="min"`` is never above the per-block selection.
    When the planner chose the blocks' own regions, both rows ran one plan, each in
    a process of its own, and their peaks differ only by the executor's op order
    between processes (docs/decisions/0021-least-plan-against-the-blocks.md): the
    target holds by construction and says so."""
    where = f"{model}{' XLA' if xla else ''}: budget='min' <= per-block selection"
    peaks = f"{least['peak_mib']:.1f} vs {hand['peak_mib']:.1f} MiB"
    if least.get("pieces") is not None and least.get("pieces") == hand.get("pieces"):
        return where, f"the blocks' own regions ({peaks}, one plan in two processes)", True
    return where, peaks, least["peak_mib"] <= hand["peak_mib"]


def write(rows: list[dict], out: Path, parallel: int = 1, write_json: bool = True) -> None:
    """The table, targets and plot of ``rows`` (measured ``parallel`` models at once)
    as ``out`` + ``.md`` and ``.png``, and the rows as ``.json`` unless ``write_json``
    is False (written again from that JSON)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if write_json:
        out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    checks = targets(rows, parallel)
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")
    shared = ("one model at a time" if parallel <= 1
              else f"{parallel} models at once, sharing the cores")
    text = [f"# Whole-model checkpointing\n\nTensorFlow {_tensorflow_version()}, "
            f"{platform.machine()}, CPU, oneDNN {onednn}, 2 cores, {shared} (step times "
            "are same-run ratios; absolute times are not meaningful).\n",
            markdown_table(rows), "\n## Targets\n",
            table(["target", "measured", "met"],
                     ([t, m, "PASS" if ok else "FAIL"] for t, m, ok in checks))]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")
    _plot(rows, out.with_suffix(".png"))
    print("\n".join(text))


def _tensorflow_version() -> str:
    """Read from the installed package: the parent process, which writes the report,
    need not load TensorFlow (the workers measured)."""
    try:
        return importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:  # tensorflow-cpu, a nightly: ask it
        return environment()["tensorflow"]


def _plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    models = sorted({r["model"] for r in rows if "peak_mib" in r})
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(4.5 * max(1, len(models)), 4),
                             squeeze=False)
    for ax, model in zip(axes[0], models):
        plain = _plain(rows, model, False)
        if not plain:
            continue
        mine = [r for r in rows if r["model"] == model and not r.get("xla") and "peak_mib" in r
                and r.get("fraction") is not None]
        mine.sort(key=lambda r: r["fraction"])
        ax.plot([r["peak_mib"] / plain["peak_mib"] for r in mine],
                [_speed(r, plain) for r in mine], "o-", label="budget plans")
        for r in rows:
            if r["model"] != model or r.get("xla") or "peak_mib" not in r or r in mine:
                continue
            if "batch" in r:
                continue
            marker = "s" if r["strategy"] == "plain" else ("D" if "hand" in r["strategy"]
                                                            else "x")
            ax.plot(r["peak_mib"] / plain["peak_mib"], _speed(r, plain), marker,
                    label=r["strategy"])
        ax.set_title(model)
        ax.set_xlabel("peak memory x plain")
        ax.set_ylabel("step time x plain")
        ax.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path)
