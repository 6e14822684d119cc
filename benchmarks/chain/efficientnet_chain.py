"""Benchmark: EfficientNetB0 as a chain in ``CheckpointedSequential``, under ``fit``.

    python benchmarks/chain/efficientnet_chain.py            # plain and least, XLA and not
    python benchmarks/chain/efficientnet_chain.py --budgets 433,522,612   # XLA budgets, MiB
    python benchmarks/chain/efficientnet_chain.py --tiny --out /tmp/effnet   # ~20 s, a smoke test

``keras.applications.EfficientNetB0(weights=None)`` (128x128, 10 classes, batch 16)
is cut at every point where one tensor alone is alive (85 pieces, each a functional
sub-model) and run as ``CheckpointedSequential(pieces, budget=...)`` inside a model
trained with ``fit`` (SGD), with ``jit_compile=True`` (mode "xla") or not ("graph"); the
plan is made while the step is traced, so for XLA under ``jit_compile=True``. Each
configuration runs in a fresh process whose CPU pool is grown before anything else (see
``tf_checkpointing.core._memory.grow_cpu_pool``); the peak is one ``train_on_batch``
after a first ``fit``. Prints one JSON line per configuration (measured peak, budget,
the plan's prediction, least budget and plain peak, all in MiB) and writes them to
``efficientnet_chain.json`` and ``.md`` in the output directory. With ``--tiny``: 32x32
images, batch 2, the network up to the end of its first block (``block1a_project_bn``)
and a classifier head (14 pieces), the least plan under tf.function only (one process).

TensorFlow is imported inside ``pieces`` and ``worker``, which run in the worker
processes: the parent only starts them and writes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402 - TensorFlow's environment, before it starts
from benchmarks.report import MIB, cell, table  # noqa: E402

# Input size, batch and where the network is cut short (None: the whole network): the
# measured run's (benchmarks/results/notes/chains.md), and toy ones for the tests.
SHAPES = {"full": dict(size=128, batch=16, stop=None),
          "tiny": dict(size=32, batch=2, stop="block1a_project_bn")}


def pieces(size: int, stop: Optional[str] = None) -> list[Any]:
    """EfficientNetB0 on ``size`` x ``size`` images, cut into sub-models between its
    single-tensor points; with ``stop``, only up to that layer, then a classifier head."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.EfficientNetB0(weights=None, input_shape=(size, size, 3),
                                              classes=10)
    if stop is not None:
        h = keras.layers.GlobalAveragePooling2D(name="head_pool")(model.get_layer(stop).output)
        h = keras.layers.Dense(10, activation="softmax", name="head")(h)
        model = keras.Model(model.input, h)
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


def worker(budget: str, xla: bool, size: int, batch: int, stop: Optional[str]) -> dict:
    with _cli.quiet_start_up():
        import keras
        import tensorflow as tf

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool

    grow_cpu_pool()
    chain = pieces(size, stop)
    x = tf.random.normal([batch, size, size, 3])
    y = tf.one_hot(tf.zeros([batch], tf.int32), 10)
    if budget == "plain":
        body = keras.Sequential(chain)
    else:
        body = tc.CheckpointedSequential(
            chain, budget="min" if budget == "min" else int(float(budget) * MIB))
    inputs = keras.Input((size, size, 3), batch_size=batch)
    model = keras.Model(inputs, body(inputs))
    model.compile(keras.optimizers.SGD(1e-3), "categorical_crossentropy", jit_compile=xla)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # traced and planned
    peak = tc.debug.measure(lambda: model.train_on_batch(x, y)).peak_bytes
    row: dict[str, Any] = dict(budget=budget, xla=xla, pieces=len(chain), size=size,
                               batch=batch, peak_mib=peak / MIB)
    plan = getattr(body, "plan", None)
    if plan is not None:
        row.update(predicted_mib=plan.predicted_peak_bytes / MIB,
                   least_budget_mib=plan.min_budget_bytes / MIB,
                   plain_mib=plan.plain_peak_bytes / MIB, segments=len(plan.segments))
    return row


def markdown(rows: list[dict]) -> str:
    """The configurations as a table (MiB)."""
    measured = next((r for r in rows if "peak_mib" in r), {})
    title = (f"# EfficientNetB0 as a chain of {measured.get('pieces', '?')} pieces under fit "
             f"({measured.get('size', '?')}x{measured.get('size', '?')}, batch "
             f"{measured.get('batch', '?')})")
    cells = [[r["budget"], "XLA" if r["xla"] else "tf.function",
              *(cell(r.get(key), "{:.1f}") for key in ("peak_mib", "predicted_mib",
                                                       "least_budget_mib", "plain_mib")),
              cell(r.get("segments")), r.get("error", "")[-200:].replace("\n", " ")]
             for r in rows]
    return "\n".join([title, "", table(
        ["budget", "step", "peak MiB", "predicted MiB", "least budget MiB",
         "plain (the planner's reading) MiB", "segments", "error"], cells), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="",
                        help="comma-separated XLA budgets in MiB (besides plain and min)")
    parser.add_argument("--tiny", action="store_true",
                        help="32x32 images, batch 2, the network's first block, budget min "
                             "under tf.function only")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    args = parser.parse_args()
    shape = SHAPES["tiny" if args.tiny else "full"]
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1] == "xla", **shape)))
        return
    runs = [("min", "graph")] if args.tiny else [
        (b, mode) for b in ("plain", "min") for mode in ("xla", "graph")]
    runs += [(b, "xla") for b in args.budgets.split(",") if b]
    rows = []
    for budget, mode in runs:
        done = subprocess.run([sys.executable, __file__, "--worker", budget, mode]
                              + (["--tiny"] if args.tiny else []),
                              env=dict(os.environ), capture_output=True, text=True,
                              check=False)
        lines = done.stdout.strip().splitlines()
        rows.append(json.loads(lines[-1]) if done.returncode == 0 and lines else
                    dict(budget=budget, xla=mode == "xla", error=done.stderr[-1000:]))
        print(json.dumps(rows[-1]), flush=True)
    out = _cli.output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "efficientnet_chain.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "efficientnet_chain.md").write_text(markdown(rows))
    print(f"wrote {out / 'efficientnet_chain.json'} and {out / 'efficientnet_chain.md'}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
