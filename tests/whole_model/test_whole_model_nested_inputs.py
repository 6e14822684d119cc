"""Whole-model checkpointing of a model nested in another, whose inputs Keras converts.

Keras' call of a nested model converts its inputs before its layers run:
``Functional._standardize_inputs`` casts each to its ``keras.Input``'s dtype and
adds or drops a last axis of size one (a Sequential's ``__call__`` first casts float
inputs to that dtype too). Expanded into its layers, the model's call does not run,
so the graph reader has its layers convert what they read the same way. Each model
here is run plainly, then by its least plan and by one region over all its calls,
in eager mode, ``tf.function`` and XLA: outputs and gradients must be the plain
model's.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, grads_of

import tf_checkpointing as tc
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph


class Unscaled(keras.layers.Layer):
    """Scales its input in the dtype it is given (no autocast): float16 and float32
    inputs give other values."""

    def __init__(self, **kwargs):
        super().__init__(autocast=False, **kwargs)

    def call(self, x):
        return x * 1.001 + 0.01


def _to_unit(x):
    return x / 127.5 - 1.0  # a TypeError on an int tensor: Keras casts it first


def uint8_image():
    """A uint8 input fed to a float32 model: Keras casts it to float32."""
    inner_in = keras.Input((6,))
    t = keras.layers.Dense(6, activation="tanh")(keras.layers.Lambda(_to_unit)(inner_in))
    inner = keras.Model(inner_in, t, name="inner")
    x = keras.Input((6,), dtype="uint8")
    return keras.Model(x, keras.layers.Dense(2)(inner(x)), name="outer"), tf.constant(
        np.arange(48).reshape(8, 6) * 5 % 256, tf.uint8)


def int_sequential_read_twice():
    """An int32 input fed to a float32 Sequential and read by two of its layers
    (cast per reader: without a gradient, as exact as Keras' one cast)."""
    seq_in = keras.Input((6,))
    a = keras.layers.Dense(6, activation="tanh")(keras.layers.Lambda(_to_unit)(seq_in))
    b = keras.layers.Lambda(lambda t: t * 0.01)(seq_in)
    inner = keras.Model(seq_in, keras.layers.Add()([a, b]), name="inner")
    seq = keras.Sequential([keras.Input((6,)), keras.layers.Lambda(_to_unit),
                            keras.layers.Dense(6)], name="seq")
    x = keras.Input((6,), dtype="int32")
    h = keras.layers.Concatenate()([inner(x), seq(x)])
    return keras.Model(x, keras.layers.Dense(2)(h), name="outer"), tf.constant(
        np.arange(48).reshape(8, 6) % 7, tf.int32)


def recorded_as_float():
    """A Lambda that casts to int32 is recorded at its float32 compute dtype:
    Keras casts its value to the nested model's float32 at run time."""
    inner_in = keras.Input((6,))
    t = keras.layers.Dense(6, activation="tanh")(keras.layers.Lambda(_to_unit)(inner_in))
    inner = keras.Model(inner_in, t, name="inner")
    x = keras.Input((6,))
    h = keras.layers.Dense(6)(x)
    ints = keras.layers.Lambda(lambda t: tf.cast(t * 30, tf.int32))(h)
    out = keras.layers.Dense(2)(keras.layers.Concatenate()([inner(ints), h]))
    return keras.Model(x, out, name="outer"), tf.random.stateless_normal([8, 6], [0, 2])


def rank_below():
    """A (batch, 6) tensor fed to a model whose input is (batch, 6, 1): Keras adds
    the last axis at run time (its symbolic shapes do not)."""
    inner_in = keras.Input((6, 1))
    inner = keras.Model(inner_in, keras.layers.Dense(5, activation="tanh")(inner_in),
                        name="inner")
    x = keras.Input((6,))
    out = keras.layers.Dense(2)(inner(keras.layers.Dense(6)(x)))
    return keras.Model(x, out, name="outer"), tf.random.stateless_normal([8, 6], [0, 3])


def _mixed(build):
    def built():
        previous = keras.config.dtype_policy()
        keras.config.set_dtype_policy("mixed_float16")
        try:
            return build()
        finally:
            keras.config.set_dtype_policy(previous)

    built.__name__ = build.__name__
    return built


@_mixed
def mixed_float16():
    """Under mixed precision a keras.Input is float32: Keras casts the float16
    activation fed to the nested model to float32, which a layer that does not
    autocast computes in (here after the casts of two nested models' calls)."""
    deep_in = keras.Input((6,))
    deep = keras.Model(deep_in, keras.layers.Dense(6, activation="tanh")(
        Unscaled()(deep_in)), name="deep")
    inner_in = keras.Input((6,))
    inner = keras.Model(inner_in, keras.layers.Dense(6)(deep(inner_in)), name="inner")
    x = keras.Input((6,))
    out = keras.layers.Dense(2, dtype="float32")(inner(keras.layers.Dense(6)(x)))
    return keras.Model(x, out, name="outer"), tf.random.stateless_normal([8, 6], [0, 5])


@_mixed
def mixed_float16_read_twice():
    """The cast float16 input read by two layers: kept as one call (Keras sums their
    gradients in float32; cast per reader they would be summed in float16)."""
    inner_in = keras.Input((6,))
    t = keras.layers.Dense(6, activation="tanh")(inner_in)
    inner = keras.Model(inner_in, keras.layers.Add()([t, inner_in]), name="inner")
    x = keras.Input((6,))
    out = keras.layers.Dense(2, dtype="float32")(inner(keras.layers.Dense(6)(x)))
    return keras.Model(x, out, name="outer"), tf.random.stateless_normal([8, 6], [0, 7])


MODELS = [uint8_image, int_sequential_read_twice, recorded_as_float, rank_below,
          mixed_float16, mixed_float16_read_twice]
KEPT_AS_ONE_CALL = {"mixed_float16_read_twice": {"inner"}}


def _run(model, x, mode):
    return grads_of(lambda v: model(v, training=True), [x], model.trainable_variables,
                    mode) + (model(x),)


@pytest.mark.parametrize("build", MODELS, ids=[b.__name__ for b in MODELS])
def test_nested_inputs_converted_as_keras_does(build, mode):
    keras.utils.set_random_seed(0)
    model, x = build()
    model(x)
    plain = _run(model, x, mode)
    least = tc.plan_model(model, x, budget="min", mode="eager")
    whole = dataclasses.replace(least, pieces=(tc.plans.Segment(0, len(least.names), True),))
    for plan in (least, whole):
        tc.apply_checkpointing(model, plan=plan)
        ours = _run(model, x, mode)
        assert ours[2].dtype == plain[2].dtype, str(plan)
        assert_all_close(ours[2], plain[2])
        assert_all_close(ours[0], plain[0])
        assert_all_close(ours[1], plain[1], atol=1e-5, rtol=_gradient_rtol(build, mode))


def _gradient_rtol(build, mode):
    """Float32 rounding, but one float16 rounding of the variables' gradients where
    XLA computes in float16: the checkpointed program fuses otherwise than the plain
    one, and on a CPU with AVX512-FP16 XLA's float16 sums then round apart by one
    unit in the last place (0.5669 against 0.5674, seen on TensorFlow 2.21)."""
    return 2.0**-10 if mode == "xla" and build in (mixed_float16, mixed_float16_read_twice) \
        else 1e-5


@pytest.mark.parametrize("build", MODELS, ids=[b.__name__ for b in MODELS])
def test_nested_models_are_expanded_where_converting_per_reader_is_exact(build):
    keras.utils.set_random_seed(0)
    model, _ = build()
    names = {call.name for call in read_graph(model).calls}
    nested = {layer.name for layer in model._flatten_layers(include_self=False)
              if isinstance(layer, keras.Model)}
    assert names & nested == KEPT_AS_ONE_CALL.get(build.__name__, set()), names


def test_a_reader_is_recorded_with_the_dtype_it_is_given():
    """The planner traces each call on its recorded arguments: the first layer of
    the mixed model's innermost model is fed float16, and recorded so, with the
    conversions of both nested calls it skips."""
    keras.utils.set_random_seed(0)
    model, _ = mixed_float16()
    first = next(call for call in read_graph(model).calls
                 if isinstance(call.layer, Unscaled))
    assert [t.dtype for t in first.arguments.keras_tensors] == ["float16"]
    assert [step.model.name for step in first.entering[0]] == ["inner", "deep"]
