"""Exact replay: the recomputation sees the randomness and state the forward saw."""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close, grads_of

from tf_checkpointing import (
    ReplayMismatchError,
    checkpointable,
    is_checkpointing,
    is_recomputing,
)


def test_flags_inside_forward_replay_and_outside(mode):
    log = []

    def body(x):
        log.append((is_recomputing(), is_checkpointing()))
        return x * 2.0

    grads_of(checkpointable(body, checkpoint=True), [tf.constant(1.0)], [], mode)
    assert log == [(False, True), (True, True)]
    assert (is_recomputing(), is_checkpointing()) == (False, False)


# Each factory returns a fresh (function, variables) pair whose random source
# starts in the same state every time, so a plain twin draws what the forward drew.
def _keras_dropout():
    layer = keras.layers.Dropout(0.5, seed=11)
    w = tf.Variable(tf.linspace(0.5, 1.5, 8), name="w")
    return (lambda x: layer(x * w, training=True)), [w]


def _keras_gaussian_noise_and_random_ops():
    noise = keras.layers.GaussianNoise(0.3, seed=5)
    seeds = keras.random.SeedGenerator(3)
    return (lambda x: noise(x, training=True) * keras.random.uniform([8], seed=seeds)), []


def _keras_dropout_from_training_context():
    """Dropout without training=: it inherits training=True from the outer layer."""

    class Outer(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.dropout = keras.layers.Dropout(0.5, seed=2)
            self.block = checkpointable(lambda x: self.dropout(x) * 3.0)

        def call(self, x, training=None, checkpoint=False):
            return self.block(x, _checkpoint=checkpoint)

    outer = Outer()
    return (lambda x, _checkpoint=False: outer(x, training=True, checkpoint=_checkpoint)), []


def _tf_generator():
    gen = tf.random.Generator.from_seed(7)
    return (lambda x: x * gen.normal([8]) + gen.uniform([8])), []


def _tf_global_generator():
    tf.random.set_global_generator(tf.random.Generator.from_seed(9))

    def body(x):
        return x * tf.random.get_global_generator().normal([8])

    return body, []


def _stateless():
    return (lambda x: x * tf.random.stateless_uniform([8], seed=[1, 2])), []


RANDOM_SOURCES = {
    "keras_dropout": _keras_dropout,
    "keras_noise_and_random": _keras_gaussian_noise_and_random_ops,
    "keras_training_context": _keras_dropout_from_training_context,
    "tf_generator": _tf_generator,
    "tf_global_generator": _tf_global_generator,
    "stateless": _stateless,
}


@pytest.mark.parametrize("source", list(RANDOM_SOURCES))
def test_random_ops_replay_exactly(source, mode):
    x = tf.linspace(-1.0, 2.0, 8)
    plain_fn, plain_vars = RANDOM_SOURCES[source]()
    plain = grads_of(plain_fn, [x], plain_vars, mode)
    fn, variables = RANDOM_SOURCES[source]()
    step = lambda x: checkpointable(fn)(x, _checkpoint=True)  # noqa: E731
    if source == "keras_training_context":
        step = lambda x: fn(x, _checkpoint=True)  # noqa: E731
    ours = grads_of(step, [x], variables, mode)
    assert_all_close(ours, plain)
    if source != "stateless":  # the next step draws new numbers
        again = grads_of(step, [x], variables, mode)
        assert not np.allclose(again[1][0], ours[1][0])


@pytest.mark.parametrize("legacy_op", ["uniform", "nn_dropout"])
def test_force_seed_replays_legacy_stateful_ops(legacy_op, mode):
    def body(x):
        if legacy_op == "uniform":
            return x * tf.random.uniform([64])
        return tf.nn.dropout(x, rate=0.5)

    wrapped = checkpointable(body, force_seed=True)
    x = tf.linspace(1.0, 2.0, 64)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(x, _checkpoint=True)
        return y, tape.gradient(y, x)

    step = compile_step(step, mode)
    y, grad = step(x)
    # The exact gradient for the numbers the forward drew: dy/dx = y / x.
    np.testing.assert_allclose(grad, y / x, rtol=1e-5)
    y2, _ = step(x)
    assert not np.allclose(y, y2), "consecutive steps must draw new numbers"


def test_force_seed_does_not_reset_the_users_global_seed():
    wrapped = checkpointable(lambda x: x * tf.random.uniform([4]), force_seed=True)
    x = tf.ones([4])
    tf.random.set_seed(5)
    expected = [tf.random.uniform([3]).numpy() for _ in range(2)]
    tf.random.set_seed(5)
    first = tf.random.uniform([3]).numpy()
    grads_of(lambda x: wrapped(x, _checkpoint=True), [x], [], "eager")
    second = tf.random.uniform([3]).numpy()
    np.testing.assert_array_equal([first, second], expected)


def _bn_block():
    keras.utils.set_random_seed(3)
    dense = keras.layers.Dense(4)
    bn = keras.layers.BatchNormalization(momentum=0.5)
    counter = tf.Variable(0, trainable=False)

    def body(x):
        counter.assign_add(1)
        return tf.nn.relu(bn(dense(x), training=True))

    return body, dense, bn, counter


def test_batchnorm_statistics_and_counters_update_once(mode):
    x = tf.random.stateless_normal([16, 3], seed=[4, 4])
    plain_body, plain_dense, plain_bn, plain_counter = _bn_block()
    body, dense, bn, counter = _bn_block()
    plain_body(x), body(x)  # build both
    dense.set_weights(plain_dense.get_weights())
    variables = lambda d, b: d.trainable_variables + b.trainable_variables  # noqa: E731
    plain = grads_of(plain_body, [x], variables(plain_dense, plain_bn), mode)
    ours = grads_of(lambda x: checkpointable(body)(x, _checkpoint=True), [x],
                    variables(dense, bn), mode)
    assert_all_close(ours, plain)
    assert_all_close(bn.non_trainable_variables, plain_bn.non_trainable_variables)
    assert int(counter.numpy()) == int(plain_counter.numpy()) == 2


def test_replay_sees_the_counter_value_the_forward_saw(mode):
    counter = tf.Variable(5.0, trainable=False)

    def body(x):
        counter.assign_add(1.0)
        return x * counter.read_value()  # 6.0 in the forward: the replay must see 6.0 too

    x = tf.constant([1.0, 2.0])
    _, (grad,) = grads_of(checkpointable(body, checkpoint=True), [x], [], mode)
    np.testing.assert_allclose(grad, 2 * 36.0 * x)
    assert float(counter.numpy()) == 6.0


class _Boom(Exception):
    pass


def test_exception_in_forward_leaves_no_trace():
    counter = tf.Variable(1.0, trainable=False)
    gen = tf.random.Generator.from_seed(1)
    state = gen.state.numpy().copy()

    def body(x):
        counter.assign(counter * 10.0)
        gen.normal([3])
        raise _Boom("in forward")

    with pytest.raises(_Boom, match="in forward"):
        grads_of(checkpointable(body, checkpoint=True, force_seed=True), [tf.ones([3])], [],
                 "eager")
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    assert float(counter.numpy()) == 1.0
    np.testing.assert_array_equal(gen.state.numpy(), state)


def test_exception_only_in_replay_leaves_no_trace(mode):
    bn = keras.layers.BatchNormalization()
    gen = tf.random.Generator.from_seed(1)

    def body(x):
        if is_recomputing():
            raise _Boom("in replay")
        return bn(x, training=True) * gen.normal([3])

    x = tf.random.stateless_normal([4, 3], seed=[1, 1])
    bn(x)
    with pytest.raises(_Boom, match="in replay"):
        grads_of(checkpointable(body, checkpoint=True), [x], [], mode)
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    # Eagerly the forward ran and its updates stay; the failed replay changed
    # nothing. Under tf.function the error comes while tracing: nothing ran.
    after_forward = [v.numpy() for v in bn.non_trainable_variables], gen.state.numpy()
    bn2 = keras.layers.BatchNormalization()
    bn2(x)
    gen2 = tf.random.Generator.from_seed(1)
    if mode == "eager":
        bn2(x, training=True)
        gen2.normal([3])
    assert_all_close(after_forward[0], [v.numpy() for v in bn2.non_trainable_variables])
    np.testing.assert_array_equal(after_forward[1], gen2.state.numpy())


class TestCheckMode:
    def test_structure_mismatch_is_reported(self):
        calls = []

        def body(x):
            calls.append(1)
            y = x * 2.0  # computed: an argument returned as it is needs no replay
            return y if len(calls) == 1 else (y, y)

        wrapped = checkpointable(body, checkpoint=True, check=True)
        with pytest.raises(ReplayMismatchError,
                           match=r"replay of `.*body` returned .* forward returned"):
            grads_of(wrapped, [tf.ones([2])], [], "eager")

    def test_python_random_is_caught_with_a_fix_that_fits(self):
        """The documented cause: Python's `random` inside the block. Eager: the
        library's own error, naming the function and the fix for that cause."""
        rng = random.Random(0)

        def noisy_block(x):
            return x * rng.random()

        wrapped = checkpointable(noisy_block, checkpoint=True, check="values")
        with pytest.raises(ReplayMismatchError) as info:
            grads_of(wrapped, [tf.ones([4])], [], "eager")
        message = str(info.value)
        assert "replay of `" in message and "noisy_block` computed other values" in message
        assert "largest difference" in message
        assert "Python's `random`" in message and "SeedGenerator" in message
        assert isinstance(info.value, RuntimeError)

    def test_values_catch_an_unreplayed_random_source_eagerly(self):
        wrapped = checkpointable(lambda x: x * tf.random.uniform([256]), checkpoint=True,
                                 check="values")
        with pytest.raises(ReplayMismatchError, match="_force_seed=True"):
            grads_of(wrapped, [tf.ones([256])], [], "eager")

    def test_values_in_a_graph_carry_the_same_message(self):
        """In a tf.function the check is a graph op: TensorFlow raises, with our
        message and no assertion wrapper text around it."""
        wrapped = checkpointable(lambda x: x * tf.random.uniform([256]), checkpoint=True,
                                 check="values")
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            grads_of(wrapped, [tf.ones([256])], [], "graph")
        message = str(info.value)
        assert "assertion failed: [checkpointable: the replay of `" in message
        assert "<lambda>` computed other values" in message
        assert "_force_seed=True" in message
        assert "Expected 'tf.Tensor(False" not in message

    def test_values_pass_when_replay_is_exact(self):
        wrapped = checkpointable(lambda x: x * tf.random.uniform([256]), checkpoint=True,
                                 check="values", force_seed=True)
        grads_of(wrapped, [tf.ones([256])], [], "eager")

    def test_environment_variable_turns_it_on(self, monkeypatch):
        monkeypatch.setenv("TF_CHECKPOINTING_CHECK", "values")
        wrapped = checkpointable(lambda x: x * tf.random.uniform([256]), checkpoint=True)
        with pytest.raises(ReplayMismatchError, match="computed other values"):
            grads_of(wrapped, [tf.ones([256])], [], "eager")

    def test_bad_check_value(self):
        with pytest.raises(TypeError, match=r"`check` must be False, True .*received 'yes'"):
            checkpointable(lambda x: x, check="yes")
