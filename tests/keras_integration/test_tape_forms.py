"""Every tape form against the plain run: persistent tapes, nested tapes
(second order), ``jacobian`` (with and without pfor), ``batch_jacobian``,
``ForwardAccumulator`` (alone, inside a tape, around a tape), and Keras ``fit``
with ``steps_per_execution > 1`` (issue 10, hunt)."""

import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import Counter, assert_all_close
from test_keras_training import (
    COMPILES,
    RUNS,
    assert_same_weights,
    functional,
    subclassed,
    train_one_epoch,
    twin_models,
)

from tf_checkpointing import checkpointable

W = tf.Variable([[0.5, -1.0, 0.3], [1.2, 0.1, -0.4]], name="w")


def body(x):
    return tf.tanh(tf.matmul(x, W)) * x[:, :1]


def persistent(fn, x):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = fn(x)
        first, second = tf.reduce_sum(y), tf.reduce_sum(y ** 2)
    return tape.gradient(first, [x, W]) + tape.gradient(second, [x, W])


def nested(fn, x):
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(fn(x) ** 2)
        grad = inner.gradient(y, x)
        penalty = tf.reduce_sum(grad ** 2)
    return outer.gradient(penalty, [x, W])


def jacobian(fn, x, use_pfor=True):
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = fn(x)
    return [tape.jacobian(y, x, experimental_use_pfor=use_pfor),
            tape.jacobian(y, W, experimental_use_pfor=use_pfor)]


def batch_jacobian(fn, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = fn(x)
    return [tape.batch_jacobian(y, x)]


def forward_accumulator(fn, x):
    with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
        y = fn(x)
    return [y, acc.jvp(y)]


def forward_inside_tape(fn, x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
            y = fn(x)
        jvp = acc.jvp(y)
    return [jvp, tape.gradient(tf.reduce_sum(jvp ** 2), x)]


def forward_over_backward(fn, x):
    with tf.autodiff.ForwardAccumulator(x, tf.ones_like(x)) as acc:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(x) ** 2)
        grad = tape.gradient(y, x)
    return [grad, acc.jvp(grad)]


FORMS = {
    "persistent": (persistent, True),
    "nested": (nested, True),
    "jacobian": (jacobian, True),
    "jacobian_no_pfor": (lambda fn, x: jacobian(fn, x, use_pfor=False), True),
    "batch_jacobian": (batch_jacobian, True),
    # Forward mode keeps no activations: the call runs plainly (README, Limitations).
    "forward_accumulator": (forward_accumulator, False),
    "forward_inside_tape": (forward_inside_tape, False),
    "forward_over_backward": (forward_over_backward, False),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_tape_forms_match_the_plain_run(form, mode):
    run, replays = FORMS[form]
    counted = Counter(body)
    wrapped = checkpointable(counted, checkpoint=True)
    x = tf.constant([[0.3, -0.2], [1.0, 0.5]])
    plain = compile_step(lambda x: run(body, x), mode)(x)
    ours = compile_step(lambda x: run(wrapped, x), mode)(x)
    assert_all_close(ours, plain)
    assert (counted.calls > 1) == replays, counted.calls


@pytest.mark.parametrize("build", [subclassed, functional])
def test_fit_with_several_steps_per_execution_matches_the_plain_model(build):
    plain, checkpointed = twin_models(build)
    train_one_epoch(plain, steps_per_execution=2, **COMPILES["default"])
    runs = train_one_epoch(checkpointed, steps_per_execution=2, **COMPILES["default"])
    assert_same_weights(plain, checkpointed)
    assert True in runs, "the replay was traced into the multi-step train function"
    RUNS.clear()
