"""A replay gives each input a gradient tensor of its own (decision 0042).

TensorFlow's tape keeps one reference too many to a gradient tensor that two
sources of one ``tape.gradient`` share: a replayed ``a + b`` hands its output
gradient to both inputs. Inside a ``tf.function`` that reference kept the whole
traced graph alive (a planner's measured step, or a user's step traced again).

``tf.custom_gradient`` in a graph also keeps its graph, through the gradient
function it registers globally (tensorflow#97697); the test drops those
registrations, as planning does for its own graphs (decision 0035).
"""

import gc

import pytest
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.framework.func_graph import FuncGraph

from tf_checkpointing import checkpointable


def _registered():
    registry = ops._gradient_registry._registry  # noqa: SLF001 - no public listing
    return {name for name in registry if name.startswith("CustomGradient-")}


def _graphs():
    gc.collect()
    return {id(g) for g in gc.get_objects() if isinstance(g, FuncGraph)}


@pytest.mark.parametrize("jit_compile", [False, True])
def test_a_replayed_add_of_two_inputs_leaves_no_graph_behind(jit_compile):
    runs = []

    @checkpointable
    def add(a, b):
        runs.append(1)
        return a + b

    def step(a, b):
        with tf.GradientTape() as tape:
            tape.watch([a, b])
            y = add(a * 2.0, b * 3.0, _checkpoint=True)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [a, b])

    before, registered = _graphs(), _registered()
    function = tf.function(step, jit_compile=jit_compile)
    a, b = tf.constant([1.0, 2.0]), tf.constant([3.0, -1.0])
    grads = function(a, b)
    # d/da (2a + 3b)^2 = 4 (2a + 3b), d/db = 6 (2a + 3b)
    s = (2.0 * a + 3.0 * b).numpy()
    assert grads[0].numpy().tolist() == (4.0 * s).tolist()
    assert grads[1].numpy().tolist() == (6.0 * s).tolist()
    del function, grads
    for name in _registered() - registered:
        del ops._gradient_registry._registry[name]  # noqa: SLF001
    assert len(runs) == 2  # traced, then replayed
    assert [i for i in _graphs() if i not in before] == []
