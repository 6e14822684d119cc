"""One chain, two planners: ``CheckpointedSequential`` (rotor) against
``apply_checkpointing`` (the whole-model region program) on the same layers.

A chain of layers can be planned two ways: ``CheckpointedSequential(layers,
budget=...)`` runs rotor's dynamic program (Beaumont et al. 2019) over the
chain, with checkpoints nested to any depth, and ``apply_checkpointing(model,
budget=...)`` on a ``keras.Sequential`` of the same layers runs the region
program of whole models (regions of consecutive calls, nested one level). This
measures both as users train: ``compile(jit_compile=...)`` then
``train_on_batch``, each strategy in a fresh process (peaks depend on what the
allocator's pool holds), at the least budget and halfway between it and plain's
peak (the region planner's figures, planned once per mode, for both), under ``tf.function`` and
XLA. Peaks are the allocator's above where a step starts; step times are the
median of several steps, as ratios against plain measured on the same machine
(a noisy one: the ratios move by ~10% between runs).

Usage:
    python benchmarks/chain/two_planners.py            # 64 layers
    python benchmarks/chain/two_planners.py --tiny     # 8 small layers, seconds
    python benchmarks/chain/two_planners.py --update-results
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402  (sets the allocator before TensorFlow starts)

FULL = dict(num_layers=64, batch=2048, width=64, steps=7)
TINY = dict(num_layers=8, batch=64, width=32, steps=2)
MODES = ("graph", "xla")
STRATEGIES = ("plain", "region-min", "rotor-min", "region-half", "rotor-half")


def _layers(config: dict) -> list:
    import keras

    keras.utils.set_random_seed(0)
    width = config["width"]
    return [keras.layers.Dense(4 * width if i % 2 == 0 else width,
                               activation="relu" if i % 2 == 0 else None)
            for i in range(config["num_layers"])]


def worker(mode: str, strategy: str, config: dict) -> dict:
    """One strategy's run in this process: what ``train_on_batch`` peaks at and takes."""
    with _cli.quiet_start_up():
        import keras
        import numpy as np

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool

    grow_cpu_pool()  # XLA's one buffer counted at its size (docs/decisions/0026-cpu-pool.md)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((config["batch"], config["width"]), "float32")
    y = rng.standard_normal((config["batch"], config["width"]), "float32")
    planner, _, budget_kind = strategy.partition("-")
    layers = _layers(config)
    result: dict[str, Any] = {"mode": mode, "strategy": strategy}
    budget: Any = "min"
    if strategy == "budget":  # the region planner's figures, once per mode for both
        probe = keras.Sequential([keras.Input((config["width"],)), *layers])
        least = tc.plan_model(probe, x, budget="min", mode=mode)
        return {"budget": (least.min_budget_bytes + least.plain_peak_bytes) // 2}
    if budget_kind == "half":
        budget = config["half_budget"][mode]
        result["budget_mib"] = budget / 2**20
    if planner == "rotor":
        body = tc.CheckpointedSequential(layers, budget=budget)
        model = keras.Sequential([keras.Input((config["width"],)), body])
    else:
        model = keras.Sequential([keras.Input((config["width"],)), *layers])
        if planner == "region":
            tc.apply_checkpointing(model, budget=budget)
    model.compile(keras.optimizers.SGD(1e-3), "mse", jit_compile=mode == "xla")
    model.train_on_batch(x, y)  # the first step plans (and compiles)
    peaks, seconds = [], []
    for _ in range(config["steps"]):
        started = time.perf_counter()
        peaks.append(tc.debug.measure(lambda: model.train_on_batch(x, y)).peak_bytes)
        seconds.append(time.perf_counter() - started)
    result["peak_mib"] = max(peaks) / 2**20
    result["seconds"] = statistics.median(seconds)
    return result


def _run(mode: str, strategy: str, config: dict) -> dict:
    command = [sys.executable, __file__, "--worker", mode, strategy, json.dumps(config)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["?"]
        refused = [line for line in lines if "is below the least memory" in line]
        error = ("refused: the budget is below this planner's least" if refused
                 else lines[-1][:300])
        return {"mode": mode, "strategy": strategy, "error": error}
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> str:
    """The Markdown table: peaks and step times as ratios of plain's in each mode."""
    lines = ["| mode | strategy | budget (MiB) | peak (MiB) | peak / plain | time / plain |",
             "|---|---|---|---|---|---|"]
    plain = {r["mode"]: r for r in rows if r["strategy"] == "plain" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['strategy']} | | error: {r['error']} | | |")
            continue
        base = plain.get(r["mode"])
        budget = f"{r['budget_mib']:.1f}" if "budget_mib" in r else (
            "min" if r["strategy"].endswith("min") else "")
        ratios = (f"{r['peak_mib'] / base['peak_mib']:.2f} | {r['seconds'] / base['seconds']:.2f}"
                  if base else " | ")
        lines.append(f"| {r['mode']} | {r['strategy']} | {budget} | {r['peak_mib']:.1f} | "
                     f"{ratios} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="8 small layers, seconds")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        mode, strategy, config = args.worker
        print(json.dumps(worker(mode, strategy, json.loads(config))))
        return
    config = dict(TINY if args.tiny else FULL)
    modes = args.modes.split(",")
    config["half_budget"] = {mode: _run(mode, "budget", config)["budget"] for mode in modes}
    rows = [_run(mode, strategy, config) for mode in modes for strategy in STRATEGIES]
    table = report(rows)
    print(table)
    out = _cli.output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    name = "chain_planners_tiny" if args.tiny else "chain_planners"
    (out / f"{name}.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    (out / f"{name}.md").write_text(
        "# One chain, two planners\n\n`python benchmarks/chain/two_planners.py`: a "
        f"{config['num_layers']}-layer Dense chain, batch {config['batch']}, "
        "`compile(jit_compile=...)` + `train_on_batch`, each row in a fresh process; "
        "peaks the allocator's (largest of the measured steps), times the median step, "
        "both against plain's in the same mode and run.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
