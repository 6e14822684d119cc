"""Benchmark: whole-model checkpointing for a memory budget.

    python benchmarks/whole_model.py            # all models, writes results/latest/whole_model.*
    python benchmarks/whole_model.py --update-results   # the committed results/whole_model.*
    python benchmarks/whole_model.py --tiny     # small shapes, for a smoke test

Each model runs in a subprocess of its own (a fresh allocator), as one
``tf.function`` training step (SGD), under every strategy (the plans made first,
on the fresh allocator, as on a user's first training step): plain, per-layer
selections (``apply_checkpointing(model, [cls])``), hand-written per-block
checkpointing (a plan whose regions are exactly the model's blocks, which is
what ``checkpointable`` on each block runs), ``budget="min"`` and budgets
between the least and plain; plans for an XLA step are measured under
``jit_compile=True``. Peaks come from the BFC allocator (the median of
five steps, and their largest); step times are medians, as ratios to plain
in the same process. For the decoder (gpt2), the
budget plans are also made with ``policies="auto"`` (a save policy per region),
and every ``tf.function`` strategy is timed again with plain in interleaved
rounds (the step times reported).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC, TF_CPP_MIN_LOG_LEVEL and TF_ENABLE_ONEDNN_OPTS (peaks that
# do not depend on the host CPU), which the per-model subprocesses inherit.
from benchmarks import _cli  # noqa: E402
from benchmarks.whole_model_peaks import fresh_peaks, plan_spec  # noqa: E402

MIB = 2**20
PEAK_STEPS = 5  # steps whose peaks are measured per strategy
MODELS = ("resnet50", "unet", "mobilenetv2", "gpt2")
# Models whose budget plans are also made with save policies (policies="auto"):
# the decoder, where keeping the products pays (the policy target).
POLICY_MODELS = ("gpt2",)


def build(name: str, tiny: bool) -> tuple[Any, Any, list[list[str]], int]:
    """(model, batch maker, hand-written blocks as lists of layer names, batch)."""
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    # keras.applications models: constructor, and the layer-name prefix of a block.
    applications = {"resnet50": (keras.applications.ResNet50, r"^(conv\d_block\d+)_"),
                    "mobilenetv2": (keras.applications.MobileNetV2, r"^(block_\d+)_")}
    if name in applications:
        build, prefix = applications[name]
        size, batch = (64, 4) if tiny else (128, 16)
        model = build(weights=None, input_shape=(size, size, 3), classes=10)
        blocks = _blocks_by_prefix(model, prefix)
        return model, lambda b: tf.random.normal([b, size, size, 3]), blocks, batch
    if name == "unet":
        return (*_unet(16 if tiny else 64, 4 if tiny else 16), 2 if tiny else 8)
    if name == "gpt2":
        import keras_hub

        seq, batch = (16, 2) if tiny else (128, 8)
        model = keras_hub.models.GPT2Backbone(
            vocabulary_size=1000, num_layers=2 if tiny else 6, num_heads=4,
            hidden_dim=64 if tiny else 256, intermediate_dim=128 if tiny else 1024,
            max_sequence_length=seq)

        def batch_of(b: int) -> dict:
            return {"token_ids": tf.random.uniform([b, seq], 0, 1000, tf.int32),
                    "padding_mask": tf.ones([b, seq], tf.int32)}

        blocks = [[layer.name] for layer in model.layers if "transformer_layer" in layer.name]
        return model, batch_of, blocks, batch
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def _blocks_by_prefix(model: Any, pattern: str) -> list[list[str]]:
    """The residual blocks: runs of layers whose names share the prefix ``pattern`` matches."""
    blocks: dict[str, list[str]] = {}
    for layer in model.layers:
        found = re.match(pattern, layer.name)
        if found:
            blocks.setdefault(found.group(1), []).append(layer.name)
    return list(blocks.values())


def _unet(image: int, channels: int) -> tuple[Any, Any, list[list[str]]]:
    """The suite's U-Net (benchmarks/models.py, levels 2) as a functional model."""
    import keras
    import tensorflow as tf

    layers = keras.layers
    blocks: list[list[str]] = []

    def stage(x: Any, width: int, name: str) -> Any:
        for k in range(2):
            x = layers.Conv2D(width, 3, padding="same", use_bias=False, name=f"{name}_conv{k}")(x)
            x = layers.BatchNormalization(name=f"{name}_bn{k}")(x)
            x = layers.Activation("relu", name=f"{name}_relu{k}")(x)
        return x

    x = keras.Input((image, image, 3))
    h = layers.Conv2D(channels, 3, padding="same", name="stem")(x)
    skips = []
    for i in range(2):
        h = stage(h, channels * 2**i, f"down{i}")
        skips.append(h)
        h = layers.MaxPooling2D(name=f"down{i}_pool")(h)
        blocks.append([f"down{i}_{s}" for s in ("conv0", "bn0", "relu0", "conv1", "bn1",
                                                 "relu1", "pool")])
    h = stage(h, channels * 4, "mid")
    blocks.append([f"mid_{s}" for s in ("conv0", "bn0", "relu0", "conv1", "bn1", "relu1")])
    for i in reversed(range(2)):
        h = layers.UpSampling2D(name=f"up{i}_up")(h)
        h = layers.Concatenate(name=f"up{i}_cat")([h, skips[i]])
        h = stage(h, channels * 2**i, f"up{i}")
        blocks.append([f"up{i}_{s}" for s in ("up", "cat", "conv0", "bn0", "relu0", "conv1",
                                               "bn1", "relu1")])
    model = keras.Model(x, layers.Conv2D(4, 1, name="head")(h), name="unet")
    return model, lambda b: tf.random.normal([b, image, image, 3]), blocks


def training_step(model: Any, optimizer: Any, jit: bool) -> Any:
    """One SGD step on the mean square of the model's outputs, as a ``tf.function``."""
    import tensorflow as tf

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            loss = tf.add_n([tf.reduce_mean(tf.square(tf.cast(o, tf.float32)))
                             for o in tf.nest.flatten(out)])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tf.function(step, jit_compile=jit)


def _batch(inputs: Any) -> int:
    import tensorflow as tf

    return int(tf.nest.flatten(inputs)[0].shape[0])


def worker(name: str, tiny: bool, budgets: int, only: str = "", rounds: int = 7) -> list[dict]:
    """Measures every strategy on one model (run in its own process); with
    ``only`` (a regular expression), the strategies whose names match it (and plain)."""
    import keras

    import tf_checkpointing as tc
    from tf_checkpointing._memory import grow_cpu_pool
    from tf_checkpointing.planning._model import ModelPlan

    # Before the model is built: XLA's one buffer is cut from one large region,
    # not counted as the region it would open (see _memory.grow_cpu_pool).
    grow_cpu_pool()
    model, batch_of, blocks, batch = build(name, tiny)
    x = batch_of(batch)
    model(x)
    optimizer = keras.optimizers.SGD(1e-3)
    rows: list[dict] = []
    steps: dict[str, Any] = {}  # traced tf.function steps, for the interleaved timing

    def wanted(strategy: str) -> bool:
        return strategy == "plain" or not only or re.search(only, strategy) is not None

    def measure(strategy: str, spec: dict, jit: bool = False, inputs: Any = x,
                **extra: Any) -> dict:
        step = training_step(model, optimizer, jit)
        step(inputs).numpy()  # trace (and plan) outside the measurement
        # The peak in a process of its own, as a user's run (see whole_model_peaks):
        # the median of a few steps (the executor's op order moves a U-Net step's
        # peak by up to 6 MiB of 25), and their largest (what must fit).
        # One more step traced: the peak of its tensors (requested bytes), which the
        # planner models, beside the allocator's chunks (see tf_checkpointing.planning._requested).
        peaks = fresh_peaks(name, tiny, dict(spec, jit=jit, batch=_batch(inputs)),
                            1 if tiny else PEAK_STEPS, tensors=not tiny)
        tensor_mib = None if tiny else peaks.pop()
        shared = [tc.peak_memory(lambda: step(inputs).numpy()) / MIB
                  for _ in range(1 if tiny else 3)]
        times = []
        for _ in range(1 if tiny else 3):
            started = time.perf_counter()
            step(inputs).numpy()
            times.append(time.perf_counter() - started)
        row = dict(model=name, strategy=strategy, xla=jit, peak_mib=statistics.median(peaks),
                   peak_max_mib=max(peaks), peaks_mib=[round(p, 2) for p in peaks],
                   tensor_peak_mib=tensor_mib,
                   # here, after the strategies before it: the allocator's history
                   peak_shared_mib=statistics.median(shared),
                   step_s=statistics.median(times), **extra)
        if not jit:
            steps[strategy] = (step, inputs)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        return row

    def reset() -> None:
        vars(model).pop("call", None)
        for layer in model._flatten_layers(include_self=False, recursive=True):  # noqa: SLF001
            vars(layer).pop("call", None)

    # Every plan first, while the allocator holds only the model, as on a user's first
    # training step: after other steps have run in the process the weights sit in
    # chunks scattered through the pool, the profile's per-call readings are chunks
    # larger than their tensors, and the plans come out less aggressive (ResNet50's
    # least plan predicted at 153 MiB after three plain steps, 124 before).
    plans = _plans(model, x, budgets, wanted, xla=wanted("XLA"),
                   policies=name in POLICY_MODELS)
    least = plans["graph"][0][1]
    plain = measure("plain", {})
    if name in ("resnet50", "unet") and wanted("per-layer"):
        for cls in ("Conv2D", "BatchNormalization", "Activation"):
            tc.apply_checkpointing(model, [getattr(keras.layers, cls)])
            measure(f"per-layer {cls}", dict(select=cls))
            reset()
        tc.apply_checkpointing(model, lambda layer: not isinstance(layer, keras.layers.InputLayer))
        measure("per-layer every layer", dict(select="every"))
        reset()
    names = list(least.call_names)
    spans = tuple((names.index(b[0]), names.index(b[-1]) + 1, ()) for b in blocks)
    hand = ModelPlan(least.call_names, spans, "graph", None, 0, 0, 0)
    if wanted("hand-written per-block"):
        tc.apply_checkpointing(model, plan=hand)
        measure("hand-written per-block", dict(plan=plan_spec(hand)), regions=len(spans))
    for label, plan, fraction, plan_s in plans["graph"]:
        if not wanted(label):
            continue
        tc.apply_checkpointing(model, plan=plan)
        measure(label, dict(plan=plan_spec(plan)),
                budget_mib=(plan.budget_bytes or plan.min_budget_bytes) / MIB,
                predicted_mib=plan.predicted_peak_bytes / MIB, fraction=fraction,
                plan_s=plan_s, regions=len(plan.spans),
                extra_forward=plan.extra_forward_layers,
                predicted_extra_ms=plan.predicted_extra_seconds * 1e3,
                policy_regions=sum(p is not None for p in plan.region_policies))
        if "policies" in label:
            print(plan, file=sys.stderr, flush=True)
    _interleaved(name, steps, rounds, rows)
    reset()
    if not wanted("XLA"):
        return rows
    measure("plain", {}, jit=True)
    if "error" in plans:
        rows.append(dict(model=name, strategy="budget (XLA)", xla=True, error=plans["error"]))
    for label, plan, fraction, _ in plans["xla"]:
        reset()
        tc.apply_checkpointing(model, plan=plan)
        measure(label, dict(plan=plan_spec(plan)), jit=True,
                budget_mib=(plan.budget_bytes or plan.min_budget_bytes) / MIB,
                fraction=fraction, regions=len(plan.spans),
                predicted_mib=plan.predicted_peak_bytes / MIB)
    if name == "resnet50" and not tiny:
        big = batch_of(batch * 5 // 2)
        reset()
        tc.apply_checkpointing(model, budget="min")
        measure("budget=min, batch x2.5", dict(budget="min"), inputs=big, batch=batch * 5 // 2,
                plain_batch16_peak_mib=plain["peak_mib"])
    return rows


def _plans(model: Any, x: Any, budgets: int, wanted: Any, *, xla: bool,
           policies: bool) -> dict:
    """Every plan the worker measures, as ``(label, plan, fraction, planning s)``
    per step kind (``"graph"``, ``"xla"``): the least, ``budgets`` budgets evenly
    between the least and plain; for the decoder also the budget plans made with
    ``policies="auto"``: at the halfway budget (beside "budget 0.50") and at half
    the plain peak (the policy target: at most 1.15x plain's step time, within the
    budget). An XLA planning error is kept as ``"error"``."""
    import tf_checkpointing as tc

    fractions = [(k + 1) / (budgets + 1) for k in range(budgets)]
    out: dict = {"graph": [], "xla": []}
    started = time.perf_counter()
    least = tc.plan_model(model, x, budget="min", mode="graph")
    out["graph"].append(("budget=min", least, 0.0, time.perf_counter() - started))

    def between(plan: Any, fraction: float) -> int:
        return int(plan.min_budget_bytes + fraction * (plan.plain_peak_bytes
                                                       - plan.min_budget_bytes))

    for fraction in fractions:
        if wanted(f"budget {fraction:.2f}"):
            out["graph"].append((f"budget {fraction:.2f}", tc.plan_model(
                model, x, budget=between(least, fraction), mode="graph"), fraction, None))
    if policies:
        half_plain = least.plain_peak_bytes // 2
        for label, budget, chosen in (("budget 0.50 policies=auto", between(least, 0.5), "auto"),
                                      ("budget 1/2 plain", half_plain, None),
                                      ("budget 1/2 plain policies=auto", half_plain, "auto")):
            if wanted(label) and budget >= least.min_budget_bytes:
                started = time.perf_counter()
                plan = tc.plan_model(model, x, budget=budget, mode="graph", policies=chosen)
                out["graph"].append((label, plan, None, time.perf_counter() - started))
    if not xla:
        return out
    try:
        xla_least = tc.plan_model(model, x, budget="min", mode="xla")
        out["xla"].append(("budget=min", xla_least, 0.0, None))
        for fraction in fractions:
            out["xla"].append((f"budget {fraction:.2f}", tc.plan_model(
                model, x, budget=between(xla_least, fraction), mode="xla"), fraction, None))
    except Exception as error:  # noqa: BLE001 - reported in the table
        out["error"] = repr(error)
    return out


def _interleaved(name: str, steps: dict, rounds: int, rows: list[dict]) -> None:
    """Step time x plain of every ``tf.function`` strategy, timed in interleaved
    rounds (each round runs every step once, in a rotating order; the median of
    the per-round ratios): on a shared machine the one-after-another medians
    drift (ResNet50's halfway plan read 1.35x plain one after another, 1.18x
    interleaved with plain)."""
    names = list(steps)
    if len(names) < 2:
        return
    ratios: dict[str, list[float]] = {s: [] for s in names}
    for k in range(rounds):
        order = names[k % len(names):] + names[:k % len(names)]
        seconds = {}
        for strategy in order:
            step, inputs = steps[strategy]
            started = time.perf_counter()
            step(inputs).numpy()
            seconds[strategy] = time.perf_counter() - started
        for strategy in names:
            ratios[strategy].append(seconds[strategy] / seconds["plain"])
    for row in rows:
        if row["model"] == name and not row.get("xla") and row["strategy"] in ratios:
            row["step_x_plain_interleaved"] = statistics.median(ratios[row["strategy"]])
            row["interleaved_rounds"] = rounds
    print(json.dumps({s: round(statistics.median(r), 3) for s, r in ratios.items()}),
          file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", type=int, default=3, help="budgets between min and plain")
    parser.add_argument("--only", default="", help="a regular expression: run only the "
                        "strategies whose names match it (and plain), e.g. 'budget 0.50|"
                        "1/2 plain'; 'XLA' selects the XLA rows")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved timing rounds (step time x plain)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="models measured at once (peaks are per process; step-time "
                        "ratios scatter more on a shared machine)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    _cli.add_output_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tiny, args.budgets, args.only,
                                args.rounds)))
        return
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
    rows: list[dict] = []
    def measured(name: str) -> subprocess.CompletedProcess:
        command = [sys.executable, __file__, "--worker", name, "--budgets", str(args.budgets),
                   "--only", args.only, "--rounds", str(args.rounds)]
        return subprocess.run(command + (["--tiny"] if args.tiny else []), env=env,
                              capture_output=True, text=True, check=False)

    names = args.models.split(",")
    # A pool of `parallel` workers, each a process of its own; rows in model order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for name, done in zip(names, pool.map(measured, names)):
            sys.stderr.write(done.stderr)
            if done.returncode != 0:
                rows.append(dict(model=name, strategy="(failed)", error=done.stderr[-2000:]))
                continue
            rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    from benchmarks.whole_model_report import write  # noqa: PLC0415

    write(rows, _cli.output_dir(args) / "whole_model", parallel=args.parallel)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
