"""Every call form checkpoints (function, bound/static/class method, ``__call__``
of a plain class and of a ``tf.Module``, Keras layer and model), under eager,
``tf.function`` with and without AutoGraph, and XLA; wrappers copy and pickle;
misuse gets an error that names the fix (issue 10, cases 5, 10, 11)."""

import copy
import functools
import logging
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close

from tf_checkpointing import apply_checkpointing, checkpointable, is_recomputing

MODES = ("eager", "graph", "graph_no_autograph", "xla")
RUNS: list = []  # (form, replayed) per body run


def _body(form, x):
    RUNS.append((form, is_recomputing()))
    return tf.sin(x) * x


@checkpointable(checkpoint=True)
def module_function(x):
    return _body("function", x)


class Forms:
    @checkpointable(checkpoint=True)
    def method(self, x):
        return _body("method", x)

    @staticmethod
    @checkpointable(checkpoint=True)
    def static(x):
        return _body("static", x)

    @classmethod
    @checkpointable(checkpoint=True)
    def klass(cls, x):
        return _body("classmethod", x)

    @checkpointable(checkpoint=True)
    def __call__(self, x):
        return _body("__call__", x)


class Module(tf.Module):
    @checkpointable(checkpoint=True)
    def __call__(self, x):
        return _body("tf.Module", x)


class BodyLayer(keras.layers.Layer):
    def call(self, x):
        return _body("layer", x)


FORMS = {
    "function": lambda: module_function,
    "method": lambda: Forms().method,
    "static": lambda: Forms.static,
    "classmethod": lambda: Forms.klass,
    "__call__": lambda: Forms(),
    "tf.Module": lambda: Module(),
    "layer": lambda: checkpointable(BodyLayer(), checkpoint=True),
    "model": lambda: checkpointable(keras.Sequential([BodyLayer()]), checkpoint=True),
    "closure made inside the step": None,
}


def _compiled(step, mode):
    if mode == "eager":
        return step
    return tf.function(step, autograph=(mode != "graph_no_autograph"),
                       jit_compile=(mode == "xla"))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_call_form_checkpoints_with_exact_gradients(form, mode, caplog):
    make = FORMS[form]

    def step(x):
        fn = make() if make else checkpointable(lambda x: _body(form, x), checkpoint=True)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        return y, tape.gradient(y, x)

    RUNS.clear()
    x = tf.constant([0.5, -1.5])
    with caplog.at_level(logging.WARNING):
        y, grad = _compiled(step, mode)(x)
    assert_all_close([y, grad], [tf.sin(x) * x, tf.cos(x) * x + tf.sin(x)])
    assert any(replayed for _, replayed in RUNS), f"{form} was not checkpointed: {RUNS}"
    assert "AutoGraph could not transform" not in caplog.text


def test_a_checkpointable_call_method_marks_its_class_for_autograph():
    assert Forms.autograph_info__ is None and Module.autograph_info__ is None


def _layer_twins():
    layer = keras.layers.Dense(3, name="d")
    layer.build((None, 2))
    return layer, checkpointable(layer, checkpoint=True)


def test_a_wrapped_layer_deep_copies_and_pickles_to_a_wrapped_copy():
    layer, wrapped = _layer_twins()
    x = tf.constant([[1.0, -2.0]])
    for clone in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped)),
                  copy.copy(wrapped)):
        assert type(clone).__name__ == "CheckpointedLayer"
        assert clone._self_options == wrapped._self_options
        assert_all_close(clone(x), layer(x))
        RUNS.clear()
        with tf.GradientTape() as tape:
            y = clone(x)
        assert tape.gradient(y, clone.trainable_variables)[0] is not None
    deep = copy.deepcopy(wrapped)
    assert deep.__wrapped__ is not layer and deep.kernel is not layer.kernel


def test_a_wrapped_function_copies_and_pickles_like_the_function():
    assert copy.deepcopy(module_function) is module_function
    assert copy.copy(module_function) is module_function
    assert pickle.loads(pickle.dumps(module_function)) is module_function
    rewrapped = pickle.loads(pickle.dumps(checkpointable(np.add, checkpoint=True)))
    assert rewrapped.__wrapped__ is np.add and rewrapped._self_options.checkpoint
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(checkpointable(lambda x: x))  # as pickle.dumps(lambda x: x) raises


def test_unknown_decorator_option_lists_the_options_and_suggests_the_nearest():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['chekpoint'\].*'checkpoint', "
                       r"'force_seed', 'check'.*did you mean `checkpoint` instead of `chekpoint`"):
        checkpointable(chekpoint=True)
    with pytest.raises(TypeError, match="did you mean `force_seed` instead of `_force_seed`"):
        checkpointable(lambda x: x, _force_seed=True)


def test_numpy_bools_are_accepted_and_other_types_named_with_their_module():
    wrapped = checkpointable(lambda x: x * 2.0, checkpoint=np.True_)
    x = tf.constant(1.0)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = wrapped(x, _checkpoint=np.bool_(True), _force_seed=np.False_)
    assert float(tape.gradient(y, x)) == 2.0
    # NumPy 2 writes np.int64(1), NumPy 1 (TensorFlow 2.16 needs it) writes 1.
    with pytest.raises(TypeError, match=r"received (np\.int64\(1\)|1) of type numpy\.int64"):
        checkpointable(lambda x: x, checkpoint=np.int64(1))


class LazyModel(keras.Model):
    def build(self, input_shape):
        self.hidden = keras.layers.Dense(4, name="hidden")

    def call(self, x):
        return self.hidden(x)


def test_apply_checkpointing_on_an_unbuilt_model_says_to_build_it_first():
    with pytest.raises(ValueError, match=r"no sublayers yet.*build it first.*model\.build"):
        apply_checkpointing(LazyModel(), ["hidden"])


def test_did_you_mean_suggests_only_close_names():
    inputs = keras.Input((2,))
    model = keras.Model(inputs, keras.layers.Dense(2, name="dense_a")(inputs))
    with pytest.raises(ValueError) as error:
        apply_checkpointing(model, ["layer"])
    assert "did you mean" not in str(error.value) and "'dense_a'" in str(error.value)
    with pytest.raises(ValueError, match="did you mean 'dense_a'"):
        apply_checkpointing(model, ["dense_b"])


W = tf.Variable([0.5, -1.0], name="w")


def _sin_w(x):
    return tf.sin(x * W)


COMPOSED = {
    "tf.function(checkpointable(f))": (
        lambda: tf.function(checkpointable(_sin_w, checkpoint=True)), _sin_w),
    "checkpointable(tf.function(f))": (
        lambda: checkpointable(tf.function(_sin_w), checkpoint=True), _sin_w),
    "checkpoint inside a checkpoint": (
        lambda: checkpointable(lambda x: checkpointable(_sin_w, checkpoint=True)(x) * 2.0,
                               checkpoint=True),
        lambda x: _sin_w(x) * 2.0),
    "functools.partial": (
        lambda: functools.partial(checkpointable(lambda x, s: x * s * W, checkpoint=True),
                                  s=2.0),
        lambda x: x * 2.0 * W),
    "keyword-only and *args": (
        lambda: lambda x: checkpointable(lambda *xs, k: xs[0] * xs[1] * k * W,
                                         checkpoint=True)(x, x, k=x),
        lambda x: x * x * x * W),
    "an input returned as an output": (
        lambda: checkpointable(lambda x: (x, tf.sin(W) * x), checkpoint=True),
        lambda x: (x, tf.sin(W) * x)),
}


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("form", sorted(COMPOSED))
def test_composed_call_forms_match_the_plain_run(form, mode):
    make, plain = COMPOSED[form]

    def step(fn):
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.add_n([tf.reduce_sum(o ** 2) for o in tf.nest.flatten(fn(x))])
            return [loss] + tape.gradient(loss, [x, W])
        return _compiled(run, mode)

    x = tf.constant([0.2, 0.7])
    assert_all_close(step(make())(x), step(plain)(x))


def test_a_checkpointable_function_called_on_keras_tensors_is_refused():
    block = checkpointable(lambda x: keras.ops.tanh(x) * 2.0, checkpoint=True)
    with pytest.raises(TypeError, match=r"called on KerasTensors.*checkpointable\(layer, "
                                        r"checkpoint=True\)"):
        block(keras.Input((3,)))
    off = checkpointable(lambda x: keras.ops.tanh(x) * 2.0)  # checkpointing off: runs as is
    assert isinstance(off(keras.Input((3,))), keras.KerasTensor)
