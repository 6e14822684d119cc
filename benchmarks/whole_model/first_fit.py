"""Benchmark: the first ``fit`` call of a keras.applications model, planning included.

    python benchmarks/whole_model/first_fit.py               # DenseNet121, XLA, plain and min
    python benchmarks/whole_model/first_fit.py --model ResNet50 --size 64 --no-jit

A user's first training call pays for tracing, compiling and, with
``apply_checkpointing(model, budget=...)``, planning. Each configuration runs in a
process of its own (``--worker``), as a user's run: the model built from its
constructor (random weights), compiled with SGD and momentum (``jit_compile=True``
unless ``--no-jit``), checkpointed with ``apply_checkpointing(model, budget="min")`` or
not, and ``fit`` for one step. Printed per configuration, one JSON line on stdout: the
first ``fit`` call's wall time, the process's largest resident memory (``ru_maxrss``)
and the plan's first line; then the ratios to plain; the planner's progress lines (with
their times) on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402  (environment before TensorFlow starts)


def worker(model_name: str, size: int, batch: int, jit: bool, budget: str) -> dict:
    import resource

    with _cli.quiet_start_up():
        import keras
        import numpy as np

        import tf_checkpointing as tc

    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, model_name)(weights=None, input_shape=(size, size, 3),
                                                    classes=10)
    model.compile(keras.optimizers.SGD(1e-3, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(), jit_compile=jit)
    if budget != "plain":
        tc.apply_checkpointing(model, budget=budget)
    rng = np.random.default_rng(0)
    x = rng.random((batch, size, size, 3), np.float32)
    y = rng.integers(0, 10, batch)
    started = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    seconds = time.perf_counter() - started
    plan = getattr(model.call, "plan", None) if budget != "plain" else None
    return dict(model=model_name, size=size, batch=batch, jit=jit, budget=budget,
                first_fit_s=round(seconds, 1),
                max_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                plan=None if plan is None else str(plan).splitlines()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="DenseNet121", help="a keras.applications name")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-jit", action="store_true", help="tf.function, not XLA")
    parser.add_argument("--budgets", default="plain,min",
                        help="comma-separated: plain, min, or bytes")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.model, args.size, args.batch, not args.no_jit,
                                args.worker)))
        return
    rows = []
    for budget in args.budgets.split(","):
        command = [sys.executable, __file__, "--model", args.model, "--size", str(args.size),
                   "--batch", str(args.batch), "--worker", budget]
        if args.no_jit:
            command.append("--no-jit")
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ),
                              check=False)
        if done.returncode != 0:
            raise SystemExit(f"{budget}: {done.stderr[-3000:]}")
        for line in done.stderr.splitlines():  # the planner's progress, with its times
            if line.startswith("apply_checkpointing:"):
                print(line, file=sys.stderr)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    plain = next((r for r in rows if r["budget"] == "plain"), None)
    for row in rows:
        if plain is not None and row is not plain:
            print(f"{row['budget']}: first fit {row['first_fit_s'] / plain['first_fit_s']:.2f}x "
                  f"plain's, resident memory {row['max_rss_mib'] / plain['max_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
