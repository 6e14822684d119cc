"""Adoption sweep: ``apply_checkpointing``'s planner on ``keras.applications`` models
that the whole-model benchmark does not tune for.

    python benchmarks/whole_model/applications_sweep.py        # every model, tf.function
    python benchmarks/whole_model/applications_sweep.py --models MobileNet --modes graph,xla
    python benchmarks/whole_model/applications_sweep.py --tiny --out /tmp/sweep   # smoke test

Each model is built from its constructor (``weights=None``, 96x96, 10 classes, batch
8), every process growing its CPU pool first
(``tf_checkpointing.core._memory.grow_cpu_pool``: one region, as a GPU's pool is). Per
model and mode ("graph": a ``tf.function`` step; "xla": ``jit_compile=True``):

* one process checks exactness: the least plan (``budget="min"``) and a budget halfway
  between the least and plain, each made with ``plan_model`` and applied, against
  plain: the gradient of every trainable variable and the BatchNorm statistics after
  one step (a ``tf.function`` returning the gradients). The gradient error is given as
  a multiple of plain's own rounding: how far plain's eager gradients are from its
  ``tf.function`` ones (about 1 means the same rounding as plain itself; many of these
  models are ill-conditioned at their random initialisation: Xception's plain
  gradients at batch 4 differ between eager and ``tf.function`` by up to 0.4% of a
  variable's largest gradient). It also times the planning;
* three more processes train as a user does, each on its own: plain,
  ``apply_checkpointing(model, budget="min")`` and ``apply_checkpointing(model,
  budget=<the halfway budget>)``, then ``compile`` and ``fit`` (SGD), which plans on its
  first step; a callback reads the allocator's peak of each of the next seven steps
  (above what was allocated before the step). The plan made there gives the
  prediction; "peak" is the median step, the budget check takes the largest.

Writes ``applications_sweep.json`` and ``.md`` to the output directory. ``--tiny``
runs one small model on 32x32 images, batch 2, two steps after the planning one: the
whole path (five processes) in about a minute.

Each worker (``--worker``, ``--fit``) runs in a process of its own and imports
TensorFlow inside its function; the parent process only starts them and writes the
table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402 - TensorFlow's environment, before it starts
from benchmarks.report import MIB, table  # noqa: E402

MODELS = ("MobileNetV3Small", "MobileNet", "EfficientNetV2B0", "ResNet50V2", "InceptionV3",
          "Xception", "ConvNeXtTiny", "DenseNet121", "VGG16")
# Image size, batch and steps measured after the first (which plans): the committed
# run's, and what --tiny runs (on TINY_MODELS) unless given.
SHAPES = {"full": dict(size=96, batch=8, fit_steps=7),
          "tiny": dict(size=32, batch=2, fit_steps=2)}
TINY_MODELS = "VGG16"  # the fewest layers to plan: the quickest to run


def worker(name: str, mode: str, size: int, batch: int) -> dict:
    """Exactness and planning time: the least and halfway plans against plain."""
    with _cli.quiet_start_up():
        import keras
        import numpy as np
        import tensorflow as tf

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool

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

    def max_error(a: list, b: list) -> float:
        return max((float(np.abs(p - q).max()) for p, q in zip(a, b) if p.size), default=0.0)

    plain_grads, plain_state = gradients(mode)
    rounding = max_error(gradients("eager")[0], gradients("graph")[0])
    row: dict[str, Any] = dict(model=name, mode=mode, size=size, batch=batch,
                               plain_rounding=rounding)

    def check(tag: str, budget: Any) -> Any:
        started = time.perf_counter()
        plan = tc.plan_model(model, x, budget=budget, mode="xla" if mode == "xla" else "graph")
        planned = time.perf_counter() - started
        tc.apply_checkpointing(model, plan=plan)
        reset()
        grads, state = gradients(mode)
        state_error = max(((np.abs(a - b) / (1e-5 + 1e-5 * np.abs(b))).max()
                           for a, b in zip(state, plain_state) if a.size), default=0.0)
        row[tag] = dict(
            plan_s=planned, regions=len(plan.regions),
            grad_error_x_rounding=max_error(grads, plain_grads) / max(rounding, 1e-30),
            state_error_x_tolerance=float(state_error))
        return plan

    least = check("least", "min")
    row["halfway_budget"] = (least.min_budget_bytes + least.plain_peak_bytes) // 2
    check("halfway", row["halfway_budget"])
    return row


def fit_worker(name: str, mode: str, size: int, batch: int, budget: str,
               fit_steps: int) -> dict:
    """As a user trains: ``apply_checkpointing(model, budget=...)`` (none for
    ``"plain"``), ``compile``, ``fit``, which plans on its first step; the
    allocator's peak of each later step, read by a callback."""
    with _cli.quiet_start_up():
        import keras
        import numpy as np
        import tensorflow as tf

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool

    grow_cpu_pool()
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3),
                                              classes=10)
    if budget != "plain":
        tc.apply_checkpointing(model, budget="min" if budget == "min" else int(budget))
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy",
                  jit_compile=mode == "xla")
    steps = 1 + fit_steps
    x = np.random.default_rng(0).random((batch * steps, size, size, 3), np.float32)
    y = np.arange(batch * steps) % 10
    peaks: list[float] = []

    class Peaks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            tf.config.experimental.reset_memory_stats("CPU:0")
            self.start = tf.config.experimental.get_memory_info("CPU:0")["current"]

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            info = tf.config.experimental.get_memory_info("CPU:0")
            peaks.append((info["peak"] - self.start) / MIB)

    started = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False, callbacks=[Peaks()])
    row: dict[str, Any] = dict(budget=budget, peaks_mib=peaks[1:],  # the first step plans
                               peak_mib=float(np.median(peaks[1:])), max_mib=max(peaks[1:]),
                               fit_s=time.perf_counter() - started)
    plan = getattr(model.call, "plan", None)
    if plan is not None:
        row.update(predicted_mib=plan.predicted_peak_bytes / MIB,
                   budget_mib=plan.budget_bytes / MIB if budget != "min" else
                   plan.min_budget_bytes / MIB,
                   least_budget_mib=plan.min_budget_bytes / MIB,
                   planned_plain_mib=plan.plain_peak_bytes / MIB)
    return row


def markdown_table(rows: list[dict]) -> str:
    def cells(r: dict) -> list[str]:
        plain, least, half = r["fit"]["plain"], r["fit"]["least"], r["fit"]["halfway"]
        state_ok = max(r["least"]["state_error_x_tolerance"],
                       r["halfway"]["state_error_x_tolerance"]) <= 1
        grad_error = max(r["least"]["grad_error_x_rounding"],
                         r["halfway"]["grad_error_x_rounding"])
        return [r["model"], r["mode"], f"{plain['peak_mib']:.1f}",
                f"{least['peak_mib'] / plain['peak_mib']:.2f}",
                f"{least['max_mib'] / least['least_budget_mib']:.2f}",
                f"{least['peak_mib'] / least['predicted_mib']:.2f}",
                f"{half['budget_mib']:.1f}", f"{half['max_mib'] / half['budget_mib']:.2f}",
                f"{half['peak_mib'] / half['predicted_mib']:.2f}", f"{grad_error:.1f}",
                "yes" if state_ok else "NO", f"{r['least']['plan_s']:.0f}"]

    return table(
        ["model", "mode", "plain MiB", "least: peak x plain",
         "least: largest step / least budget", "least: peak / predicted",
         "halfway: budget MiB", "halfway: largest step / budget", "halfway: peak / predicted",
         "grad error x plain's rounding", "BatchNorm stats within 1e-5",
         "planning s (least)"], (cells(r) for r in rows),
        align=["---", "---"] + ["---:"] * 8 + ["---", "---:"]) + "\n"


def report(rows: list[dict]) -> str:
    """The table under a heading that says what was run (see the module docstring)."""
    shape = ""
    if rows:
        first = rows[0]
        shape = (f"{first['size']}x{first['size']}, batch {first['batch']}, 10 classes; each "
                 f"plan trained with `fit` (SGD) in a fresh process, "
                 f"{len(first['fit']['plain']['peaks_mib'])} steps after the planning one")
    return ("# Adoption sweep: keras.applications models\n\n"
            f"weights=None, {shape}; peak = median step, largest = highest. What it "
            "shows: notes/applications-sweep.md.\n\n" + markdown_table(rows))


def _run(*arguments: str) -> dict:
    command = [sys.executable, __file__, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)}: failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help=f"{TINY_MODELS} (unless --models) at {SHAPES['tiny']}")
    parser.add_argument("--models", help=f"comma-separated (default: {','.join(MODELS)})")
    parser.add_argument("--modes", default="graph", help="graph, xla or both (comma-separated)")
    parser.add_argument("--size", type=int, help="image size (default 96)")
    parser.add_argument("--batch", type=int, help="batch (default 8)")
    parser.add_argument("--fit-steps", type=int, help="steps measured after the planning one "
                        "(default 7)")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--fit", nargs=3, metavar=("MODEL", "MODE", "BUDGET"),
                        help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    _cli.add_rerender_argument(parser)
    args = parser.parse_args()
    if args.rerender:
        path = args.rerender.with_suffix(".md")
        path.write_text(report(json.loads(args.rerender.read_text())))
        print(f"Wrote {path}.")
        return
    for name, default in SHAPES["tiny" if args.tiny else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.models = args.models or (TINY_MODELS if args.tiny else ",".join(MODELS))
    shape = ("--size", str(args.size), "--batch", str(args.batch))
    if args.worker:
        print(json.dumps(worker(*args.worker, args.size, args.batch)))
        return
    if args.fit:
        print(json.dumps(fit_worker(*args.fit[:2], args.size, args.batch, args.fit[2],
                                    args.fit_steps)))
        return
    rows, failed = [], 0
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            try:
                row = _run("--worker", name, mode, *shape)
                row["fit"] = {tag: _run("--fit", name, mode, budget, *shape, "--fit-steps",
                                        str(args.fit_steps))
                              for tag, budget in (("plain", "plain"), ("least", "min"),
                                                  ("halfway", str(row["halfway_budget"])))}
            except RuntimeError as error:  # reported; the sweep goes on
                print(error, file=sys.stderr)
                failed += 1
                continue
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    out = _cli.output_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "applications_sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "applications_sweep.md").write_text(report(rows))
    print(markdown_table(rows))
    if failed:
        sys.exit(f"{failed} of {failed + len(rows)} runs failed (their errors are above)")


if __name__ == "__main__":
    main()
