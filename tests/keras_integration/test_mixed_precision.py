"""Mixed precision: ``mixed_float16`` (with ``LossScaleOptimizer``) and
``mixed_bfloat16`` policies.

A checkpointed block computes in half precision with float32 variables. Its
replay must run under the autocast scope of the forward (or it would compute in
float32 and the gradients would not be those of the forward), and half-precision
inputs must get gradients (``tf.recompute_grad`` filters on float32, so the
layers upstream of the block silently stop training). Gradients are compared
leaf by leaf with the un-checkpointed model, within half-precision tolerance.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import ResidualBlock

from tf_checkpointing import apply_checkpointing, checkpointable, is_recomputing

RUNS: list = []  # (is_recomputing(), compute dtype seen inside the block)

POLICIES = {"mixed_float16": tf.float16, "mixed_bfloat16": tf.bfloat16}
# Gradients of the plain and the checkpointed graphs round differently (fusions,
# op order): compare within a few units of the half type's precision, relative
# to each tensor's largest entry (float16: 11 mantissa bits, bfloat16: 8).
TOLERANCE = {"mixed_float16": 2e-3, "mixed_bfloat16": 2e-2}


class Block(ResidualBlock):
    def __init__(self, **kwargs):
        super().__init__(activation="gelu", rate=0.2, seed=3, **kwargs)

    def record(self, hidden):
        RUNS.append((is_recomputing(), hidden.dtype))


@pytest.fixture(params=list(POLICIES))
def policy(request):
    keras.config.set_dtype_policy(request.param)
    yield request.param
    keras.config.set_dtype_policy("float32")


def build(checkpoint):
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = Block(name="block")(keras.layers.Dense(8, name="pre")(x))
    y = keras.layers.Dense(1, name="head", dtype="float32")(h)  # float32 loss
    model = keras.Model(x, y, name="net")
    if checkpoint:
        apply_checkpointing(model, ["block"])
    return model


def data(n=32):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def test_gradients_match_the_plain_model(policy, mode):
    compute_dtype, tolerance = POLICIES[policy], TOLERANCE[policy]
    x, y = data()
    grads = {}
    for checkpoint in (False, True):
        model = build(checkpoint)
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))

        def step(x, y, model=model, optimizer=optimizer):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
                scaled = optimizer.scale_loss(loss)  # x 2**15: float16 would overflow if wrong
            return tape.gradient(scaled, model.trainable_variables)

        RUNS.clear()
        grads[checkpoint] = compile_step(step, mode)(x, y)
        runs = list(RUNS)
        names = [v.path for v in model.trainable_variables]

    assert runs == [(False, compute_dtype), (True, compute_dtype)]  # replayed in half precision
    for name, plain, checkpointed in zip(names, grads[False], grads[True]):
        assert checkpointed is not None, f"{name} lost its gradient"
        assert checkpointed.dtype == tf.float32  # gradients of float32 master weights
        assert np.all(np.isfinite(checkpointed.numpy())), name
        np.testing.assert_allclose(
            checkpointed.numpy(), plain.numpy(), rtol=tolerance,
            atol=tolerance * np.abs(plain.numpy()).max(), err_msg=name,
        )
    upstream = dict(zip(names, grads[True]))["pre/kernel"]
    assert np.abs(upstream.numpy()).max() > 0  # the layer before the block still trains


def test_half_precision_inputs_get_gradients(policy):
    dtype = POLICIES[policy]
    w = tf.Variable(tf.random.stateless_normal([4, 4], [1, 2]))
    block = checkpointable(lambda x: tf.nn.gelu(x @ tf.cast(w, x.dtype)), checkpoint=True)
    x = tf.cast(tf.random.stateless_normal([3, 4], [3, 4]), dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(tf.cast(block(x), tf.float32))
    gx, gw = tape.gradient(y, [x, w])
    assert gx is not None and gx.dtype == dtype and gw is not None
    assert np.all(np.isfinite(tf.cast(gx, tf.float32).numpy()))


def test_fit_matches_the_plain_model(policy):
    x, y = data()
    weights = {}
    for checkpoint in (False, True):
        model = build(checkpoint)
        # Under mixed_float16, compile wraps the optimizer in a LossScaleOptimizer.
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        RUNS.clear()
        history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert np.isfinite(history.history["loss"][-1])
        weights[checkpoint] = model.weights
    runs = [recomputing for recomputing, _ in RUNS]  # traced once or twice: forward, replay
    assert runs and runs == [False, True] * (len(runs) // 2)
    for plain, checkpointed in zip(weights[False], weights[True]):
        np.testing.assert_allclose(
            checkpointed.numpy(), plain.numpy(), rtol=TOLERANCE[policy],
            atol=TOLERANCE[policy], err_msg=plain.path
        )
