"""A replay's max-pool gradient under XLA, made from window slices (``_pool_gradients``).

The formula must give TensorFlow's own kernel's gradient (ties included: each
window's first maximum), in every padding, stride and layout a Keras pool uses;
under XLA it replaces ``MaxPoolGrad`` in replays only, and a checkpointed pool's
gradients are plain XLA's where no window holds two equal maxima. What it saves
is read from XLA's buffer assignment in ``test_xla_buffers.py``.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import assert_all_close

from tf_checkpointing import checkpointable
from tf_checkpointing.core._pool_gradients import max_pool_grad, max_pool_gradients_from_windows

CASES = [  # (input shape, window, stride, padding)
    ((2, 8, 8, 3), 2, 2, "VALID"),
    ((2, 9, 9, 3), 3, 2, "VALID"),      # overlapping windows (ResNet50's pool)
    ((2, 9, 9, 3), 3, 2, "SAME"),
    ((2, 8, 8, 3), 3, 2, "SAME"),       # padded after only
    ((1, 7, 5, 2), 3, 1, "SAME"),
    ((1, 7, 5, 2), 2, 3, "SAME"),       # stride over the window
    ((1, 10, 10, 2), 3, 3, "VALID"),
    ((2, 6, 7, 3), (2, 3), (1, 2), "VALID"),
]


def _inputs(shape, ties):
    rng = np.random.default_rng(sum(shape))
    if ties:  # ReLU-like: most windows hold several zeros, some several ones
        return tf.constant(np.maximum(rng.integers(-1, 2, shape), 0).astype(np.float32))
    return tf.constant(rng.standard_normal(shape).astype(np.float32))


def _pair(x, window, stride, padding, fmt="NHWC"):
    window = [window] * 2 if isinstance(window, int) else list(window)
    stride = [stride] * 2 if isinstance(stride, int) else list(stride)
    ksize, strides = [1, *window, 1], [1, *stride, 1]
    if fmt == "NCHW":
        ksize, strides = [1, 1, *window], [1, 1, *stride]
    y = tf.raw_ops.MaxPool(input=x, ksize=ksize, strides=strides, padding=padding,
                           data_format=fmt)
    dy = tf.reshape(tf.range(1, tf.size(y) + 1, dtype=tf.float32) / 7.0, tf.shape(y))
    kernel = tf.raw_ops.MaxPoolGrad(orig_input=x, orig_output=y, grad=dy, ksize=ksize,
                                    strides=strides, padding=padding, data_format=fmt)
    return kernel, max_pool_grad(x, y, dy, ksize, strides, padding, fmt)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("shape,window,stride,padding", CASES)
def test_the_formula_is_tensorflows_kernel(shape, window, stride, padding, ties):
    kernel, ours = _pair(_inputs(shape, ties), window, stride, padding)
    # Each element sums the same windows' gradients, in another order where they overlap.
    np.testing.assert_allclose(ours.numpy(), kernel.numpy(), rtol=1e-6, atol=1e-6)


def test_the_formula_in_other_layouts_and_dimensions():
    x = _inputs((2, 9, 8, 3), ties=True)
    kernel, _ = _pair(x, 3, 2, "SAME")  # TensorFlow's CPU kernel knows NHWC only
    x_first = tf.transpose(x, [0, 3, 1, 2])
    y = tf.transpose(tf.nn.max_pool2d(x, 3, 2, "SAME"), [0, 3, 1, 2])
    dy = tf.reshape(tf.range(1, tf.size(y) + 1, dtype=tf.float32) / 7.0, [2, 5, 4, 3])
    ours = max_pool_grad(x_first, y, tf.transpose(dy, [0, 3, 1, 2]), [1, 1, 3, 3],
                         [1, 1, 2, 2], "SAME", "NCHW")
    np.testing.assert_allclose(tf.transpose(ours, [0, 2, 3, 1]).numpy(), kernel.numpy(),
                               rtol=1e-6, atol=1e-6)
    # TensorFlow's 3-D CPU kernel gives every one of equal maxima the whole gradient
    # (XLA and its 2-D kernel one of them): compared where maxima are unique.
    x3 = _inputs((2, 5, 6, 7, 2), ties=False)
    y3 = tf.nn.max_pool3d(x3, 2, 2, "SAME")
    dy3 = tf.random.stateless_normal(y3.shape, [0, 3])
    kernel3 = tf.raw_ops.MaxPool3DGrad(orig_input=x3, orig_output=y3, grad=dy3,
                                       ksize=[1, 2, 2, 2, 1], strides=[1, 2, 2, 2, 1],
                                       padding="SAME")
    ours3 = max_pool_grad(x3, y3, dy3, [1, 2, 2, 2, 1], [1, 2, 2, 2, 1], "SAME", "NDHWC")
    np.testing.assert_allclose(ours3.numpy(), kernel3.numpy(), rtol=1e-6, atol=1e-6)


def test_xla_replay_gradients_use_the_formula_and_only_there():
    x = _inputs((2, 9, 9, 3), ties=False)

    def gradient_ops(jit):
        @tf.function(jit_compile=jit)
        def grad(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = tf.nn.max_pool2d(x, 3, 2, "VALID")
            with max_pool_gradients_from_windows():
                return tape.gradient(y, x, output_gradients=y * 3.0)
        ops = grad.get_concrete_function(x).graph.get_operations()
        return grad(x), {op.type for op in ops}

    xla, xla_ops = gradient_ops(True)
    graph, graph_ops = gradient_ops(False)
    assert "StridedSlice" in xla_ops and "MaxPoolGrad" in xla_ops  # left unused, pruned
    assert "StridedSlice" not in graph_ops  # TensorFlow's kernel is left alone outside XLA
    assert_all_close(xla, graph)


@pytest.mark.parametrize("padding", ["valid", "same"])
def test_a_checkpointed_pool_has_plain_gradients(mode, padding):
    keras.utils.set_random_seed(0)
    conv = keras.layers.Conv2D(4, 3, padding="same")
    pool = keras.layers.MaxPooling2D(3, strides=2, padding=padding)
    conv.build((None, 9, 9, 2))
    runs = []

    def block(x):
        runs.append(1)
        return pool(tf.nn.relu(conv(x)))

    wrapped = checkpointable(block)
    x = tf.random.stateless_normal([2, 9, 9, 2], seed=[1, 2])
    variables = conv.trainable_variables

    def step_of(checkpoint):
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(wrapped(x, _checkpoint=checkpoint) ** 2)
            return loss, tape.gradient(loss, [x, *variables])
        return compile_step(step, mode)

    plain = step_of(False)(x)
    before = len(runs)
    ours = step_of(True)(x)
    assert len(runs) - before == 2  # the forward and its replay (run, or traced)
    assert_all_close(ours, plain)
