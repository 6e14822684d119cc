"""Checkpointed steps inside loops and control flow, and checkpoints inside checkpoints.

``tf.recompute_grad`` fails when its function runs in the body of a
``tf.scan`` / ``tf.while_loop`` inside ``tf.function`` and closes over tensors or
variables from outside the loop (TF #55304): the replay, built in the gradient
of the loop body, captures them straight from outside, which the loop's
gradient cannot wire. Here an RNN cell checkpointed per time step closes over
two variables, a small and a large eager tensor and a tensor of the enclosing
``tf.function``; its gradients must equal the plain cell's, leaf by leaf.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import ran_in_fresh_process

from tf_checkpointing import apply_checkpointing, checkpointable, is_recomputing

STEPS, BATCH, UNITS = 5, 3, 4
RUNS: list = []

W = tf.Variable(tf.random.stateless_normal([UNITS, UNITS], [1, 1]) * 0.5, name="W")
U = tf.Variable(tf.random.stateless_normal([UNITS, UNITS], [1, 2]) * 0.5, name="U")
SMALL = tf.random.stateless_normal([UNITS], [1, 3])  # captured as a constant
LARGE = tf.random.stateless_normal([BATCH, 200], [1, 4])  # > 128 elements: a placeholder


def cell(h, x, offset):
    RUNS.append(is_recomputing())
    pre = h @ W + x @ U + SMALL + tf.reduce_mean(LARGE, axis=1, keepdims=True) + offset
    return tf.tanh(pre)


checkpointed_cell = checkpointable(cell, checkpoint=True)


def inputs(dtype=tf.float32):
    xs = tf.random.stateless_normal([STEPS, BATCH, UNITS], [2, 1], dtype=dtype)
    return xs, tf.random.stateless_normal([BATCH, UNITS], [2, 2], dtype=dtype)


def scan_loss(step_fn, xs, h0):
    offset = tf.fill([UNITS], 0.1)  # a tensor of the enclosing tf.function
    hs = tf.scan(lambda h, x: step_fn(h, x, offset), xs, initializer=h0)
    return tf.reduce_sum(hs**2)


def while_loss(step_fn, xs, h0):
    offset = tf.fill([UNITS], 0.1)

    def body(i, h, total):
        h = step_fn(h, xs[i], offset)
        return i + 1, h, total + tf.reduce_sum(h**2)

    # XLA needs maximum_iterations to size the loop's gradient accumulators.
    _, _, total = tf.while_loop(
        lambda i, h, total: i < STEPS, body, (0, h0, 0.0), maximum_iterations=STEPS
    )
    return total


def gradients(loss_fn, step_fn, mode):
    def step(xs, h0):
        with tf.GradientTape() as tape:
            tape.watch([xs, h0])
            loss = loss_fn(step_fn, xs, h0)
        return loss, tape.gradient(loss, [xs, h0, W, U])

    RUNS.clear()
    loss, grads = compile_step(step, mode)(*inputs())
    return loss, grads, list(RUNS)


def assert_same_gradients(actual, expected, names=("xs", "h0", "W", "U")):
    for name, a, e in zip(names, actual, expected):
        assert a is not None, f"{name} lost its gradient"
        np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("loss_fn", [scan_loss, while_loss], ids=["scan", "while_loop"])
def test_checkpointed_cell_in_a_loop_has_exact_gradients(loss_fn, mode):
    plain_loss, plain_grads, _ = gradients(loss_fn, cell, mode)
    loss, grads, runs = gradients(loss_fn, checkpointed_cell, mode)
    np.testing.assert_allclose(loss.numpy(), plain_loss.numpy(), rtol=1e-6)
    assert_same_gradients(grads, plain_grads)
    if mode == "eager":  # every step ran forward, then every step was replayed
        assert runs == [False] * STEPS + [True] * STEPS
    else:  # the body is traced once; its replay is traced into the loop's gradient
        assert runs == [False, True]


def test_checkpointed_cell_in_a_loop_float64_numeric_gradient():
    xs, h0 = inputs(tf.float64)
    w = tf.Variable(tf.cast(W, tf.float64))

    def step_fn(h, x, offset):
        return tf.tanh(h @ w + x + tf.cast(offset, tf.float64))

    f = checkpointable(step_fn, checkpoint=True)

    @tf.function
    def loss(xs, h0):
        hs = tf.scan(lambda h, x: f(h, x, tf.fill([UNITS], 0.1)), xs, initializer=h0)
        return tf.reduce_sum(hs**2)

    theoretical, numerical = tf.test.compute_gradient(loss, [xs, h0], delta=1e-5)
    for t, n in zip(theoretical, numerical):
        np.testing.assert_allclose(t, n, rtol=1e-7, atol=1e-8)


def test_checkpointed_branch_of_tf_cond(mode):
    """A branch of a tensor-predicated tf.cond: its gradient graph has the same
    rule as a loop body's (cond_v2 asserted on the replay's outside captures)."""

    def plain(x):
        return tf.tanh(x @ W + SMALL)

    checkpointed = checkpointable(plain, checkpoint=True)

    def both(x):
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(x)
            take = tf.reduce_sum(x) > -1e9  # always True, known only at run time
            y = tf.reduce_sum(tf.cond(take, lambda: checkpointed(x), lambda: plain(x)))
            z = tf.reduce_sum(plain(x))
        return tape.gradient(y, [x, W]), tape.gradient(z, [x, W])

    x = tf.random.stateless_normal([BATCH, UNITS], [3, 3])
    ours, expected = compile_step(both, mode)(x)
    assert_same_gradients(ours, expected, names=("x", "W"))


def rnn_model():
    keras.utils.set_random_seed(0)
    x = keras.Input((STEPS, UNITS))
    h = keras.layers.RNN(keras.layers.SimpleRNNCell(6, name="cell"), name="rnn")(x)
    return keras.Model(x, keras.layers.Dense(1, name="head")(h), name="net")


def test_keras_rnn_with_a_checkpointed_cell(mode):
    plain, model = rnn_model(), rnn_model()
    model.set_weights(plain.get_weights())
    assert [layer.name for layer in apply_checkpointing(model, [keras.layers.SimpleRNNCell])] \
        == ["cell"]
    xs = tf.random.stateless_normal([BATCH, STEPS, UNITS], [4, 4])
    grads = []
    for m in (plain, model):
        def step(x, m=m):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(m(x, training=True) ** 2)
            return tape.gradient(loss, m.trainable_variables)

        grads.append(compile_step(step, mode)(xs))
    assert_same_gradients(grads[1], grads[0], names=[v.path for v in model.trainable_variables])


# --- a checkpoint inside a checkpoint --------------------------------------

LAYERS = [tf.Variable(tf.random.stateless_normal([256, 256], [5, i]) * 0.06) for i in range(8)]
NESTED_RUNS: dict = {"inner": [], "outer": []}


def inner(x, ws):
    NESTED_RUNS["inner"].append(is_recomputing())
    for w in ws:
        x = tf.tanh(x @ w)
    return x


checkpointed_inner = checkpointable(inner, checkpoint=True)


def outer(x, inner_fn):
    NESTED_RUNS["outer"].append(is_recomputing())
    return inner_fn(inner_fn(x, LAYERS[:4]), LAYERS[4:])


checkpointed_outer = checkpointable(outer, checkpoint=True)

NESTINGS = {
    "plain": lambda x: outer(x, inner),
    "outer": lambda x: checkpointed_outer(x, inner),
    "nested": lambda x: checkpointed_outer(x, checkpointed_inner),
}


def run_nesting(name, mode="eager"):
    """(loss, gradients, bytes held between forward and backward, run logs)."""
    x = tf.random.stateless_normal([512, 256], [6, 6])

    def step(x):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(NESTINGS[name](x) ** 2)
        held = tf.config.experimental.get_memory_info("CPU:0")["current"] - before
        return loss, tape.gradient(loss, [x] + LAYERS), held

    for runs in NESTED_RUNS.values():
        runs.clear()
    loss, grads, held = compile_step(step, mode)(x)
    return loss, grads, held, {k: list(v) for k, v in NESTED_RUNS.items()}


@pytest.mark.parametrize("mode_", ["eager", "graph"])
def test_nested_checkpoints_have_exact_gradients(mode_):
    plain_loss, plain_grads, _, _ = run_nesting("plain", mode_)
    loss, grads, _, runs = run_nesting("nested", mode_)
    np.testing.assert_allclose(loss.numpy(), plain_loss.numpy(), rtol=1e-6)
    assert_same_gradients(grads, plain_grads, names=["x"] + [f"w{i}" for i in range(8)])
    if mode_ == "eager":
        # outer: forward, replay. inner (twice per outer run): forward inside the
        # outer forward, then inside the outer replay its own forward and replay.
        assert runs["outer"] == [False, True]
        assert len(runs["inner"]) == 6
        assert runs["inner"][:2] == [False, False] and runs["inner"][-2:] == [True, True]


def test_nested_checkpoint_keeps_only_what_the_outer_one_keeps(request):
    if ran_in_fresh_process(request):
        return
    _, _, plain_held, _ = run_nesting("plain")
    _, _, outer_held, _ = run_nesting("outer")
    _, _, nested_held, _ = run_nesting("nested")
    one_activation = 512 * 256 * 4
    assert plain_held >= 8 * one_activation  # every layer's output is kept
    assert outer_held <= 3 * one_activation  # input, output, loss: no intermediate
    assert abs(nested_held - outer_held) < one_activation // 4  # inner checkpoints add nothing
