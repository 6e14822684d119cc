"""A custom training loop under tf.distribute.MirroredStrategy, blocks checkpointed.

Two replicas on two logical CPU devices (on a machine with GPUs, use
`tf.distribute.MirroredStrategy()` for all of them), each running a stack of
residual MLP blocks with dropout. The same loop runs twice from the same weights
and seeds: plain, and with each block wrapped in `checkpointable(block,
checkpoint=True)`, which keeps only the block's input per replica and replays it
during backprop (dropout masks included, so the losses are equal). Prints peak
memory and step time of both.

    python examples/distributed_loop.py          # 8 blocks, width 256 (~1 min on 2 CPU cores)
    python examples/distributed_loop.py --tiny   # 4 blocks, width 64 (~30 s; what the tests run)
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

SIZES = {
    "default": dict(blocks=8, width=256, hidden=1024, global_batch=2048, steps=5),
    # Small, but the full batch: each block's activations (a few MiB) outweigh its
    # weights and the step's other buffers, so the saving shows through the replicas'
    # interleaving. Four blocks: tracing the two replicas' steps is most of the run.
    "tiny": dict(blocks=4, width=64, hidden=256, global_batch=2048, steps=5),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes (~30 s)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    ARGS = parse_args()  # before TensorFlow starts: --help answers at once

from _common import interleaved_steps, print_comparison, start_tensorflow  # noqa: E402

start_tensorflow()  # exact CPU memory statistics, no start-up noise

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tf_checkpointing import checkpointable  # noqa: E402
from tf_checkpointing.debug import measure  # noqa: E402


class Block(keras.layers.Layer):
    """x + Dropout(Dense(gelu(Dense(LayerNorm(x)))))."""

    def __init__(self, width: int, hidden: int, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(hidden, activation="gelu")
        self.down = keras.layers.Dense(width)
        self.dropout = keras.layers.Dropout(0.1)

    def call(self, x, training=None):
        return x + self.dropout(self.down(self.up(self.norm(x))), training=training)


def build(size: dict, checkpoint: bool, seed: int = 0) -> tuple[keras.Model, list]:
    keras.utils.set_random_seed(seed)  # same weights and dropout seeds for both runs
    blocks = [Block(size["width"], size["hidden"], name=f"block_{i}")
              for i in range(size["blocks"])]
    if checkpoint:  # a checkpointable(layer) proxy is still the layer for Keras
        blocks = [checkpointable(block, checkpoint=True) for block in blocks]
    model = keras.Sequential([keras.Input((size["width"],)), *blocks, keras.layers.Dense(1)])
    return model, blocks


def training_step(strategy: tf.distribute.Strategy, size: dict,
                  checkpoint: bool) -> Callable[[], float]:
    """One training step of the model, as a function that runs it and returns its loss."""
    with strategy.scope():
        model, _ = build(size, checkpoint)
        optimizer = keras.optimizers.SGD(1e-3)
    features = tf.random.stateless_normal([size["global_batch"], size["width"]], seed=[1, 2])
    labels = tf.reduce_mean(features, axis=1, keepdims=True)
    dataset = tf.data.Dataset.from_tensors((features, labels)).repeat()
    batches = iter(strategy.experimental_distribute_dataset(dataset))

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(x, training=True) - y), axis=1)
            loss = tf.nn.compute_average_loss(per_example,
                                              global_batch_size=size["global_batch"])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(batch):
        losses = strategy.run(replica_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return lambda: float(train_step(next(batches)))


def main(args: argparse.Namespace) -> int:
    size = SIZES["tiny" if args.tiny else "default"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)  # before TF's runtime starts
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    print(f"MirroredStrategy over {strategy.num_replicas_in_sync} replicas; {size['blocks']} "
          f"blocks of width {size['width']}, global batch {size['global_batch']}")
    steps = {"plain": training_step(strategy, size, checkpoint=False),
             "checkpointed": training_step(strategy, size, checkpoint=True)}
    measured = {}
    for name, step in steps.items():
        step()  # traces, creates the optimizer's state
        # Both replicas' devices share one allocator, and how their threads interleave
        # moves a step's peak: the median of a few steps.
        runs = [measure(step, device="CPU:0") for _ in range(5)]
        peak = statistics.median(stats.peak_mib for stats in runs)
        measured[name] = dict(peak_mib=peak, loss=runs[0].result)
    seconds = interleaved_steps(steps, rounds=size["steps"])
    print_comparison({name: dict(measured[name], step_s=seconds[name]) for name in steps},
                     loss_of="measured step (the second)")
    print("(both replicas share the process's CPU allocator: the peak is of both)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(ARGS))
