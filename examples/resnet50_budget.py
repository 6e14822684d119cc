"""Train keras.applications.ResNet50 with ``fit`` within a memory budget.

    TF_CPU_ALLOCATOR_USE_BFC=true python examples/resnet50_budget.py           # 128x128, batch 16
    TF_CPU_ALLOCATOR_USE_BFC=true python examples/resnet50_budget.py --tiny    # seconds

The model is built from its constructor (random weights, nothing downloaded).
``apply_checkpointing(model, budget=...)`` plans, on the first training step,
which regions of the layer graph to run checkpointed; ``fit`` is unchanged.
The script prints the peak memory and step time of a plain and of a
checkpointed training step, measured in this run.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")  # before TensorFlow starts
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_checkpointing as tc  # noqa: E402


def build(size: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
    model.compile(keras.optimizers.SGD(0.01), "sparse_categorical_crossentropy")
    return model


def step_stats(model: keras.Model, x: np.ndarray, y: np.ndarray, steps: int) -> tuple[int, float]:
    """(peak bytes of one training step, seconds per step) under ``fit``."""
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # trace (and plan) first
    peak = tc.measure(lambda: model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)).peak_bytes
    started = time.perf_counter()
    model.fit(x, y, batch_size=len(x), epochs=steps, verbose=0)
    return peak, (time.perf_counter() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="32x32 images, batch 4, 1 step")
    parser.add_argument("--budget", default=None,
                        help="'min', or a fraction of the plain step's peak (default 0.6; "
                             "--tiny: min)")
    args = parser.parse_args()
    size, batch, steps = (32, 4, 1) if args.tiny else (128, 16, 3)
    budget_arg = args.budget or ("min" if args.tiny else "0.6")
    rng = np.random.default_rng(0)
    x = rng.random((batch, size, size, 3), np.float32)
    y = rng.integers(0, 10, batch)

    plain_peak, plain_time = step_stats(build(size), x, y, steps)
    model = build(size)
    budget = "min" if budget_arg == "min" else int(float(budget_arg) * plain_peak)
    tc.apply_checkpointing(model, budget=budget)
    peak, seconds = step_stats(model, x, y, steps)
    plan = model.call.plan
    print(plan)
    mib = 2**20
    print(f"plain:        peak {plain_peak / mib:8.1f} MiB, {plain_time * 1e3:8.0f} ms per step")
    print(f"checkpointed: peak {peak / mib:8.1f} MiB, {seconds * 1e3:8.0f} ms per step "
          f"(budget {'min' if budget == 'min' else f'{budget / mib:.1f} MiB'})")
    print(f"ratio:        memory {peak / plain_peak:.2f}x plain, time "
          f"{seconds / plain_time:.2f}x plain")


if __name__ == "__main__":
    main()
