"""Follow-up measurements for the whole-model benchmark (one model per run).

    python benchmarks/whole_model/followup.py resnet50 timing 21   # round-robin step time
    python benchmarks/whole_model/followup.py resnet50 least    # budget="min" peak
    python benchmarks/whole_model/followup.py resnet50 budget 0.25   # as a user runs it
    python benchmarks/whole_model/followup.py unet budget 0.5 --tiny   # 16x16: a few seconds

``timing [ROUNDS]``: plain and halfway-budget steps alternate (7 rounds by
default, medians), so a loaded machine slows both alike. ``least``: peak of plain and of the least
plan, with its prediction. ``budget F``: a user's run, in one process:
``apply_checkpointing(model, budget=...)`` at the fraction ``F`` of the way from
the least budget to plain, planned at the first training step, then the peaks of
five steps against the budget. Prints one JSON line; results of the committed run
are in ``results/whole_model_followup.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC, TF_CPP_MIN_LOG_LEVEL and TF_ENABLE_ONEDNN_OPTS.
from benchmarks import _cli  # noqa: E402

with _cli.quiet_start_up():
    import keras  # noqa: E402
    import tensorflow as tf  # noqa: E402

import tf_checkpointing as tc  # noqa: E402
from benchmarks.report import MIB  # noqa: E402
from benchmarks.whole_model.models import MODELS, build  # noqa: E402


def main(name: str, what: str, rounds: int = 7, fraction: float = 0.5,
         tiny: bool = False) -> None:
    model, batch_of, _, batch = build(name, tiny)
    x = batch_of(batch)
    model(x)
    optimizer = keras.optimizers.SGD(1e-3)

    def make_step():
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                out = tf.nest.flatten(model(x, training=True))
                loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32))) for o in out])
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        step(x).numpy()  # trace before applying another plan: it keeps its graph
        return step

    # Plans first, on the fresh allocator, as on a user's first step (and as
    # run.py makes them): per-call readings taken after other steps are larger.
    least = tc.plan_model(model, x, budget="min", mode="graph")
    if what == "budget":
        budget = int(least.min_budget_bytes + fraction * (least.plain_peak_bytes
                                                          - least.min_budget_bytes))
        tc.apply_checkpointing(model, budget=budget)
        ours = make_step()  # plans here, on the first training step
        peaks = [tc.debug.measure(lambda: ours(x).numpy()).peak_bytes / MIB for _ in range(5)]
        print(json.dumps({"model": name, "fraction": fraction, "budget_mib": budget / MIB,
                          "peaks_mib": [round(p, 1) for p in peaks],
                          "largest_x_budget": max(peaks) / (budget / MIB)}))
        return
    if what == "timing":
        half = tc.plan_model(model, x, mode="graph",
                             budget=(least.min_budget_bytes + least.plain_peak_bytes) // 2)
    plain = make_step()
    if what == "least":
        before = tc.debug.measure(lambda: plain(x).numpy()).peak_bytes
        tc.apply_checkpointing(model, plan=least)
        ours = make_step()
        print(json.dumps({"model": name, "plain": before / MIB,
                          "min": tc.debug.measure(lambda: ours(x).numpy()).peak_bytes / MIB,
                          "min_predicted": least.predicted_peak_bytes / MIB}))
        return
    tc.apply_checkpointing(model, plan=half)
    ours = make_step()
    times: dict[str, list[float]] = {"plain": [], "half": []}
    for _ in range(rounds):
        for key, step in (("plain", plain), ("half", ours)):
            started = time.perf_counter()
            step(x).numpy()
            times[key].append(time.perf_counter() - started)
    ratio = statistics.median(times["half"]) / statistics.median(times["plain"])
    print(json.dumps({"model": name, "ratio": ratio, "regions": len(half.regions),
                      "extra_forward": half.extra_forward_layers, "rounds": rounds,
                      "predicted_extra_ms": 1000 * (half.predicted_extra_seconds or 0),
                      "measured_extra_ms": 1000 * (statistics.median(times["half"])
                                                   - statistics.median(times["plain"]))}))


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("what", choices=("timing", "least", "budget"),
                        help="what to measure (see the module docstring)")
    parser.add_argument("value", nargs="?", type=float,
                        help="timing: rounds (default 7); budget: the fraction of the way "
                             "from the least budget to plain (default 0.5)")
    parser.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.what == "timing":
        main(args.model, args.what, rounds=int(args.value or 7), tiny=args.tiny)
    else:
        main(args.model, args.what, fraction=0.5 if args.value is None else args.value,
             tiny=args.tiny)
