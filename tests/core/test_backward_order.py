"""A replay's backward computes each weight gradient before the input gradient.

A layer's backward reads its input ``x`` (for the weight gradient) and makes the
input gradient ``dx``; run in the other order, ``x``, ``dy`` and ``dx`` are alive
together. The replay adds an edge so the weight gradient goes first; where it
was ``x``'s last reader, ``x`` is freed before ``dx`` is made. Checked here: the
edge is in the graph (convolutions, dense layers, mixed precision, loops, where
a wrong edge would make a cycle), the gradients are the plain ones, and the peak
of a U-Net's last stage (a concatenation read only by a convolution) no longer
depends on the executor's order.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import REPO, assert_all_close

from tf_checkpointing import checkpointable
from tf_checkpointing.core._weight_gradients import weight_gradients_first


def _stage(conv):
    def stage(u, s):
        return tf.nn.relu(conv(tf.concat([u, s], -1)))
    return stage


def _gradient_graph(fn, *inputs, variables):
    def step(*xs):
        with tf.GradientTape() as tape:
            tape.watch(list(xs))
            loss = tf.reduce_sum(tf.cast(fn(*xs), tf.float32) ** 2)
        return tape.gradient(loss, list(xs) + list(variables))
    return tf.function(step).get_concrete_function(*inputs).graph


def _ordered_pairs(graph, first, then):
    """(input-gradient op, weight-gradient op) pairs joined by a control edge."""
    return [(op.name, dep.name) for op in graph.get_operations() if op.type in then
            for dep in op.control_inputs if dep.type in first]


def test_a_replayed_convolution_computes_its_filter_gradient_first():
    conv = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)
    u, s = tf.random.normal([2, 8, 8, 3]), tf.random.normal([2, 8, 8, 2])
    conv(tf.concat([u, s], -1))
    replayed = _gradient_graph(checkpointable(_stage(conv), checkpoint=True), u, s,
                               variables=conv.trainable_variables)
    pairs = _ordered_pairs(replayed, {"Conv2DBackpropFilter"}, {"Conv2DBackpropInput"})
    assert len(pairs) == 1
    # The plain backward is TensorFlow's own, untouched.
    plain = _gradient_graph(_stage(conv), u, s, variables=conv.trainable_variables)
    assert _ordered_pairs(plain, {"Conv2DBackpropFilter"}, {"Conv2DBackpropInput"}) == []


def test_a_region_ending_in_a_convolution_orders_it_on_the_incoming_gradient():
    # The convolution's output gradient is the region's incoming gradient, made
    # before the replay's backward: ordered too (the U-Net's last stage as a
    # region of its own peaked at 18.5-24.5 MiB instead of 15.5 without this).
    conv = keras.layers.Conv2D(4, 3, padding="same", use_bias=False)
    u, s = tf.random.normal([2, 8, 8, 3]), tf.random.normal([2, 8, 8, 2])
    ends_in_conv = lambda u, s: conv(tf.concat([u, s], -1))  # noqa: E731
    ends_in_conv(u, s)
    replayed = _gradient_graph(checkpointable(ends_in_conv, checkpoint=True), u, s,
                               variables=conv.trainable_variables)
    pairs = _ordered_pairs(replayed, {"Conv2DBackpropFilter"}, {"Conv2DBackpropInput"})
    assert len(pairs) == 1
    for mode in ("eager", "graph", "xla"):  # runs and equals plain
        def grads(fn, mode=mode):
            def step(u, s):
                with tf.GradientTape() as tape:
                    tape.watch([u, s])
                    loss = tf.reduce_sum(fn(u, s) ** 2)
                return tape.gradient(loss, [u, s] + conv.trainable_variables)
            return compile_step(step, mode)(u, s)
        assert_all_close(grads(checkpointable(ends_in_conv, checkpoint=True)),
                         grads(ends_in_conv))


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_dense_layers_are_ordered_without_cycles_in_any_precision(policy):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        dense1, dense2 = keras.layers.Dense(16, activation="gelu"), keras.layers.Dense(8)
        x = tf.random.normal([4, 8])
        block = checkpointable(lambda x: dense2(dense1(x)), checkpoint=True)
        block(x)
        variables = dense1.trainable_variables + dense2.trainable_variables
        graph = _gradient_graph(block, x, variables=variables)
        assert _ordered_pairs(graph, {"MatMul"}, {"MatMul"})
        # float16 values to 8 of their units: on a CPU with native float16
        # (AVX512_FP16), the tf.function gradients through the GELU moved by 1-8
        # units (oneDNN's graph rewrites fuse GELU's float16 ops differently in
        # the plain and the replayed graph; equal with ReLU or no activation,
        # and with TF_ENABLE_ONEDNN_OPTS=0; measured 2026-11-25).
        tolerance = {"rtol": 8 * 2.0**-10} if policy == "mixed_float16" else {}
        for mode in ("eager", "graph", "xla"):  # runs (no cycle) and equals plain
            def grads(fn, mode=mode):
                def step(x):
                    with tf.GradientTape() as tape:
                        tape.watch(x)
                        loss = tf.reduce_sum(tf.cast(fn(x), tf.float32) ** 2)
                    return tape.gradient(loss, [x] + variables)
                return compile_step(step, mode)(x)
            assert_all_close(grads(block), grads(lambda x: dense2(dense1(x))), **tolerance)
    finally:
        keras.config.set_dtype_policy(previous)


def test_attention_products_are_ordered_one_way_only():
    # Both products of q @ k^T read an activation: either may go first, never both.
    def attention(q, k):
        return tf.nn.softmax(tf.matmul(q, k, transpose_b=True)) @ k

    q, k = tf.random.normal([2, 5, 4]), tf.random.normal([2, 5, 4])
    graph = _gradient_graph(checkpointable(attention, checkpoint=True), q, k, variables=[])
    edges = _ordered_pairs(graph, {"BatchMatMulV2"}, {"BatchMatMulV2"})
    assert not any((b, a) in edges for a, b in edges)


def test_it_adds_nothing_where_no_weight_gradient_reads_an_activation():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4])
        first = len(graph.get_operations())
        tf.nn.relu(x) * 2.0
        assert weight_gradients_first(graph, first) == 0


SCRIPT = textwrap.dedent("""
    import json
    import keras, tensorflow as tf
    import tf_checkpointing as tc
    from tf_checkpointing.core import _recompute

    if not ORDERED:
        _recompute.weight_gradients_first = lambda graph, first, incoming=(): 0
    conv = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)

    @tc.checkpointable(checkpoint=True)
    def stage(u, s):
        return tf.nn.relu(conv(tf.concat([u, s], -1)))

    u, s = tf.random.normal([8, 64, 64, 32]), tf.random.normal([8, 64, 64, 16])
    stage(u, s)

    @tf.function
    def step(u, s):
        with tf.GradientTape() as tape:
            tape.watch([u, s])
            loss = tf.reduce_sum(stage(u, s) ** 2)
        return tape.gradient(loss, [u, s] + conv.trainable_variables)

    step(u, s)
    print(json.dumps([tc.debug.measure(lambda: [g.numpy() for g in step(u, s)]).peak_bytes
                      for _ in range(12)]))
""")


@pytest.mark.slow
def test_the_stage_peak_no_longer_depends_on_the_executor_order():
    # Tensors: the stage's inputs u (4 MiB) and s (2 MiB) and their gradients, the
    # 6 MiB concatenation and its 6 MiB input gradient, 2 MiB activations. With the
    # filter gradient first the concatenation is freed before the input gradient is
    # made: every step peaks at 14 MiB. In TensorFlow's own order some steps held
    # both (20 MiB: 2-4 of 8 steps in the runs that found it).
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", "ORDERED = True\n" + SCRIPT], env=env,
                          capture_output=True, text=True, cwd=REPO, check=True)
    peaks = np.array(json.loads(done.stdout.strip().splitlines()[-1])) / 2**20
    assert peaks.max() <= 14.5, peaks
