"""Losses layers add inside a checkpointed call (``add_loss``, activity regularizers).

Each case runs a plain twin and a checkpointed model with the same weights:
the losses in ``model.losses``, the total loss, and every variable's gradient
(of the outputs' squares plus ``model.losses``) must be equal, the losses must
be listed once (not again after the replay), and the replay must have run.
Also state a forward creates (Keras' global SeedGenerator, made by the first
unseeded draw): found together with the losses, on keras.applications models.
"""


import keras
import numpy as np
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close, with_spans

import tf_checkpointing as tc


class Penalized(keras.layers.Layer):
    """Adds a loss of its input in ``call`` and counts its replays."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.replays = 0

    def call(self, h):
        if tc.is_recomputing():
            self.replays += 1
        self.add_loss(0.05 * tf.reduce_sum(h ** 2))
        return h * 2.0


def _regularized(width=16):
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = keras.layers.Dense(width, activation="tanh", name="d0",
                           activity_regularizer=keras.regularizers.L2(0.1))(x)
    h = Penalized(name="pen")(h)
    h = keras.layers.Dense(width, activation="relu", name="d1")(h)
    return keras.Model(x, keras.layers.Dense(2, name="head")(h))


def _step(model, x, mode):
    def step(x):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            extra = tf.add_n(model.losses)
            loss = tf.reduce_sum(out ** 2) + extra
        return loss, extra, len(model.losses), tape.gradient(loss, model.trainable_variables)

    if mode == "eager":
        return step(x)
    counts = []

    def traced(x):
        loss, extra, count, grads = step(x)
        counts.append(count)
        return loss, extra, grads

    loss, extra, grads = compile_step(traced, mode)(x)
    return loss, extra, counts[-1], grads


def _twins(width=16):
    plain, ours = _regularized(width), _regularized(width)
    ours.set_weights(plain.get_weights())
    return plain, ours


X = tf.random.stateless_normal([8, 8], [1, 2])


def test_a_region_with_added_losses_gets_their_gradients(mode):
    plain, ours = _twins()
    least = tc.plan_model(ours, X, budget="min", mode="eager")
    tc.apply_checkpointing(ours, plan=with_spans(least, ((0, 3, ()),)))
    expected, got = _step(plain, X, mode), _step(ours, X, mode)
    assert got[2] == expected[2] == 2  # listed once: not again after the replay
    assert_all_close(got[1], expected[1])
    assert_all_close(got[0], expected[0])
    assert_all_close(got[3], expected[3], atol=1e-5)
    assert ours.get_layer("pen").replays == 1


def test_fit_with_added_losses_in_a_region_trains_as_plain():
    plain, ours = _twins()
    least = tc.plan_model(ours, X, budget="min", mode="graph")
    tc.apply_checkpointing(ours, plan=with_spans(least, ((0, 3, ()),)))
    y = tf.random.stateless_normal([8, 2], [3, 4])
    for model in (plain, ours):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    expected = plain.fit(X, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
    got = ours.fit(X, y, batch_size=8, epochs=3, verbose=0, shuffle=False)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
    assert_all_close(ours.get_weights(), plain.get_weights(), atol=1e-6)
    assert ours.get_layer("pen").replays >= 1


def test_planning_leaves_no_loss_behind():
    _, ours = _twins()
    ours(X)  # Keras clears the losses at each top-level call; this one adds two
    tc.plan_model(ours, X, budget="min", mode="eager")
    assert len(ours.losses) == 2
    tc.apply_checkpointing(ours, budget="min")
    with tf.GradientTape():
        ours(X, training=True)  # plans here, then runs
    assert len(ours.losses) == 2


def test_a_checkpointable_layer_and_function_with_added_losses(mode):
    keras.utils.set_random_seed(0)
    layer = Penalized()
    wrapped = tc.checkpointable(Penalized())
    dense = keras.layers.Dense(4, activity_regularizer="l2")
    block = tc.checkpointable(lambda x: dense(x) * 3.0)
    v = tf.Variable(tf.random.stateless_normal([4, 3], [5, 6]))

    def step(fn, owner):
        def run():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(fn(v)) + tf.add_n(owner.losses)
            return loss, len(owner.losses), tape.gradient(loss, [v, *dense.trainable_variables])
        return compile_step(run, mode)() if mode == "eager" else _traced(run, mode)

    plain = step(lambda x: layer(x), layer)
    ours = step(lambda x: wrapped(x, _checkpoint=True), wrapped)
    assert ours[1] == plain[1] == 1
    assert_all_close(ours[0], plain[0])
    assert_all_close(ours[2][0], plain[2][0], atol=1e-5)
    assert wrapped.replays == 1
    plain = step(lambda x: dense(x) * 3.0, dense)
    ours = step(lambda x: block(x, _checkpoint=True), dense)
    assert ours[1] == plain[1] == 1
    assert_all_close(ours[0], plain[0])
    assert_all_close(ours[2], plain[2], atol=1e-5)


def _traced(run, mode):
    counts = []

    def traced():
        loss, count, grads = run()
        counts.append(count)
        return loss, grads

    loss, grads = compile_step(traced, mode)()
    return loss, counts[-1], grads


def test_a_generator_created_inside_the_forward_replays_its_first_draw(mode):
    """Keras' global SeedGenerator does not exist after set_random_seed until the
    first unseeded draw, here inside the checkpointed forward: the replay must
    draw the forward's mask (StochasticDepth in ConvNeXt draws this way)."""
    dense = keras.layers.Dense(6)
    dense.build((4, 6))

    def block(x):
        keep = keras.random.uniform([4, 1]) > 0.5  # unseeded: the global generator
        return tf.where(keep, dense(x), 0.0) + x

    wrapped = tc.checkpointable(block)
    x = tf.random.stateless_normal([4, 6], [7, 8])
    runs = {}
    for name, fn in (("plain", block), ("ours", lambda x: wrapped(x, _checkpoint=True))):
        keras.utils.set_random_seed(3)

        def run(fn=fn):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(x) ** 2)
            return loss, tape.gradient(loss, [x, *dense.trainable_variables])

        runs[name] = compile_step(run, mode)()
    assert_all_close(runs["ours"][0], runs["plain"][0])
    assert_all_close(runs["ours"][1], runs["plain"][1], atol=1e-5)
