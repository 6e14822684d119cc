"""Follow-up measurements for the whole-model benchmark (one model per run).

    python benchmarks/whole_model_followup.py resnet50 timing 21   # round-robin step time
    python benchmarks/whole_model_followup.py resnet50 least    # budget="min" peak
    python benchmarks/whole_model_followup.py resnet50 budget 0.25   # as a user runs it

``timing [ROUNDS]``: plain and halfway-budget steps alternate (7 rounds by
default, medians), so a loaded machine slows both alike. ``least``: peak of plain and of the least
plan, with its prediction. ``budget F``: a user's run, in one process:
``apply_checkpointing(model, budget=...)`` at the fraction ``F`` of the way from
the least budget to plain, planned at the first training step, then the peaks of
five steps against the budget. Prints one JSON line; results of the committed run
are in ``results/whole_model_followup.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")  # as benchmarks/_cli.py: host-independent peaks
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_checkpointing as tc  # noqa: E402
from benchmarks.whole_model import build  # noqa: E402


def main(name: str, what: str, rounds: int = 7, fraction: float = 0.5) -> None:
    if what not in ("timing", "least", "budget"):
        raise SystemExit(f"whole_model_followup.py: expected timing, least or budget after "
                         f"the model name; received {what!r} (see the module docstring)")
    model, batch_of, _, batch = build(name, False)
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
    # whole_model.py makes them): per-call readings taken after other steps are larger.
    least = tc.plan_model(model, x, budget="min", mode="graph")
    if what == "budget":
        budget = int(least.min_budget_bytes + fraction * (least.plain_peak_bytes
                                                          - least.min_budget_bytes))
        tc.apply_checkpointing(model, budget=budget)
        ours = make_step()  # plans here, on the first training step
        peaks = [tc.peak_memory(lambda: ours(x).numpy()) / 2**20 for _ in range(5)]
        print(json.dumps({"model": name, "fraction": fraction, "budget_mib": budget / 2**20,
                          "peaks_mib": [round(p, 1) for p in peaks],
                          "largest_x_budget": max(peaks) / (budget / 2**20)}))
        return
    if what == "timing":
        half = tc.plan_model(model, x, mode="graph",
                             budget=(least.min_budget_bytes + least.plain_peak_bytes) // 2)
    plain = make_step()
    if what == "least":
        before = tc.peak_memory(lambda: plain(x).numpy())
        tc.apply_checkpointing(model, plan=least)
        ours = make_step()
        print(json.dumps({"model": name, "plain": before / 2**20,
                          "min": tc.peak_memory(lambda: ours(x).numpy()) / 2**20,
                          "min_predicted": least.predicted_peak_bytes / 2**20}))
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
    print(json.dumps({"model": name, "ratio": ratio, "regions": len(half.spans),
                      "extra_forward": half.extra_forward_layers, "rounds": rounds,
                      "predicted_extra_ms": 1000 * (half.predicted_extra_seconds or 0),
                      "measured_extra_ms": 1000 * (statistics.median(times["half"])
                                                   - statistics.median(times["plain"]))}))


if __name__ == "__main__":
    name, what, *rest = sys.argv[1:]
    if what == "timing":  # timing [ROUNDS]
        main(name, what, rounds=int(rest[0]) if rest else 7)
    else:  # budget F
        main(name, what, fraction=float(rest[0]) if rest else 0.5)
