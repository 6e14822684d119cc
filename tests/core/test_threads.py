"""Threads: checkpointed calls in two threads at once replay exactly, with
``force_seed`` too (issue 10, case 4); and where ``force_seed`` cannot reach."""

import threading

import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step

from tf_checkpointing import checkpointable, is_recomputing


def _in_two_threads(run):
    results, errors = [None, None], []

    def target(k):
        try:
            results[k] = run(k)
        except BaseException as error:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(error)

    threads = [threading.Thread(target=target, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("legacy_op", ["uniform", "nn_dropout", "normal"])
def test_force_seed_in_two_eager_threads_at_once(legacy_op):
    # Both forwards run before either replay, and each forward waits for the
    # other thread's forward to have started: the old process-wide global seed
    # was overwritten by the other thread in between.
    barrier = threading.Barrier(2, timeout=30)

    def body(x):
        if not is_recomputing():
            barrier.wait()
        if legacy_op == "uniform":
            return x * tf.random.uniform([256])
        if legacy_op == "normal":
            return x * tf.random.normal([256])
        return tf.nn.dropout(x, rate=0.5)

    wrapped = checkpointable(body, checkpoint=True, force_seed=True)
    x = tf.linspace(1.0, 2.0, 256)

    def run(k):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = wrapped(x * (k + 1.0)) / (k + 1.0)
        barrier.wait()  # both forwards done before either replays
        return y, tape.gradient(y, x)

    (y0, g0), (y1, g1) = _in_two_threads(run)
    # The exact gradient for the numbers each forward drew: dy/dx = y / x.
    np.testing.assert_allclose(g0, y0 / x, rtol=1e-5)
    np.testing.assert_allclose(g1, y1 / x, rtol=1e-5)
    assert not np.allclose(y0, y1), "the two calls must draw different numbers"


def test_force_seed_leaves_other_threads_random_ops_alone():
    barrier = threading.Barrier(2, timeout=30)
    tf.random.set_seed(11)
    expected = [tf.random.uniform([3]).numpy() for _ in range(2)]
    tf.random.set_seed(11)

    def run(k):
        if k == 0:
            def body(x):
                if not is_recomputing():
                    barrier.wait()
                    barrier.wait()
                return x * tf.random.uniform([3])

            x = tf.ones([3])
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = checkpointable(body, checkpoint=True, force_seed=True)(x)
            return y, tape.gradient(y, x)
        barrier.wait()  # thread 0 is inside its forced-seed forward
        drawn = [tf.random.uniform([3]).numpy() for _ in range(2)]
        barrier.wait()
        return drawn

    (y, grad), drawn = _in_two_threads(run)
    np.testing.assert_array_equal(drawn, expected)
    np.testing.assert_allclose(grad, y, rtol=1e-6)  # x is ones: dy/dx = y


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_two_threads_train_checkpointed_blocks_at_once(mode):
    w = tf.Variable(tf.random.stateless_normal([8, 8], seed=[1, 2]) * 0.3, name="w")
    block = checkpointable(lambda x: tf.tanh(tf.matmul(x, w)), checkpoint=True)

    def grads(fn, x):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(fn(fn(x)) ** 2)
            return tape.gradient(loss, [x, w])
        return compile_step(step, mode)(x)

    xs = [tf.random.stateless_normal([4, 8], seed=[k, 5]) for k in range(2)]
    plain = [grads(lambda x: tf.tanh(tf.matmul(x, w)), x) for x in xs]
    ours = _in_two_threads(lambda k: [grads(block, xs[k]) for _ in range(5)])
    for k in range(2):
        for result in ours[k]:
            for a, e in zip(result, plain[k]):
                np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def test_force_seed_refuses_legacy_random_ops_in_a_tf_function_called_eagerly():
    noise = tf.function(lambda x: x * tf.random.uniform([8]))
    loop = tf.function(lambda x: tf.while_loop(
        lambda i, y: i < 2, lambda i, y: (i + 1, y * tf.random.normal([8])), (0, x))[1])
    x = tf.linspace(1.0, 2.0, 8)
    for inner in (noise, loop):
        wrapped = checkpointable(lambda x, inner=inner: inner(x), checkpoint=True,
                                 force_seed=True)
        with tf.GradientTape() as tape:
            tape.watch(x)
            with pytest.raises(ValueError, match="force_seed cannot replay the legacy random"):
                wrapped(x)
    stateless = tf.function(lambda x: x * tf.random.stateless_uniform([8], seed=[1, 2]))
    wrapped = checkpointable(lambda x: stateless(x), checkpoint=True, force_seed=True)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = wrapped(x)
    np.testing.assert_allclose(tape.gradient(y, x), y / x, rtol=1e-5)
