"""Benchmark: EfficientNetB0 as a chain in ``CheckpointedSequential``, under ``fit``.

    python benchmarks/efficientnet_chain.py                 # plain and least, XLA and not
    python benchmarks/efficientnet_chain.py --budgets 433,522,612   # XLA budgets in MiB

``keras.applications.EfficientNetB0(weights=None)`` (128x128, 10 classes, batch 16)
is cut at every point where one tensor alone is alive (85 pieces, each a functional
sub-model) and run as ``CheckpointedSequential(pieces, budget=...)`` inside a model
trained with ``fit`` (SGD), with ``jit_compile=True`` or not; the plan is made while
the step is traced, so for XLA under ``jit_compile=True``. Each configuration runs
in a fresh process whose CPU pool is grown before anything else (see
``_memory.grow_cpu_pool``); the peak is one ``train_on_batch`` after a first ``fit``.
Prints one JSON line per configuration: measured peak, budget, the plan's prediction,
least budget and plain peak, all in MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402,F401 - TensorFlow's environment, before it starts

MIB = 2**20


def pieces() -> list[Any]:
    """EfficientNetB0 cut into sub-models between its single-tensor points."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(128, 128, 3),
                                              classes=10)
    layers = model.layers
    last_read: dict[int, int] = {}  # id of a tensor -> index of the last layer reading it
    for i, layer in enumerate(layers):
        for node in layer._inbound_nodes:  # noqa: SLF001
            for tensor in node.input_tensors:
                last_read[id(tensor)] = i
    cuts = [layers[0].output]
    for i, layer in enumerate(layers[1:], 1):
        alive = [layers[j].output for j in range(i + 1)
                 if last_read.get(id(layers[j].output), -1) > i]
        if len(alive) == 1 and alive[0] is layer.output:
            cuts.append(layer.output)
    cuts.append(model.output)
    return [keras.Model(a, b, name=f"piece{k}") for k, (a, b) in enumerate(zip(cuts, cuts[1:]))
            if a is not b]


def worker(budget: str, xla: bool) -> dict:
    import keras
    import tensorflow as tf

    import tf_checkpointing as tc
    from tf_checkpointing._memory import grow_cpu_pool

    grow_cpu_pool()
    chain = pieces()
    x = tf.random.normal([16, 128, 128, 3])
    y = tf.one_hot(tf.zeros([16], tf.int32), 10)
    if budget == "plain":
        body = keras.Sequential(chain)
    else:
        body = tc.CheckpointedSequential(
            chain, budget="min" if budget == "min" else int(float(budget) * MIB))
    inputs = keras.Input((128, 128, 3), batch_size=16)
    model = keras.Model(inputs, body(inputs))
    model.compile(keras.optimizers.SGD(1e-3), "categorical_crossentropy", jit_compile=xla)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # traced and planned
    row: dict[str, Any] = dict(budget=budget, xla=xla, pieces=len(chain),
                               peak_mib=tc.peak_memory(lambda: model.train_on_batch(x, y)) / MIB)
    plan = getattr(body, "plan", None)
    if plan is not None:
        row.update(predicted_mib=plan.predicted_peak_bytes / MIB,
                   least_budget_mib=plan.min_budget_bytes / MIB,
                   plain_mib=plan.plain_peak_bytes / MIB, segments=len(plan.segments))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="",
                        help="comma-separated XLA budgets in MiB (besides plain and min)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1] == "xla")))
        return
    runs = [(b, mode) for b in ("plain", "min") for mode in ("xla", "graph")]
    runs += [(b, "xla") for b in args.budgets.split(",") if b]
    for budget, mode in runs:
        done = subprocess.run([sys.executable, __file__, "--worker", budget, mode],
                              env=dict(os.environ), capture_output=True, text=True,
                              check=False)
        lines = done.stdout.strip().splitlines()
        print(lines[-1] if done.returncode == 0 and lines else
              json.dumps(dict(budget=budget, xla=mode == "xla", error=done.stderr[-1000:])),
              flush=True)


if __name__ == "__main__":
    main()
