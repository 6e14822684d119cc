"""Benchmark: ten budgets from the least to plain's peak, each trained through Keras.

    python benchmarks/whole_model/budget_sweep.py             # results/latest/budget_sweep.*
    python benchmarks/whole_model/budget_sweep.py --models unet --modes graph
    python benchmarks/whole_model/budget_sweep.py --tiny --out /tmp/sweep   # smoke test
    python benchmarks/whole_model/budget_sweep.py --rerender RESULTS.json

PyTorch's ``activation_memory_budget`` is the warning (pytorch#197838): its peak is not
monotonic in the budget. Here, for each model and mode, a first process trains the
model plainly and asks ``plan_model(model, x, budget="min", mode=...)`` for the least
budget and plain's peak; then each of ten budgets evenly spaced from the least to
plain's peak (highest first) is a training run of its own, in a fresh process, as a
user would run it: the model built from its constructor,
``apply_checkpointing(model, budget=b)``, ``model.compile(SGD, MSE, jit_compile=...)``
and ``train_on_batch``. The first call plans; the peaks of the five calls after it are
read with the allocator, and five more are timed (step times are against plain's
process: other processes on the machine move them).

The targets (issue 50): every step's peak at most 1.05x its budget, and a lower
budget's median step never more than 2% above a higher one's. Rises are reported
apart where the two budgets got the same plan: a plan traced anew, whose peak under
``tf.function`` moves with the executor's op order alone. The models are the
whole-model benchmark's (``models.py``): ResNet50 128x128 b16, MobileNetV2 128x128
b16, the U-Net and GPT2Backbone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402  (environment before TensorFlow starts)

MODELS = ("resnet50", "mobilenetv2", "unet", "gpt2")
MODES = ("graph", "xla")
BUDGETS = 10
PEAKS = 5  # calls read after each budget's first (planning) one
TIMED = 5  # calls timed after those (the median is the step time)
OVER_BUDGET = 1.05  # a peak at most this times its budget
RISE = 1.02  # a lower budget's peak at most this times a higher one's
MODE_NAMES = {"graph": "tf.function", "xla": "XLA"}


def worker(name: str, mode: str, tiny: bool, budget: Optional[int]) -> dict:
    """One training run, in this process: plain (``budget`` None; then also the
    least budget and plain's peak ``plan_model`` reports) or one budget."""
    with _cli.quiet_start_up():
        import keras
        import numpy as np
        import tensorflow as tf

        import tf_checkpointing as tc
        from benchmarks.whole_model.models import build
        from tf_checkpointing.core._memory import grow_cpu_pool

    grow_cpu_pool()  # XLA's one buffer counted at its size, as in the other benchmarks
    model, batch_of, _, batch = build(name, tiny)
    x = batch_of(batch)
    y = tf.nest.map_structure(np.zeros_like, model(x))
    row: dict[str, Any] = {"model": name, "mode": mode,
                           "budget_mib": None if budget is None else budget / 2**20}
    if budget is not None:
        tc.apply_checkpointing(model, budget=budget)
    model.compile(keras.optimizers.SGD(1e-3), "mse", jit_compile=mode == "xla")
    started = time.perf_counter()
    model.train_on_batch(x, y)
    row["first_seconds"] = time.perf_counter() - started
    row["peaks_mib"] = [tc.debug.measure(lambda: model.train_on_batch(x, y)).peak_bytes
                        / 2**20 for _ in range(PEAKS)]
    times = []
    for _ in range(TIMED):
        started = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - started)
    row["step_seconds"] = statistics.median(times)
    if budget is None:
        least = tc.plan_model(model, x, budget="min", mode=mode)
        row["least_bytes"], row["plain_bytes"] = least.min_budget_bytes, least.plain_peak_bytes
        return row
    plan = model.call.plan
    config = plan.to_config()
    row["regions"] = len(plan.regions)
    row["plan"] = hashlib.sha1(json.dumps([config["pieces"], config.get("blocks")]).encode(),
                               usedforsecurity=False).hexdigest()[:10]
    row["predicted_mib"] = plan.predicted_peak_bytes / 2**20
    row["predicted_step_s"] = plan.predicted_step_seconds
    row["least_mib"] = plan.min_budget_bytes / 2**20  # this process's own reading of it
    return row


def sweep(name: str, mode: str, tiny: bool) -> list[dict]:
    """Plain, then the ten budgets from its least to plain's peak, highest first,
    each in a fresh process."""
    plain = _run(name, mode, tiny, None)
    print(json.dumps(plain), flush=True)  # each row as it comes: a stopped run keeps them
    if "error" in plain:
        return [plain]
    low, high = plain["least_bytes"], plain["plain_bytes"]
    rows = [plain]
    for k in reversed(range(BUDGETS)):
        rows.append(_run(name, mode, tiny, int(low + (high - low) * k / (BUDGETS - 1))))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _mib(value: float) -> str:
    """MiB to one decimal, or three digits where that would round to nothing (--tiny)."""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def table(rows: list[dict]) -> str:
    """The sweep as Markdown: a line per budget, the targets below.

    Example:
        >>> rows = [dict(model="unet", mode="graph", budget_mib=b, peaks_mib=[p], plan=r,
        ...              step_seconds=s, regions=r, predicted_mib=p, predicted_step_s=s)
        ...         for b, p, s, r in ((None, 10, 1.0, 0), (9, 8, 1.1, 1), (5, 5.5, 1.3, 2))]
        >>> text = table(rows)
        >>> print(text.splitlines()[4])
        | unet | tf.function | 5 | 2 | 5.5 (0.55x) | 1.10x | 5.5 | 5.5 | 1.30x | 1.30x |
        >>> print(text.splitlines()[-3])
        - unet tf.function: every step at most 1.05x its budget: NOT met (largest 1.10x, at 5 MiB)
        >>> [line.rsplit(": ", 1)[1] for line in text.splitlines()[-2:]]
        ['met (largest 0.688x, at 5 MiB)', 'met (largest 1.000x)']
    """
    lines = ["| model | mode | budget MiB | regions | largest step MiB (x plain) | "
             "largest / budget | median step MiB | predicted MiB | step x plain | "
             "predicted step x plain |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    targets = []
    for model, mode in dict.fromkeys((r["model"], r["mode"]) for r in rows):
        group = [r for r in rows if (r["model"], r["mode"]) == (model, mode)]
        plain = next((r for r in group if r["budget_mib"] is None and "error" not in r), None)
        budgets = [r for r in group if r["budget_mib"] is not None and "error" not in r]
        mode_name = MODE_NAMES[mode]
        if plain is None or not budgets:
            error = next((r["error"] for r in group if "error" in r), "no rows")
            targets.append(f"- {model} {mode_name}: not measured ({error})")
            continue
        base, base_s = max(plain["peaks_mib"]), plain["step_seconds"]
        lines.append(f"| {model} | {mode_name} | plain | - | {_mib(base)} | - | "
                     f"{_mib(statistics.median(plain['peaks_mib']))} | - | 1.00x | - |")
        for r in group:
            if r["budget_mib"] is not None and "error" in r:
                error = re.sub(r"\x1b\[[0-9;]*m", "", r["error"])  # a terminal's bold
                lines.append(f"| {model} | {mode_name} | {_mib(r['budget_mib'])} | "
                             f"failed: {error} |||||||")
                targets.append(f"- {model} {mode_name}: the budget of {_mib(r['budget_mib'])} "
                               f"MiB trains: NOT met ({error})")
        for r in budgets:
            peak = max(r["peaks_mib"])
            predicted = r.get("predicted_step_s")
            lines.append(
                f"| {model} | {mode_name} | {_mib(r['budget_mib'])} | {r['regions']} | "
                f"{_mib(peak)} ({peak / base:.2f}x) | {peak / r['budget_mib']:.2f}x | "
                f"{_mib(statistics.median(r['peaks_mib']))} | {_mib(r['predicted_mib'])} | "
                f"{r['step_seconds'] / base_s:.2f}x | "
                + (f"{predicted / base_s:.2f}x |" if predicted else "- |"))
        lowest = min((r for r in group if r["budget_mib"] is not None),
                     key=lambda r: r["budget_mib"])
        if "least_mib" in lowest:  # the least budget of plain's process, read again here
            # (where it failed, its error row says so above)
            targets.append(
                f"- {model} {mode_name}: the least budget plain's process reported trains: met "
                f"({_mib(lowest['budget_mib'])} MiB; its own process read "
                f"{_mib(lowest['least_mib'])}, {lowest['least_mib'] / lowest['budget_mib']:.3f}x)")
        over = max(budgets, key=lambda r: max(r["peaks_mib"]) / r["budget_mib"])
        ratio = max(over["peaks_mib"]) / over["budget_mib"]
        targets.append(f"- {model} {mode_name}: every step at most {OVER_BUDGET}x its budget: "
                       f"{'met' if ratio <= OVER_BUDGET else 'NOT met'} (largest "
                       f"{ratio:.2f}x, at {_mib(over['budget_mib'])} MiB)")
        # Rises of the median step: between two plans, and between two budgets that
        # got the same plan (traced anew: the executor's order alone).
        rises = [(statistics.median(lower["peaks_mib"]) / statistics.median(higher["peaks_mib"]),
                  lower["budget_mib"], lower.get("plan") == higher.get("plan"))
                 for i, lower in enumerate(budgets) for higher in budgets[:i]]
        for same, kind in ((False, "another plan"), (True, "the same plan")):
            rise, at, _ = max((item for item in rises if item[2] is same),
                              default=(1.0, None, same))
            targets.append(
                f"- {model} {mode_name}: a lower budget's median step at most {RISE}x a higher "
                f"one's, {kind}: {'met' if rise <= RISE else 'NOT met'} (largest {rise:.3f}x"
                + (f", at {_mib(at)} MiB)" if at else ")"))
    return "\n".join(lines + ["", "## Targets (issue 50)", ""] + targets) + "\n"


def write(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "budget_sweep.md").write_text(report(rows))


def report(rows: list[dict]) -> str:
    """The Markdown page: its title, what it measures, the table and targets."""
    return ("# Ten budgets from the least to plain's peak, through Keras\n\n"
            "Written by `benchmarks/whole_model/budget_sweep.py` (what it does: its "
            "docstring). Each budget a training run in a fresh process. Peaks in MiB (BFC "
            "allocator, above what was allocated before the step) of the five steps after "
            "the planning one: the largest against the budget, the median against the other "
            "budgets. Step times the median of five, against plain's process.\n\n"
            + table(rows))


def _run(name: str, mode: str, tiny: bool, budget: Optional[int]) -> dict:
    command = [sys.executable, __file__, "--worker", name, mode, str(budget)]
    return {"model": name, "mode": mode, "budget_mib": None if budget is None else budget / 2**20,
            **_cli.worker_result(command + (["--tiny"] if tiny else []))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--tiny", action="store_true", help="small models: a smoke test")
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "BUDGET"),
                        help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    _cli.add_rerender_argument(parser)
    args = parser.parse_args(argv)
    if args.worker:
        name, mode, budget = args.worker
        print(json.dumps(worker(name, mode, args.tiny, None if budget == "None" else int(budget))))
        return
    if args.rerender:
        write(json.loads(args.rerender.read_text()), args.rerender.parent)
        return
    out = _cli.output_dir(args)
    rows: list[dict] = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            rows += sweep(name, mode, args.tiny)
            write(rows, out)


if __name__ == "__main__":
    main()
