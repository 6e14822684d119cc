"""Planning inside the first step draws no random numbers the user would see.

The profile runs the layers; an unseeded ``keras.random`` draw there (ConvNeXt's
``StochasticDepth``) created and advanced Keras' global ``SeedGenerator`` (seeded
from Python's ``random``), so the step that planned, and every later one, drew
other numbers than the plain model: another random trajectory.
"""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

import tf_checkpointing as tc


class UnseededDrop(keras.layers.Layer):
    """Drops the whole residual branch per example, drawing with no seed (as
    ``keras.applications.convnext.StochasticDepth`` does)."""

    def call(self, x, training=None):
        if not training:
            return x
        keep = keras.random.uniform([tf.shape(x)[0], 1, 1, 1]) > 0.5
        return tf.where(keep, x * 2.0, 0.0)


def _residual_net():
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((8, 8, 4))
    for _ in range(3):
        h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
        h = keras.layers.Conv2D(4, 3, padding="same")(h)
        x = keras.layers.Add()([x, UnseededDrop()(h)])
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(x)))


def _chain():
    keras.utils.set_random_seed(0)
    layers = []
    for _ in range(4):
        layers += [keras.layers.Dense(16, activation="relu"), UnseededDrop(),
                   keras.layers.Dropout(0.2)]
    return [keras.layers.Reshape((1, 1, 16))] + layers


def _steps(model, x, mode, n=2):
    """``n`` steps, each after ``set_random_seed(10 + step)``: losses and gradients."""
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    run = compile_step(step, mode)
    out = []
    for k in range(n):
        keras.utils.set_random_seed(10 + k)
        out.append(run(x))
    return out


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_plan_made_in_the_first_step_keeps_the_plain_random_draws(mode):
    x = tf.random.stateless_normal([8, 8, 8, 4], [1, 2])
    plain, ours = _residual_net(), _residual_net()
    tc.apply_checkpointing(ours, budget="min")
    expected, got = _steps(plain, x, mode), _steps(ours, x, mode)
    assert ours.call.plan.regions, "the least plan checkpoints regions"
    for (loss, grads), (plain_loss, plain_grads) in zip(got, expected):
        assert_all_close(loss, plain_loss)
        assert_all_close(grads, plain_grads, atol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_a_chain_planned_in_the_first_step_keeps_the_plain_random_draws(mode):
    x = tf.random.stateless_normal([32, 16], [3, 4])
    plain = keras.Sequential(_chain())
    ours = tc.CheckpointedSequential(_chain(), budget="min")
    expected, got = _steps(plain, x, mode), _steps(ours, x, mode)
    for (loss, grads), (plain_loss, plain_grads) in zip(got, expected):
        assert_all_close(loss, plain_loss)
        assert_all_close(grads, plain_grads, atol=1e-5)


def test_plan_model_leaves_every_random_generator_as_it_was():
    model = _residual_net()
    x = tf.random.stateless_normal([8, 8, 8, 4], [1, 2])
    keras.utils.set_random_seed(5)
    keras.random.uniform([1])  # the global SeedGenerator exists, with a state
    generator = keras.src.random.seed_generator.global_seed_generator()
    before = (random.getstate(), np.random.get_state()[1].copy(),
              generator.state.numpy().copy(), float(tf.random.uniform([])))
    keras.utils.set_random_seed(5)
    keras.random.uniform([1])
    generator = keras.src.random.seed_generator.global_seed_generator()
    tc.plan_model(model, x, budget="min", mode="graph")
    assert keras.src.random.seed_generator.global_seed_generator() is generator
    after = (random.getstate(), np.random.get_state()[1], generator.state.numpy(),
             float(tf.random.uniform([])))
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1], before[1])
    np.testing.assert_array_equal(after[2], before[2])
    assert after[3] == before[3]  # TensorFlow's unseeded-op sequence


def test_a_generator_made_by_planning_is_not_left_behind():
    model = _residual_net()
    keras.utils.set_random_seed(5)  # removes Keras' global SeedGenerator
    tc.plan_model(model, tf.random.stateless_normal([8, 8, 8, 4], [1, 2]), budget="min",
                  mode="eager")
    assert keras.src.backend.common.global_state.get_global_attribute(
        "global_seed_generator") is None


_MODULE_GENERATOR = tf.random.Generator.from_seed(8)


class ModuleNoise(keras.layers.Layer):
    """Draws from a module-level generator, which no tracking reaches."""

    def call(self, x, training=None):
        return x + _MODULE_GENERATOR.normal(tf.shape(x)) if training else x


def test_a_chain_planned_in_the_first_step_puts_back_a_generator_it_does_not_track():
    """Measuring the save policies (``policies="auto"``) runs the layers outside
    the profile's recorder of eager writes: it advanced the module-level generator
    and left it so, and every later draw was another part of its sequence than
    plain's."""
    x = tf.random.stateless_normal([32, 16], [3, 5])

    def steps(model):
        _MODULE_GENERATOR.reset_from_seed(8)
        return _steps(model, x, "graph"), _MODULE_GENERATOR.state.numpy()

    def chain():
        keras.utils.set_random_seed(0)
        return [keras.layers.Dense(16, activation="relu"), ModuleNoise(),
                keras.layers.Dense(16, activation="relu"), ModuleNoise(), keras.layers.Dense(4)]

    (expected, plain_state) = steps(keras.Sequential(chain()))
    (got, state) = steps(tc.CheckpointedSequential(chain(), budget="min", policies="auto"))
    np.testing.assert_array_equal(state, plain_state)
    for (loss, grads), (plain_loss, plain_grads) in zip(got, expected):
        assert_all_close(loss, plain_loss)
        assert_all_close(grads, plain_grads, atol=1e-5)
