"""Train keras.applications.ResNet50 with ``fit`` within a memory budget.

    python examples/resnet50_budget.py           # 128x128, batch 16, budget 0.6x plain (~5 min)
    python examples/resnet50_budget.py --tiny    # 64x64, batch 8, least memory (~1.5 min)

(on 2 CPU cores; planning measures each of the 176 layer calls: 35-75 s whatever the
size, depending on the machine's load.)

The model is built from its constructor (random weights, nothing downloaded).
``apply_checkpointing(model, budget=...)`` plans, on the first training step,
which regions of the layer graph to run checkpointed; ``fit`` is unchanged.
The script prints the plan, then the peak memory and step time of a plain and
of a checkpointed training step, measured in this run, and the loss of the first
step, computed before any update: the same but for rounding. Not a later one:
from random weights, ResNet50's gradients are ill-conditioned at these sizes
(its last BatchNorms normalize over 2x2 pixels at 64x64: an input changed by
1e-7 moved some of plain's kernel gradients by 20-30%), so the rounding of a
graph that sums in another order, as a checkpointed one does, parts the two
losses after the first update.
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="64x64 images, batch 8, least memory (~1.5 min)")
    parser.add_argument("--budget", default=None,
                        help="'min', or a fraction of the plain step's peak (default 0.6; "
                             "--tiny: min)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before TensorFlow starts: --help answers at once

from _common import (  # noqa: E402
    interleaved_fits,
    measured_step,
    print_comparison,
    start_tensorflow,
)

start_tensorflow()  # exact CPU memory statistics, no start-up noise

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_checkpointing as tc  # noqa: E402

# Below 64x64 (batch 8) the step's peak is mostly the weights' gradients, which no
# checkpoint frees: at 32x32, batch 4, the least plan kept 0.7x-1.1x plain's peak.
SIZES = {"default": dict(size=128, batch=16, steps=3),
         "tiny": dict(size=64, batch=8, steps=2)}


def build(size: int) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=10)
    model.compile(keras.optimizers.SGD(1e-3), "sparse_categorical_crossentropy")
    return model


def main(args: argparse.Namespace) -> int:
    shape = SIZES["tiny" if args.tiny else "default"]
    size, batch, steps = shape["size"], shape["batch"], shape["steps"]
    budget_arg = args.budget or ("min" if args.tiny else "0.6")
    rng = np.random.default_rng(0)
    x = rng.random((batch, size, size, 3), np.float32)
    y = rng.integers(0, 10, batch)
    print(f"ResNet50: {size}x{size} images, batch {batch}")

    plain = build(size)
    measured = {"plain": measured_step(plain, x, y, batch)}
    model = build(size)
    budget = ("min" if budget_arg == "min"
              else int(float(budget_arg) * measured["plain"]["peak_mib"] * 2**20))
    tc.apply_checkpointing(model, budget=budget)
    measured["checkpointed"] = measured_step(model, x, y, batch)  # plans on its first step
    print(model.call.plan)
    models = {"plain": plain, "checkpointed": model}
    xs, ys = np.concatenate([x] * steps), np.concatenate([y] * steps)
    seconds = interleaved_fits(models, xs, ys, batch, rounds=2)
    print_comparison({name: dict(peak_mib=measured[name]["peak_mib"], step_s=seconds[name],
                                 loss=measured[name]["first_loss"]) for name in models},
                     loss_of="first step, before any update")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
