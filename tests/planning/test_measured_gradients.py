"""Planning's tapes give each input a gradient tensor of its own (decision 0042).

TensorFlow's tape keeps one reference too many to a gradient tensor that two
sources share (an ``Add`` passes its output gradient to both inputs): eagerly
the tensor's memory is never freed, in a ``tf.function`` the whole traced graph
outlives the trace, with its constants in the allocator's pool.
"""

import gc
import sys

import tensorflow as tf
from tensorflow.python.framework.func_graph import FuncGraph

from tf_checkpointing.core._structure import own_gradient
from tf_checkpointing.planning.measuring._layer_profile import taped


def _add(pair):
    return pair[0] + pair[1]


def test_an_adds_output_gradient_is_freed_after_an_eager_backward():
    a, b = tf.ones([3]), tf.ones([3])
    output_gradient = tf.fill([3], 2.0)
    references = sys.getrefcount(output_gradient)
    tape, _, y = taped(_add, [a, b])
    grads = tape.gradient(y, [a, b], output_gradients=output_gradient)
    assert grads[0] is not grads[1]
    assert [g.numpy().tolist() for g in grads] == [[2.0] * 3] * 2
    del grads, tape, y
    gc.collect()
    assert sys.getrefcount(output_gradient) == references


def test_a_traced_backward_through_an_add_leaves_no_graph_behind():
    def step(a, b):
        tape, _, y = taped(_add, [a, b])
        return tape.gradient(y, [a, b], output_gradients=tf.fill(tf.shape(y), 2.0))

    gc.collect()
    before = {id(g) for g in gc.get_objects() if isinstance(g, FuncGraph)}
    function = tf.function(step)
    grads = function(tf.ones([3]), tf.ones([3]))
    assert [g.numpy().tolist() for g in grads] == [[2.0] * 3] * 2
    del function, grads
    gc.collect()
    left = [g.name for g in gc.get_objects() if isinstance(g, FuncGraph) and id(g) not in before]
    assert left == []


def test_own_gradient_passes_what_takes_no_gradient_unchanged():
    ids = tf.constant([1, 2])
    assert own_gradient(ids) is ids
    assert own_gradient("name") == "name"
    x = tf.ones([2, 3])
    view = own_gradient(x)
    assert view is not x and view.shape == x.shape
