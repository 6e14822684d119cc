"""Benchmark: whole-model checkpointing on the path users train with.

    python benchmarks/whole_model/user_path.py              # results/latest/whole_model_user_path.*
    python benchmarks/whole_model/user_path.py --models stack --modes graph
    python benchmarks/whole_model/user_path.py --update-results
    python benchmarks/whole_model/user_path.py --rerender RESULTS.json   # the tables again

Each strategy of each model runs in a process of its own, as a user's training run:
the model is built from its constructor (random weights), the strategy applied as
the README shows, ``model.compile(SGD, loss, jit_compile=...)``, then
``train_on_batch``. The first call (tracing, and planning for a budget) is measured
on its own, its peak and wall time; then the peaks of five more calls. No plan is
made ahead: ``budget="min"`` plans on the first call, in the mode the model was
compiled for.

The strategies:

* ``plain``: nothing applied.
* ``per-block``: the hand-written selection a user would write: ``apply_checkpointing(
  model, [BlockClass])`` where the model has a block class (the ViT's
  ``ViTEncoderBlock``, the stack's ``Block``), else the blocks by layer-name prefix
  (``ModelPlan.from_regions``: ResNet50's ``conv3_block2_*``, ConvNeXtTiny's
  ``..._stage_1_block_0_*``).
* ``min``: ``apply_checkpointing(model, budget="min")``.
* ``halfway``: the budget the whole-model guide recommends, halfway between the least
  budget and plain's peak that ``plan_model(model, x, budget="min", mode=...)``
  reports for the compiled mode; then ``apply_checkpointing(model, budget=halfway)``.

The models (``MODELS``): ResNet50 128x128 batch 16, ConvNeXtTiny 64x64 batch 8,
keras_hub's ViTBackbone (96x96, patch 8, 6 layers of width 256) with a Dense head
batch 8, and a functional model whose middle is one custom layer holding 8 residual
MLP blocks in a list (batch 512). The report: ``user_path_report.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

from benchmarks import _cli  # noqa: E402  (environment before TensorFlow starts)
from benchmarks.whole_model import user_path_report as report  # noqa: E402

MODELS = ("resnet50", "convnext_tiny", "vit", "stack")
MODES = ("graph", "xla")
STRATEGIES = ("plain", "per-block", "min", "halfway")
STEPS = 5  # peaks measured after the first call
TIMED = 7  # steps timed after those (the median is the measured step time)


def _stack_model() -> tuple[Any, Any]:
    """A functional model whose middle is one layer running 8 residual MLP blocks."""
    import keras

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.up = keras.layers.Dense(512, activation="gelu")
            self.down = keras.layers.Dense(128)

        def call(self, x: Any) -> Any:
            return x + self.down(self.up(x))

    class Stack(keras.layers.Layer):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.blocks = [Block() for _ in range(8)]

        def call(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return x

    inputs = keras.Input((128,))
    hidden = Stack()(keras.layers.Dense(128)(inputs))
    return keras.Model(inputs, keras.layers.Dense(10)(hidden)), Block


def build(name: str) -> tuple[Any, Any, Any, Any]:
    """(model, x, y, per-block selection): a block class or lists of layer names."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(128, 128, 3),
                                            classes=10)
        x, blocks = rng.random((16, 128, 128, 3), "float32"), r"^(conv\d_block\d+)_"
    elif name == "convnext_tiny":
        model = keras.applications.ConvNeXtTiny(weights=None, input_shape=(64, 64, 3),
                                                classes=10)
        x, blocks = rng.random((8, 64, 64, 3), "float32"), r"^(convnext_tiny_stage_\d+_block_\d+)_"
    elif name == "vit":
        import keras_hub
        from keras_hub.src.models.vit.vit_layers import ViTEncoderBlock

        backbone = keras_hub.models.ViTBackbone(
            image_shape=(96, 96, 3), patch_size=8, num_layers=6, num_heads=4,
            hidden_dim=256, mlp_dim=1024)
        inputs = keras.Input((96, 96, 3))
        model = keras.Model(inputs, keras.layers.Dense(10)(backbone(inputs)[:, 0]))
        x, blocks = rng.random((8, 96, 96, 3), "float32"), ViTEncoderBlock
    elif name == "stack":
        model, blocks = _stack_model()
        x = rng.standard_normal((512, 128), "float32")
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    y = rng.integers(0, 10, len(x))
    return model, x, y, blocks


def _per_block(model: Any, blocks: Any) -> None:
    import re

    import tf_checkpointing as tc

    if not isinstance(blocks, str):
        tc.apply_checkpointing(model, [blocks])
        return
    regions: dict[str, list[str]] = {}
    for layer in model.layers:
        found = re.match(blocks, layer.name)
        if found:
            regions.setdefault(found.group(1), []).append(layer.name)
    # Each block as one region: the layer calls from its first to its last in run
    # order (a plan's names are the model's calls in that order).
    names = list(tc.ModelPlan.from_regions(model, [[next(iter(regions.values()))[0]]]).names)
    spans = [sorted(names.index(n) for n in block) for block in regions.values()]
    tc.apply_checkpointing(model, plan=tc.ModelPlan.from_regions(
        model, [names[span[0]:span[-1] + 1] for span in spans]))


def worker(name: str, mode: str, strategy: str) -> dict:
    """One strategy's run, in this process: the result printed as JSON."""
    with _cli.quiet_start_up():
        import keras

        import tf_checkpointing as tc
        from tf_checkpointing.core._memory import grow_cpu_pool

    grow_cpu_pool()  # XLA's one buffer counted at its size, as in the other benchmarks
    model, x, y, blocks = build(name)
    result: dict[str, Any] = {"model": name, "mode": mode, "strategy": strategy}
    if strategy == "per-block":
        _per_block(model, blocks)
    elif strategy == "min":
        tc.apply_checkpointing(model, budget="min")
    elif strategy == "halfway":
        started = time.perf_counter()
        least = tc.plan_model(model, x, budget="min", mode=mode)
        result["plan_model_seconds"] = time.perf_counter() - started
        result["least_budget_mib"] = least.min_budget_bytes / 2**20
        result["plain_reported_mib"] = least.plain_peak_bytes / 2**20
        budget = (least.min_budget_bytes + least.plain_peak_bytes) // 2
        result["budget_mib"] = budget / 2**20
        tc.apply_checkpointing(model, budget=budget)
    model.compile(keras.optimizers.SGD(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=mode == "xla")
    started = time.perf_counter()
    first = tc.debug.measure(lambda: model.train_on_batch(x, y))
    result["first_seconds"] = time.perf_counter() - started
    result["first_peak_mib"] = first.peak_bytes / 2**20
    result["peaks_mib"] = [tc.debug.measure(lambda: model.train_on_batch(x, y)).peak_bytes
                           / 2**20 for _ in range(STEPS)]
    result["step_seconds"] = _timed_steps(lambda: model.train_on_batch(x, y))
    plan = getattr(model.call, "plan", None)
    if plan is not None and strategy in ("min", "halfway"):
        result["regions"] = len(plan.regions)
        result["blocks"] = len(plan.blocks)
        result["predicted_mib"] = plan.predicted_peak_bytes / 2**20
        result["predicted_step_s"] = plan.predicted_step_seconds
        result["plain_step_s"] = plan.plain_step_seconds
        result["replay_s"] = plan.predicted_extra_seconds  # the profile's unit
        result["profile_forward_s"] = _profile_forward_seconds()
        if strategy == "min":
            result["least_budget_mib"] = plan.min_budget_bytes / 2**20
    if strategy == "plain":
        result["forward_step_s"] = _forward_seconds(model, x, mode)
    return result


def _timed_steps(step: Any) -> list[float]:
    """The wall times of ``TIMED`` calls of ``step`` (each returns when its step is done)."""
    times = []
    for _ in range(TIMED):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return times


def _forward_seconds(model: Any, x: Any, mode: str) -> float:
    """The least of five forward-only runs (training=True) as one function in
    ``mode``: a candidate unit for the replays' time (decision 0038)."""
    import tensorflow as tf

    forward = tf.function(lambda v: model(v, training=True), jit_compile=mode == "xla")
    x = tf.constant(x)
    forward(x).numpy()
    return min(_timed_steps(lambda: forward(x).numpy()))


def _profile_forward_seconds() -> float:
    """The sum of the per-call forward seconds of the profile the plan came from
    (the newest in the planner's cache)."""
    from tf_checkpointing.planning.solving import _model_profile

    *_, (_, _, costs) = _model_profile._profiles.values()
    return float(costs.cost.sum())


def _run(name: str, mode: str, strategy: str) -> dict:
    command = [sys.executable, __file__, "--worker", name, mode, strategy]
    return {"model": name, "mode": mode, "strategy": strategy, **_cli.worker_result(command)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--worker", nargs=3, metavar=("MODEL", "MODE", "STRATEGY"),
                        help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    _cli.add_rerender_argument(parser)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return
    if args.rerender:
        report.write(json.loads(args.rerender.read_text()), args.rerender.parent)
        return
    out = _cli.output_dir(args)
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for strategy in args.strategies.split(","):
                row = _run(name, mode, strategy)
                print(json.dumps(row), flush=True)
                rows.append(row)
    report.write(rows, out)


if __name__ == "__main__":
    main()
