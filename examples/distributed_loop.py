"""A custom training loop under tf.distribute.MirroredStrategy, blocks checkpointed.

Two replicas on two logical CPU devices (on a machine with GPUs, use
`tf.distribute.MirroredStrategy()` for all of them), each running a stack of
residual MLP blocks with dropout. The same loop runs twice from the same weights
and seeds: plain, and with each block wrapped in `checkpointable(block,
checkpoint=True)`, which keeps only the block's input per replica and replays it
during backprop (dropout masks included, so the losses are equal). Prints peak
memory and step time of both.

    python examples/distributed_loop.py          # 8 blocks, width 256 (~1 min on 2 CPU cores)
    python examples/distributed_loop.py --tiny   # toy sizes, seconds (what the tests run)
"""

from __future__ import annotations

import argparse
import os

# Before TensorFlow is imported: exact CPU memory statistics, and no C++ log lines.
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from _compare import median_step_seconds, print_comparison  # noqa: E402

from tf_checkpointing import checkpointable, measure  # noqa: E402

SIZES = {
    "default": dict(blocks=8, width=256, hidden=1024, global_batch=2048, steps=3),
    "tiny": dict(blocks=2, width=8, hidden=16, global_batch=8, steps=2),
}


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


def run(strategy: tf.distribute.Strategy, size: dict, checkpoint: bool) -> dict[str, float]:
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

    train_step(next(batches))  # traces, creates the optimizer's state
    peak = measure(lambda: train_step(next(batches)).numpy(), device="CPU:0").peak_mib
    step = median_step_seconds(lambda: train_step(next(batches)).numpy(), size["steps"])
    # After 2 + steps updates: equal losses mean equal gradients all along.
    return dict(peak_mib=peak, step_s=step, loss=float(train_step(next(batches))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (seconds)")
    args = parser.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "default"]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)  # before TF's runtime starts
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    print(f"MirroredStrategy over {strategy.num_replicas_in_sync} replicas; {size['blocks']} "
          f"blocks of width {size['width']}, global batch {size['global_batch']}")
    rows = {"plain": run(strategy, size, checkpoint=False),
            "checkpointed": run(strategy, size, checkpoint=True)}
    print_comparison(rows)
    print("(both replicas share the process's CPU allocator: the peak is of both)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
