"""Adoption sweep: ``apply_checkpointing``'s planner on ``keras.applications`` models
that the whole-model benchmark does not tune for.

    python benchmarks/applications_sweep.py                       # every model, tf.function
    python benchmarks/applications_sweep.py --models ResNet50V2,MobileNet --modes graph,xla

Each model is built from its constructor (``weights=None``, 96x96, 10 classes, batch
8) in a fresh process whose CPU pool is grown first (``_memory.grow_cpu_pool``), and
planned in that process as a user's first training call plans it: the least plan
(``budget="min"``), then a budget halfway between the least and plain. For plain and
each plan it records

* the gradient of every trainable variable and the BatchNorm statistics after one step
  (a ``tf.function`` returning the gradients), against plain's. The gradient error is
  given as a multiple of plain's own rounding: how far plain's eager gradients are from
  its ``tf.function`` ones (about 1 means the same rounding as plain itself; many of
  these models are ill-conditioned at their random initialisation, Xception's plain
  gradients differ by 0.4% of their size between eager and ``tf.function``);
* the peak of an SGD training step (gradients consumed by the update, as ``fit`` does):
  the allocator's chunks (median of three steps) and the tensors' bytes
  (``planning._requested``), against the plan's prediction and budget;
* the planning time.

Writes ``applications_sweep.json`` and ``.md`` to the output directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402 - TensorFlow's environment, before it starts

MODELS = ("MobileNetV3Small", "MobileNet", "EfficientNetV2B0", "ResNet50V2", "InceptionV3",
          "Xception", "ConvNeXtTiny", "DenseNet121", "VGG16")
MIB = 2**20


def worker(name: str, mode: str, size: int, batch: int) -> dict:
    """One model in this process: plain, the least plan and the halfway plan."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_checkpointing as tc
    from tf_checkpointing._memory import grow_cpu_pool
    from tf_checkpointing.planning._requested import requested_peak

    grow_cpu_pool()
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                              classes=10)
    x = tf.random.normal([batch, size, size, 3])
    y = tf.constant(np.arange(batch) % 10)
    # Copies: a variable's .numpy() can share its buffer, and a buffer still
    # shared is copied by every update (copy on write), which would add every
    # updated weight to the peaks measured here.
    before = [v.numpy().copy() for v in model.variables]

    def reset() -> None:
        for variable, value in zip(model.variables, before):
            variable.assign(value)

    def loss_of() -> Any:
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
            y, model(x, training=True)))

    def gradients(compiled: str) -> tuple[list, list]:
        def step() -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of()
            return tape.gradient(loss, model.trainable_variables)
        keras.utils.set_random_seed(1)
        run = step if compiled == "eager" else tf.function(step, jit_compile=compiled == "xla")
        grads = [g.numpy() for g in run()]
        state = [v.numpy().copy() for v in model.non_trainable_variables]
        reset()
        return grads, state

    def peaks() -> tuple[float, float]:
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

        @tf.function(jit_compile=mode == "xla")
        def train() -> Any:
            with tf.GradientTape() as tape:
                loss = loss_of()
            optimizer.apply(tape.gradient(loss, model.trainable_variables),
                            model.trainable_variables)
            return loss
        train()
        chunks = []
        for _ in range(3):
            reset()
            chunks.append(tc.peak_memory(lambda: train().numpy()))
        reset()
        tensors = requested_peak(lambda: train().numpy()) or 0
        reset()
        return float(np.median(chunks)), float(tensors)

    def max_error(a: list, b: list) -> float:
        return max((float(np.abs(p - q).max()) for p, q in zip(a, b) if p.size), default=0.0)

    plain_grads, plain_state = gradients(mode)
    rounding = max_error(gradients("eager")[0], gradients("graph")[0])
    plain_chunks, plain_tensors = peaks()
    row: dict[str, Any] = dict(model=name, mode=mode, size=size, batch=batch,
                               plain_mib=plain_chunks / MIB, plain_tensors_mib=plain_tensors / MIB,
                               plain_rounding=rounding)

    def measure(tag: str, budget: Any) -> Any:
        started = time.perf_counter()
        plan = tc.plan_model(model, x, budget=budget, mode="xla" if mode == "xla" else "graph")
        planned = time.perf_counter() - started
        tc.apply_checkpointing(model, plan=plan)
        reset()
        grads, state = gradients(mode)
        chunks, tensors = peaks()
        state_error = max(((np.abs(a - b) / (1e-5 + 1e-5 * np.abs(b))).max()
                           for a, b in zip(state, plain_state) if a.size), default=0.0)
        row[tag] = dict(
            plan_s=planned, regions=len(plan.spans),
            budget_mib=None if budget == "min" else budget / MIB,
            least_budget_mib=plan.min_budget_bytes / MIB,
            predicted_mib=plan.predicted_peak_bytes / MIB, measured_mib=chunks / MIB,
            tensors_mib=tensors / MIB,
            grad_error_x_rounding=max_error(grads, plain_grads) / max(rounding, 1e-30),
            state_error_x_tolerance=float(state_error))
        return plan

    least = measure("least", "min")
    measure("halfway", (least.min_budget_bytes + least.plain_peak_bytes) // 2)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | mode | plain MiB | least: measured x plain | least: measured / "
             "predicted | halfway: measured / budget | halfway: measured / predicted | "
             "chunks / tensors (least) | grad error x plain's rounding | BatchNorm stats "
             "within 1e-5 | planning s (least) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        least, half = r["least"], r["halfway"]
        state_ok = max(least["state_error_x_tolerance"], half["state_error_x_tolerance"]) <= 1
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['plain_mib']:.1f} | "
            f"{least['measured_mib'] / r['plain_mib']:.2f} | "
            f"{least['measured_mib'] / least['predicted_mib']:.2f} | "
            f"{half['measured_mib'] / half['budget_mib']:.2f} | "
            f"{half['measured_mib'] / half['predicted_mib']:.2f} | "
            f"{least['measured_mib'] / max(least['tensors_mib'], 1e-9):.2f} | "
            f"{max(least['grad_error_x_rounding'], half['grad_error_x_rounding']):.1f} | "
            f"{'yes' if state_ok else 'NO'} | "
            f"{least['plan_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default="graph", help="graph, xla or both (comma-separated)")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.size, args.batch)))
        return
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            command = [sys.executable, __file__, "--worker", name, mode,
                       "--size", str(args.size), "--batch", str(args.batch)]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{name} {mode}: failed\n{done.stderr[-3000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    out = _cli.output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "applications_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "applications_sweep.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
