"""Which tensors each call's backward reads (the memory model's savers): read from
the graph the profile measured the call with, the same answer as a trace of the
call's own gradient, without that trace."""

import keras
import tensorflow as tf

from tf_checkpointing.planning.layer_graph import _saved_tensors
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph, repeated_calls
from tf_checkpointing.planning.solving import _model_profile


def _model():
    inputs = keras.Input((8, 8, 4))
    x = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    y = keras.layers.ReLU(name="relu")(keras.layers.BatchNormalization()(x))  # reads y
    skip = keras.layers.Conv2D(8, 1)(inputs)
    z = keras.layers.Concatenate(name="concat")([y, skip])  # reads neither input
    z = keras.layers.Add()([z, keras.layers.Conv2D(16, 1)(z)])
    pooled = keras.layers.GlobalAveragePooling2D()(z)
    return keras.Model(inputs, keras.layers.Dense(3, name="dense")(pooled))


def test_the_profiles_reads_equal_a_trace_of_each_calls_gradient(monkeypatch):
    model = _model()
    graph = read_graph(model)
    same = repeated_calls(graph)
    traced = _saved_tensors.saved_tensors(graph, same)
    got = []
    original = _saved_tensors.saved_tensors

    def recorded(graph, same_as, known=None):
        assert known is not None and all(k is not None for k in known), known
        monkeypatch.setattr(_saved_tensors, "_saved", None)  # a trace would fail
        got.append(original(graph, same_as, known))
        return got[-1]

    monkeypatch.setattr(_model_profile, "saved_tensors", recorded)
    _model_profile._profile(graph, tf.random.normal([4, 8, 8, 4]), mode="graph")
    assert got == [traced]
    by_name = dict(zip([c.name for c in graph.calls], traced))
    assert by_name["relu"][1] and not by_name["relu"][0]  # its output, not its input
    assert by_name["concat"] == (frozenset(), frozenset())
    assert by_name["dense"][0] and not by_name["dense"][1]  # its input


def test_a_layer_that_reads_only_its_inputs_shape_saves_nothing():
    # The gradient of an input not connected to the outputs is seeded with zeros
    # (ZerosLike reads only the shape): a training step's gradient makes none.
    class Positions(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=shape[1:], name="table")

        def call(self, x):
            return tf.broadcast_to(self.table, tf.shape(x))

    inputs = keras.Input((5, 4))
    model = keras.Model(inputs, Positions()(inputs))
    graph = read_graph(model)
    assert _saved_tensors.saved_tensors(graph, [0]) == [(frozenset(), frozenset())]
