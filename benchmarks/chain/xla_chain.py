"""XLA peak of a Dense chain: plain against `checkpointable` on every layer.

24 `Dense(256, activation="gelu")` layers, batch 4096, one training step (loss: the
mean of the output squared, gradients for every weight) under
`tf.function(jit_compile=True)`, its peak read with `tf_checkpointing.debug.measure`. Both
chains start from the same weights; the gradients are compared too. Target: the
checkpointed peak at most half the plain one. The script runs on any TensorFlow the
package accepts, which is what it is for: `.ci/oldest_tf` runs the test suite on the
oldest one, this shows what XLA makes of the replays there.

Usage:
    python benchmarks/chain/xla_chain.py            # ~30 s on 2 cores
    python benchmarks/chain/xla_chain.py --tiny     # 3 layers of 32 on a batch of 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:  # run as a script: the repository holds `benchmarks`
    sys.path.insert(0, str(_REPO))

# Sets TF_CPU_ALLOCATOR_USE_BFC and TF_CPP_MIN_LOG_LEVEL: before TensorFlow is imported.
from benchmarks import _cli  # noqa: E402

with _cli.quiet_start_up():
    import keras  # noqa: E402
    import numpy as np  # noqa: E402
    import tensorflow as tf  # noqa: E402

import tf_checkpointing as tc  # noqa: E402
from tf_checkpointing.core._memory import grow_cpu_pool  # noqa: E402

SIZES = {"full": dict(layers=24, width=256, batch=4096), "tiny": dict(layers=3, width=32, batch=64)}
TARGET = 0.5


def chain(layers: int, width: int, checkpointed: bool, weights=None) -> list:
    dense = [keras.layers.Dense(width, activation="gelu") for _ in range(layers)]
    for k, layer in enumerate(dense):
        layer.build((None, width))
        if weights is not None:
            layer.set_weights(weights[k])
    return [tc.checkpointable(layer, checkpoint=True) for layer in dense] if checkpointed else dense


def step_of(layers: list):
    variables = [v for layer in layers for v in layer.trainable_variables]

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            y = x
            for layer in layers:
                y = layer(y)
            loss = tf.reduce_mean(tf.square(y))
        return tape.gradient(loss, variables)

    return step


def peak_mib(step, x) -> tuple[float, list]:
    step(x)  # compiles: the measured call runs the compiled step alone
    stats = tc.debug.measure(step, x)
    return stats.peak_mib, [g.numpy() for g in stats.result]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy shapes (seconds)")
    size = SIZES["tiny" if parser.parse_args(argv).tiny else "full"]
    # Before any step: a step run first opens a BFC region that is then counted whole (the
    # checkpointed chain read 262 MiB instead of 142 on TF 2.16;
    # docs/measuring-memory.md#cpu-xla-steps-and-the-allocators-regions).
    grow_cpu_pool()
    keras.utils.set_random_seed(0)
    plain = chain(size["layers"], size["width"], checkpointed=False)
    ours = chain(size["layers"], size["width"], checkpointed=True,
                 weights=[layer.get_weights() for layer in plain])
    x = tf.random.normal([size["batch"], size["width"]])
    plain_mib, plain_grads = peak_mib(step_of(plain), x)
    ours_mib, our_grads = peak_mib(step_of(ours), x)
    error = max(float(np.max(np.abs(a - b))) for a, b in zip(plain_grads, our_grads))
    ratio = ours_mib / plain_mib
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}; {size['layers']} x "
          f"Dense({size['width']}, gelu), batch {size['batch']}, XLA")
    print(f"plain         {plain_mib:8.1f} MiB")
    print(f"checkpointed  {ours_mib:8.1f} MiB  ({ratio:.2f}x plain, target <= {TARGET}x)")
    print(f"largest gradient difference {error:.2e}")
    return 0 if ratio <= TARGET or size is SIZES["tiny"] else 1


if __name__ == "__main__":
    sys.exit(main())
