"""Where do the checkpoints go: segments and planned budgets on a 64-layer chain.

One run measures, on the same chain, weights and batch:

1. strategies: plain backprop, every layer checkpointed separately
   (``checkpointable(layer)``), and ``checkpoint_sequential(segments="sqrt")``:
   peak memory in eager and tf.function (mode "graph"), step time in tf.function
   (fastest of round-robin rounds, so load from other processes hits all alike and
   least; the median is in the JSON), and the largest gradient difference from plain;
2. plans: ``plan_sequential`` for budgets from the least feasible memory up to the
   plain step's peak (and one above it), in eager and tf.function, each planned
   for its mode: the budget, the predicted and the measured peak, and the
   recomputation it chose.

The chain is an MLP stack of unequal layers: ``Dense(4w, relu)`` then ``Dense(w)``,
32 times, so a layer's activations differ 4x from its neighbour's and the
planner has something to place (batch 2048, w=64: activations of 2 MiB and
0.5 MiB, kernels of 64 KiB). Memory is the allocator's peak during one training
step above what is allocated before it (weights, the batch), read with
TensorFlow's BFC allocator (set below, before TensorFlow is imported).

Each mode gets its own plans: ``plan_sequential(mode="eager")`` for the eager
steps and ``mode="graph"`` for the tf.function steps (a graph keeps fewer
intermediates, so the same budget recomputes less), each checked against the
peaks measured in that mode. The allocator counts whole blocks: once a
tensor kept alive between steps pins a block in the middle of its free memory,
a block handed out later may be up to twice the tensor it holds, and peaks
rise by up to ~20%. So nothing measured here keeps a tensor between steps (the
reference gradients are NumPy copies), the plans are measured first, and the
planner keeps 10% of each budget free for what it cannot see.

Usage:
    python benchmarks/chain/sequential.py          # 64 layers, < 2 min on 2 cores
    python benchmarks/chain/sequential.py --tiny   # 8 small layers, a few seconds
    python benchmarks/chain/sequential.py --out /tmp/results

Prints the tables with pass/fail and writes ``sequential.json`` (``sequential_tiny.json``
with --tiny) to --out (default benchmarks/results/latest/, ignored by git;
--update-results: the committed benchmarks/results/). Other scripts call
:func:`run_benchmark`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC and TF_CPP_MIN_LOG_LEVEL: before TensorFlow is imported.
from benchmarks import _cli  # noqa: E402

with _cli.quiet_start_up():
    import keras  # noqa: E402
    import numpy as np  # noqa: E402
    import tensorflow as tf  # noqa: E402

from benchmarks.report import MIB, environment, table, write_json  # noqa: E402
from tf_checkpointing import checkpoint_sequential, checkpointable  # noqa: E402
from tf_checkpointing.plans import plan_sequential  # noqa: E402

DEVICE = "CPU:0"
TARGETS = {
    "sqrt_vs_every_layer_peak": 0.6,   # sqrt segments peak / every-layer peak, at most
    "sqrt_vs_plain_time": 1.4,         # sqrt step time / plain (tf.function), at most
    "plan_peak_vs_budget": 1.15,       # measured peak / budget, at most
    "plan_prediction_error": 0.25,     # |predicted - measured| / measured, at most
}
FULL = dict(num_layers=64, batch=2048, width=64, budgets=6, repeats=11)
TINY = dict(num_layers=8, batch=64, width=32, budgets=3, repeats=2)
MODES = ("eager", "graph")  # eager steps and tf.function steps, as the library names them


def build_chain(num_layers: int, width: int, seed: int = 0) -> list[keras.layers.Layer]:
    """``num_layers`` Dense layers alternating ``4 * width`` (relu) and ``width``."""
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(4 * width if i % 2 == 0 else width,
                               activation="relu" if i % 2 == 0 else None, name=f"dense_{i}")
            for i in range(num_layers)]


def make_step(runner: Callable[[tf.Tensor], tf.Tensor], variables: list, mode: str) -> Callable:
    """One training step (loss, input and weight gradients) in ``mode``."""

    def step(x: tf.Tensor) -> list:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_mean(tf.square(runner(x)))
        return tape.gradient(loss, [x] + variables)

    return step if mode == "eager" else tf.function(step, jit_compile=(mode == "xla"))


def peak_bytes(step: Callable, x: tf.Tensor) -> int:
    """Peak allocator bytes of one ``step(x)`` above the level before it (after a
    first call that builds, plans and traces)."""
    step(x)
    tf.config.experimental.reset_memory_stats(DEVICE)
    start = tf.config.experimental.get_memory_info(DEVICE)["current"]
    step(x)
    return tf.config.experimental.get_memory_info(DEVICE)["peak"] - start


def _budgeted(layers: list, budget: int, x: tf.Tensor) -> tf.Tensor:
    return checkpoint_sequential(layers, x, budget=budget)


def _grad_error(actual: list, expected: list) -> float:
    worst = 0.0
    for a, e in zip(actual, expected):
        scale = float(np.max(np.abs(e))) or 1.0
        worst = max(worst, float(np.max(np.abs(np.asarray(a) - e))) / scale)
    return worst


def _step_times(steps: dict[str, Callable], x: tf.Tensor, repeats: int
                ) -> dict[str, list[float]]:
    """Seconds of ``repeats`` steps each, round-robin, so load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            result = step(x)
            float(tf.reduce_sum(result[0]))  # wait for the step to finish
            times[name].append(time.perf_counter() - started)
    return times


def run_benchmark(num_layers: int = 64, batch: int = 2048, width: int = 64, budgets: int = 6,
                  repeats: int = 11, progress: Optional[Callable[[str], None]] = None
                  ) -> dict[str, Any]:
    """Runs the whole benchmark; returns the results as a JSON-ready dict."""
    say = progress or (lambda message: None)
    started = time.perf_counter()
    layers = build_chain(num_layers, width)
    x = tf.random.stateless_normal([batch, width], seed=[0, 1])
    h = x
    for layer_ in layers:  # build the weights outside every measurement
        h = layer_(h)
    del h
    variables = [v for layer_ in layers for v in layer_.trainable_variables]
    each = [checkpointable(layer_) for layer_ in layers]

    def plain(x):
        for layer_ in layers:
            x = layer_(x)
        return x

    def every_layer(x):
        for layer_ in each:
            x = layer_(x, _checkpoint=True)
        return x

    runners = {"plain": plain, "every layer": every_layer,
               "sqrt segments": lambda x: checkpoint_sequential(layers, x, segments="sqrt")}
    # Kept as NumPy copies: a tensor kept alive from here would pin a block in the
    # middle of the allocator's free memory and fragment every later measurement.
    reference = [np.array(g, copy=True) for g in make_step(plain, variables, "eager")(x)]

    # Plans first, eager before tf.function: a long-running process fragments the
    # allocator, which inflates later peaks (see the module docstring). Each mode
    # gets plans made for it: eager for eager steps, "graph" for tf.function.
    plans, bounds = [], {}
    for mode in MODES:
        say(f"profiling the chain for {mode} steps")
        probe = plan_sequential(layers, x, budget=2**50, mode=mode)
        low, high = probe.min_budget_bytes, probe.plain_peak_bytes
        bounds[mode] = {"min_budget_bytes": low, "plain_peak_bytes": high}
        levels = [low + (high - low) * k / (budgets - 1) for k in range(budgets)]
        for budget in (int(level) for level in levels + [1.25 * high]):
            plan = plan_sequential(layers, x, budget=budget, mode=mode)
            say(f"{mode} plan for {budget / MIB:.1f} MiB: {plan.extra_forward_layers} extra "
                "forwards")
            # In a tf.function, checkpoint_sequential plans (mode "auto") for a graph:
            # the plan above, from the same profile.
            runner = functools.partial(_budgeted, layers, budget)
            plans.append({
                "mode": mode, "budget_bytes": budget,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "peak_bytes": peak_bytes(make_step(runner, variables, mode), x),
                "extra_forward_layers": plan.extra_forward_layers, "depth": plan.depth,
                "segments": plan.segments, "checkpointed": plan.checkpointed,
                "plan": str(plan)})

    strategies = {}
    for name, runner in runners.items():
        say(f"strategy {name}")
        row = {"grad_error": _grad_error(make_step(runner, variables, "eager")(x), reference)}
        for mode in MODES:
            row[f"peak_{mode}_bytes"] = peak_bytes(make_step(runner, variables, mode), x)
        strategies[name] = row
    say("timing plain vs sqrt segments (tf.function)")
    timed = {name: make_step(runners[name], variables, "graph")
             for name in ("plain", "sqrt segments")}
    for name, seconds in _step_times(timed, x, repeats).items():
        # The fastest round is the least disturbed by other processes (as timeit);
        # the median is kept too.
        strategies[name]["seconds_graph"] = min(seconds)
        strategies[name]["seconds_graph_median"] = statistics.median(seconds)
    payload = {
        "benchmark": "sequential",
        "config": dict(num_layers=num_layers, batch=batch, width=width, budgets=budgets,
                       repeats=repeats, chain="Dense(4w, relu) / Dense(w) alternating"),
        "environment": environment(),
        "planning": bounds, "strategies": strategies, "plans": plans,
    }
    payload["targets"] = check_targets(payload)
    payload["seconds"] = time.perf_counter() - started
    return payload


def check_targets(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its measured value and pass/fail."""
    s, checks = payload["strategies"], []

    def add(name: str, value: float, limit: float, passed: Optional[bool] = None) -> None:
        checks.append({"target": name, "value": value, "limit": limit,
                       "passed": bool(value <= limit) if passed is None else passed})

    for mode in MODES:
        add(f"sqrt peak / every-layer peak ({mode})",
            s["sqrt segments"][f"peak_{mode}_bytes"] / s["every layer"][f"peak_{mode}_bytes"],
            TARGETS["sqrt_vs_every_layer_peak"])
    add("sqrt time / plain time (tf.function, fastest of the rounds)",
        s["sqrt segments"]["seconds_graph"] / s["plain"]["seconds_graph"],
        TARGETS["sqrt_vs_plain_time"])
    add("gradient error, every strategy vs plain", max(r["grad_error"] for r in s.values()),
        1e-5)
    for mode in MODES:
        plans = [p for p in payload["plans"] if p["mode"] == mode]
        add(f"worst plan peak / budget ({mode})",
            max(p["peak_bytes"] / p["budget_bytes"] for p in plans),
            TARGETS["plan_peak_vs_budget"])
        add(f"worst plan |predicted - measured| / measured ({mode})",
            max(abs(p["predicted_peak_bytes"] - p["peak_bytes"]) / p["peak_bytes"]
                for p in plans), TARGETS["plan_prediction_error"])
        plain_peak = payload["planning"][mode]["plain_peak_bytes"]
        above = [p for p in plans if p["budget_bytes"] >= plain_peak]
        extra = sum(p["extra_forward_layers"] for p in above)
        add(f"extra forwards at budgets >= plain peak ({mode})", extra, 0,
            passed=extra == 0 and bool(above))
    return checks


def format_report(payload: dict[str, Any]) -> str:
    """The three tables of a run, as Markdown."""
    c, s = payload["config"], payload["strategies"]
    plain = s["plain"]

    def timing(row: dict[str, Any]) -> list[str]:
        seconds = row.get("seconds_graph")
        if not seconds:
            return ["-", "-"]
        return [f"{seconds * 1e3:.0f} / {row['seconds_graph_median'] * 1e3:.0f}",
                f"{seconds / plain['seconds_graph']:.2f}x"]

    strategies = table(
        ["strategy", "peak eager MiB", "peak tf.function MiB", "vs plain (graph)",
         "step ms (graph, fastest / median)", "vs plain", "grad error"],
        ([name, f"{row['peak_eager_bytes'] / MIB:.1f}", f"{row['peak_graph_bytes'] / MIB:.1f}",
          f"{row['peak_graph_bytes'] / plain['peak_graph_bytes']:.2f}x", *timing(row),
          f"{row['grad_error']:.1e}"] for name, row in s.items()))
    plans = table(
        ["mode", "budget MiB", "predicted", "measured", "measured / budget",
         "prediction error", "extra forwards", "depth", "top-level segments"],
        ([p["mode"], f"{p['budget_bytes'] / MIB:.1f}", f"{p['predicted_peak_bytes'] / MIB:.1f}",
          f"{p['peak_bytes'] / MIB:.1f}", f"{p['peak_bytes'] / p['budget_bytes']:.2f}",
          f"{abs(p['predicted_peak_bytes'] - p['peak_bytes']) / p['peak_bytes']:.0%}",
          p["extra_forward_layers"], p["depth"],
          f"{len(p['segments'])} ({sum(p['checkpointed'])} checkpointed)"]
         for p in payload["plans"]))
    targets = table(["target", "value", "limit", "result"],
                    ([t["target"], f"{t['value']:.3g}", t["limit"],
                      "pass" if t["passed"] else "FAIL"] for t in payload["targets"]))
    bounds = ", ".join(f"{mode} {b['min_budget_bytes'] / MIB:.1f} MiB, plain "
                       f"{b['plain_peak_bytes'] / MIB:.1f} MiB"
                       for mode, b in payload["planning"].items())
    return "\n".join([
        f"## checkpoint_sequential / plan_sequential: {c['num_layers']} layers "
        f"({c['chain']}, batch {c['batch']}, w={c['width']})", "", strategies, "",
        f"Plans, made for the mode they run in (least feasible budget: {bounds}):", "",
        plans, "", targets, f"\nRun time {payload['seconds']:.0f} s."])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="8 small layers, for the tests")
    _cli.add_output_arguments(parser)
    for name, default in FULL.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"default {default} ({TINY[name]} with --tiny)")
    args = parser.parse_args(argv)
    config = dict(TINY if args.tiny else FULL)
    config.update({k: getattr(args, k) for k in FULL if getattr(args, k) is not None})
    payload = run_benchmark(**config, progress=lambda m: print(f"  {m}", file=sys.stderr))
    print(format_report(payload))
    if args.tiny:
        print("(--tiny: shapes too small for the targets, which apply to the full run)")
    path = write_json(_cli.output_dir(args) / ("sequential_tiny.json" if args.tiny
                                               else "sequential.json"), payload)
    print(f"wrote {path}")
    return 0 if args.tiny or all(t["passed"] for t in payload["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
