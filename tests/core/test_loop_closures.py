"""Closed-over tensors inside ``tf.scan`` / ``tf.while_loop`` / ``tf.map_fn`` /
``tf.cond`` bodies: a clear error when their gradient would be lost, exact
gradients when passed as arguments, no false alarm for tensors no tape watches
(issue 10, case 3)."""

import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

from tf_checkpointing import checkpointable

LOOPS = {
    "scan": lambda fn, xs: tf.scan(lambda c, x: fn(c + x), xs, initializer=tf.constant(0.0)),
    "while_loop": lambda fn, xs: tf.while_loop(
        lambda i, c: i < 3, lambda i, c: (i + 1, fn(c + xs[i])), (0, tf.constant(0.0)),
        maximum_iterations=3)[1],
    "map_fn": lambda fn, xs: tf.map_fn(fn, xs),
    "cond": lambda fn, xs: tf.cond(xs[0] > 0, lambda: fn(xs), lambda: xs),
}


def _grads(loop, make_fn, mode, checkpoint):
    w = tf.Variable(2.0, name="w")

    def step(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            scale = w * 3.0
            fn = make_fn(scale)
            if checkpoint:
                fn = checkpointable(fn, checkpoint=True)
            loss = tf.reduce_sum(LOOPS[loop](fn, xs) ** 2)
        return loss, tape.gradient(loss, [xs, w])

    return compile_step(step, mode)(tf.constant([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_watched_closed_over_tensor_in_a_loop_body_is_refused(loop, mode):
    make_fn = lambda scale: lambda x: x * scale  # noqa: E731
    with pytest.raises(ValueError, match="did not receive as an argument.*Pass the tensor as an"):
        _grads(loop, make_fn, mode, checkpoint=True)


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_the_same_tensor_passed_as_an_argument_gets_its_exact_gradient(loop, mode):
    def make_fn(scale, checkpointed=False):
        inner = lambda x, s: x * s  # noqa: E731
        if checkpointed:
            inner = checkpointable(inner, checkpoint=True)
        return lambda x: inner(x, scale)

    plain = _grads(loop, make_fn, mode, checkpoint=False)
    ours = _grads(loop, lambda s: make_fn(s, checkpointed=True), mode, checkpoint=False)
    assert_all_close(ours, plain)
    assert ours[1][1] is not None


def test_a_closed_over_loop_variable_is_refused(mode):
    def step(xs):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            ys = tf.scan(
                lambda c, x: checkpointable(lambda y: y * c, checkpoint=True)(x),
                xs, initializer=tf.constant(1.5))
        return tape.gradient(ys, xs)

    with pytest.raises(ValueError, match="did not receive as an argument"):
        compile_step(step, mode)(tf.constant([1.0, 2.0, 3.0]))


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_a_closed_over_tensor_no_tape_watches_is_fine(loop, mode):
    outside = tf.constant(0.5)  # an eager constant: captured, never watched

    def step(xs, checkpoint):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            unwatched = tf.stop_gradient(xs[0])
            fn = lambda x: tf.sin(x) * outside + unwatched * 0.1  # noqa: E731
            if checkpoint:
                fn = checkpointable(fn, checkpoint=True)
            loss = tf.reduce_sum(LOOPS[loop](fn, xs) ** 2)
        return loss, tape.gradient(loss, xs)

    xs = tf.constant([1.0, 2.0, 3.0])
    plain = compile_step(lambda xs: step(xs, False), mode)(xs)
    ours = compile_step(lambda xs: step(xs, True), mode)(xs)
    assert_all_close(ours, plain)
