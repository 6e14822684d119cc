"""Planning leaves no trace, and replays read what plain reads (issue 31).

Planning a model runs it to measure it. Afterwards every variable, metric, random
generator, optimizer slot and Keras call-context flag must be what plain training
leaves, and the checkpointed model's first step must equal plain's first step.
Each case is compared against an un-checkpointed twin built with the same seed.
"""

import gc
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, grads_of
from tensorflow.python.framework.func_graph import FuncGraph

import tf_checkpointing as tc


class RunningCentre(keras.layers.Layer):
    """A custom normalisation: updates a running mean, then reads it back (the
    tanh makes the output's gradient depend on the value read)."""

    def build(self, shape):
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False,
                                    name="mean")

    def call(self, x):
        self.mean.assign(0.9 * self.mean + 0.1 * tf.reduce_mean(x, 0))
        return tf.tanh(x - self.mean)


class Tracked(keras.layers.Layer):
    """A layer that updates a Keras metric in its call (a common monitoring pattern)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tracker = keras.metrics.Mean(name="tracked_mean")

    def call(self, x):
        self.tracker.update_state(x)
        return x


class OwnNoise(keras.layers.Layer):
    """A layer that draws from a ``tf.random.Generator`` of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = tf.random.Generator.from_seed(3)

    def call(self, x, training=None):
        return x + 0.1 * self.generator.normal(tf.shape(x))


def _model(middle, seed=0, batch_norm=False):
    keras.utils.set_random_seed(seed)
    x = keras.Input((16,))
    h = keras.layers.Dense(16, name="first")(x)
    if batch_norm:
        h = keras.layers.BatchNormalization(name="bn")(h)
    h = middle(h)
    h = keras.layers.Dense(16, activation="tanh", name="second")(h)
    h = keras.layers.Dropout(0.5, name="drop")(h)
    return keras.Model(x, keras.layers.Dense(4, name="head")(h))


def _state(model, extra=()):
    """Every variable the model tracks (weights, statistics, metrics, seed
    generators), by position and path (Keras numbers a twin's names on), plus
    ``extra`` values."""
    variables = list(model.variables)
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001
        variables += layer.metrics_variables
    values = {f"{k} {re.sub(r'_[0-9]+', '', v.path)}": np.array(v.numpy())
              for k, v in enumerate(variables)}
    for k, value in enumerate(extra):
        values[f"extra{k}"] = np.array(value)
    return values


def _assert_same_state(ours, plain):
    assert set(ours) == set(plain)
    for name in plain:
        np.testing.assert_allclose(ours[name], plain[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_a_value_read_after_its_assign_carries_no_gradient_in_a_planned_region(mode):
    """Plain TensorFlow: the value read after ``assign`` does not depend on x for the
    gradient. A flat region's replay keeps writes in a stateless scope; its reads
    must not become a gradient path through the assigned value."""
    x = tf.random.stateless_normal([8, 16], seed=[1, 2])
    plain_model = _model(RunningCentre(name="centre"))
    plain_model(x)
    plain = grads_of(lambda x: plain_model(x, training=False), [x],
                     plain_model.trainable_variables, mode)
    model = _model(RunningCentre(name="centre"))
    model(x)
    plan = tc.ModelPlan.from_regions(model, [["first", "centre", "second"]], mode=mode)
    tc.apply_checkpointing(model, plan=plan)
    ours = grads_of(lambda x: model(x, training=False), [x], model.trainable_variables, mode)
    assert_all_close(ours, plain, rtol=1e-4 if mode == "xla" else 1e-5)
    np.testing.assert_allclose(model.get_layer("centre").mean.numpy(),
                               plain_model.get_layer("centre").mean.numpy(), rtol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_a_value_read_after_its_assign_in_a_checkpointable_layer(mode):
    x = tf.random.stateless_normal([8, 16], seed=[1, 2])
    keras.utils.set_random_seed(0)
    plain_layer = RunningCentre()
    plain_layer(x)
    plain = grads_of(plain_layer, [x], [], mode)
    layer = tc.checkpointable(RunningCentre(), checkpoint=True)
    layer(x)
    ours = grads_of(layer, [x], [], mode)
    assert_all_close(ours, plain)
    np.testing.assert_allclose(layer.mean.numpy(), plain_layer.mean.numpy(), rtol=1e-6)


def test_the_planning_call_runs_in_the_mode_the_user_called():
    """``model(x)`` under a tape, with no ``training`` argument, is an inference
    call: BatchNormalization must use its moving statistics and Dropout must not
    fire, in the planning call as in the call after it."""
    x = tf.random.stateless_normal([8, 16], seed=[3, 4])
    plain_model = _model(keras.layers.Activation("relu"), batch_norm=True)
    with tf.GradientTape() as tape:
        expected = plain_model(x)
    model = _model(keras.layers.Activation("relu"), batch_norm=True)
    tc.apply_checkpointing(model, budget="min")
    with tf.GradientTape() as tape:
        got = model(x)
    del tape
    assert_all_close(got, expected)
    _assert_same_state(_state(model), _state(plain_model))


@pytest.mark.parametrize("jit_compile", [False, True])
def test_planning_leaves_metrics_as_plain_training_does(jit_compile):
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    y = np.zeros((8, 4), "float32")

    def trained(checkpoint):
        model = _model(Tracked(name="tracked"))
        if checkpoint:
            tc.apply_checkpointing(model, budget="min")
        model.compile(keras.optimizers.SGD(1e-2), "mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        tracker = model.get_layer("tracked").tracker
        return model, [v.numpy() for v in tracker.variables]

    plain_model, plain_tracker = trained(False)
    model, tracker = trained(True)
    assert_all_close(tracker, plain_tracker)
    _assert_same_state(_state(model), _state(plain_model))


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_planning_draws_nothing_from_layer_owned_generators(mode):
    x = tf.random.stateless_normal([8, 16], seed=[5, 6])

    def first_step(checkpoint):
        model = _model(OwnNoise(name="noise"))
        model(x)
        if checkpoint:
            tc.apply_checkpointing(model, budget="min")
        out = grads_of(lambda x: model(x, training=True), [x], model.trainable_variables,
                       mode)
        return out, _state(model, [model.get_layer("noise").generator.state.numpy()])

    plain, plain_state = first_step(False)
    ours, state = first_step(True)
    assert_all_close(ours, plain, rtol=1e-4 if mode == "xla" else 1e-5)
    _assert_same_state(state, plain_state)


_UNTRACKED_GENERATOR = tf.random.Generator.from_seed(5)
_UNTRACKED_SEEDS = keras.random.SeedGenerator(11)
_UNTRACKED_COUNTER = tf.Variable(0.0)


class Untracked(keras.layers.Layer):
    """Draws from (or counts in) state the model does not track: a module-level
    ``tf.random.Generator``, Keras ``SeedGenerator`` or ``tf.Variable``."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def call(self, x, training=None):
        if self.kind == "generator":
            return x + 0.1 * _UNTRACKED_GENERATOR.normal(tf.shape(x))
        if self.kind == "seed_generator":
            return x + 0.1 * keras.random.normal(keras.ops.shape(x), seed=_UNTRACKED_SEEDS)
        _UNTRACKED_COUNTER.assign_add(1.0)
        return x * _UNTRACKED_COUNTER


def _untracked_state():
    return [_UNTRACKED_GENERATOR.state.numpy(), keras.ops.convert_to_numpy(_UNTRACKED_SEEDS.state),
            _UNTRACKED_COUNTER.numpy()]


@pytest.mark.parametrize("kind, mode", [
    *[(kind, mode) for kind in ("generator", "seed_generator", "counter")
      for mode in ("eager", "graph")],
    ("generator", "xla"),  # one kind: they are put back alike, and XLA tests are slow
])
def test_planning_puts_back_state_the_model_does_not_track(kind, mode):
    """Planning found the variables to put back through the model, and left an
    untracked generator one draw (three under XLA) ahead: every later draw was
    another part of the sequence than plain's."""
    x = tf.random.stateless_normal([8, 16], seed=[5, 8])
    start = _untracked_state()

    def first_step(checkpoint):
        _UNTRACKED_GENERATOR.reset_from_seed(5)
        _UNTRACKED_SEEDS.state.assign(start[1])
        _UNTRACKED_COUNTER.assign(0.0)
        model = _model(Untracked(kind, name="untracked"))
        if checkpoint:
            tc.apply_checkpointing(model, budget="min")
        out = grads_of(lambda x: model(x, training=True), [x], model.trainable_variables,
                       mode)
        return out, _state(model, _untracked_state())

    plain, plain_state = first_step(False)
    ours, state = first_step(True)
    assert_all_close(ours, plain, rtol=1e-4 if mode == "xla" else 1e-5)
    _assert_same_state(state, plain_state)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_planning_leaves_no_trace_in_a_fit_step(jit_compile, tmp_path):
    """The generic check: after one ``fit`` step, every variable the model tracks
    (weights, BatchNorm statistics, Dropout seed generators, metrics, a layer's
    own generator), every optimizer variable and the global generator are what
    plain training leaves; and so is every variable a TensorFlow checkpoint of
    model and optimizer saves (TensorFlow's own list, not this library's)."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 16)).astype("float32")
    y = rng.normal(size=(8, 4)).astype("float32")

    def trained(checkpoint):
        keras.utils.set_random_seed(2)
        middle = keras.Sequential([Tracked(name="tracked"), OwnNoise(name="noise"),
                                   keras.layers.Activation("gelu")], name="middle")
        model = _model(middle, batch_norm=True)
        if checkpoint:
            tc.apply_checkpointing(model, budget="min")
        optimizer = keras.optimizers.SGD(1e-2, momentum=0.9)
        model.compile(optimizer, "mse", metrics=["mae"], jit_compile=jit_compile)
        tf.random.set_global_generator(tf.random.Generator.from_seed(7))
        history = model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        extra = [v.numpy() for v in optimizer.variables]
        extra.append(tf.random.get_global_generator().state.numpy())
        extra.append(history.history["loss"][0])
        path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(
            str(tmp_path / f"ckpt{int(checkpoint)}"))
        reader = tf.train.load_checkpoint(path)
        saved = {re.sub(r"_[0-9]+", "", name): reader.get_tensor(name)
                 for name in reader.get_variable_to_shape_map()
                 if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}
        return _state(model, extra), saved

    (ours, ours_saved), (plain, plain_saved) = trained(True), trained(False)
    _assert_same_state(ours, plain)
    _assert_same_state(ours_saved, plain_saved)


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_planning_under_mixed_precision_puts_back_float32_weights(mixed_float16, mode):
    """Planning on the first training call runs inside the model's Keras call,
    whose autocast scope reads a float32 variable as float16: the weights were
    saved so, and put back rounded to float16 (and an optimizer's learning rate,
    tracked by a compiled model, 0.001 -> 0.0010004)."""
    x = tf.random.stateless_normal([8, 16], seed=[5, 7])

    def first_step(checkpoint):
        model = _model(Tracked(name="tracked"), batch_norm=True)
        model.compile(keras.optimizers.SGD(1e-3), "mse")  # tracks the learning rate
        model(x)
        if checkpoint:
            tc.apply_checkpointing(model, budget="min")
        grads_of(lambda x: model(x, training=True), [x], model.trainable_variables, mode)
        return _state(model, [v.numpy() for v in model.optimizer.variables])

    ours, plain = first_step(True), first_step(False)
    assert ours["0 first/kernel"].dtype == np.float32
    _assert_same_state(ours, plain)


class LegacyDropout(keras.layers.Layer):
    """``tf.nn.dropout`` without a seed: a legacy stateful random op."""

    def call(self, x):
        return tf.nn.dropout(x, 0.5)


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_legacy_random_ops_in_a_planned_region_are_never_silent(mode):
    """Their replay draws other numbers: the trace says so and names the fix, and
    the fix (force_seed=True) replays them exactly (check="values" compares)."""
    x = tf.random.stateless_normal([8, 16], seed=[7, 8])
    model = _model(LegacyDropout(name="legacy"))
    model(x)
    plan = tc.ModelPlan.from_regions(model, [["first", "legacy", "second"]], mode=mode)
    tc.apply_checkpointing(model, plan=plan)
    with pytest.warns(UserWarning, match=r"legacy random op RandomUniform.*force_seed=True"):
        grads_of(lambda x: model(x, training=True), [x], model.trainable_variables, mode)
    tc.apply_checkpointing(model, plan=plan, force_seed=True, check="values")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        grads_of(lambda x: model(x, training=True), [x], model.trainable_variables, mode)


def test_legacy_random_ops_in_an_eager_checkpointed_call_are_never_silent():
    x = tf.random.stateless_normal([8, 16], seed=[7, 8])
    layer = tc.checkpointable(LegacyDropout(), checkpoint=True)
    with pytest.warns(UserWarning, match=r"legacy random op RandomUniform.*force_seed=True"):
        grads_of(layer, [x], [], "eager")
    exact = tc.checkpointable(LegacyDropout(), checkpoint=True, force_seed=True,
                              check="values")
    grads_of(exact, [x], [], "eager")  # a mismatch raises ReplayMismatchError


def _buffer_address(variable):
    """Where a variable's value is stored (through DLPack, whose tensor starts
    with its data pointer)."""
    import ctypes

    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    capsule = tf.experimental.dlpack.to_dlpack(tf.convert_to_tensor(variable))
    return ctypes.cast(get(capsule, b"dltensor"), ctypes.POINTER(ctypes.c_void_p))[0]


def _custom_gradients():
    from tensorflow.python.framework import ops

    return {k for k in ops._gradient_registry._registry  # noqa: SLF001
            if k.startswith("CustomGradient-")}


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_planning_leaves_the_memory_pool_as_it_found_it(mode):
    """Issue 48: after planning, the device's pool holds what it held before, in
    the same buffers. Planning used to leave the graphs it traced with custom
    gradients (every checkpointed call) registered, so alive, with their
    constants in the pool, and its BatchNorm statistics in buffers it had
    allocated among its measurements' tensors: both above the memory planning
    used, which then stayed a free chunk of its own, and an XLA step's buffer
    was handed that whole chunk (ResNet50: 253 MiB for a 183 MiB buffer)."""
    keras.utils.set_random_seed(0)
    x_in = keras.Input((64,))
    h = x_in
    for i in range(4):
        y = keras.layers.Dense(64, activation="relu", name=f"dense{i}")(h)
        h = keras.layers.Add(name=f"add{i}")(
            [h, keras.layers.BatchNormalization(name=f"bn{i}")(y)])
    model = keras.Model(x_in, keras.layers.Dense(4, name="head")(h))
    x = tf.random.normal([32, 64])
    model(x)
    registered = _custom_gradients()
    graphs = _graph_ids()
    addresses = {v.path: _buffer_address(v) for v in model.variables}
    in_use = tf.config.experimental.get_memory_info("CPU:0")["current"]

    tc.plan_model(model, x, budget="min", mode=mode)

    gc.collect()
    assert _custom_gradients() - registered == set()
    # The per-call graphs of the profile (an Add's among them, decision 0042).
    assert [g.name for g in _graphs() if g.name == "step" and id(g) not in graphs] == []
    moved = [v.path for v in model.variables if _buffer_address(v) != addresses[v.path]]
    assert moved == []
    # What is left is small against the step's megabytes that the leaks this
    # guards against kept (ResNet50: 70 MiB).
    assert tf.config.experimental.get_memory_info("CPU:0")["current"] - in_use <= 256 * 1024


@pytest.mark.parametrize("mode", ["graph", "xla"])
def test_planning_collects_what_it_traced_before_it_returns(mode):
    """Issue 48: the functions and graphs planning traced are in reference cycles
    that hold small buffers; collected only later, a training step planned in its
    first call allocated its own constants next to them, above the memory planning
    had used, and its later steps were handed that free chunk whole. The garbage
    collector is off here, so only planning's own collection can free them."""
    keras.utils.set_random_seed(0)
    x_in = keras.Input((32,))
    h = x_in
    for i in range(3):
        h = keras.layers.Add(name=f"add{i}")(
            [h, keras.layers.Dense(32, activation="relu", name=f"dense{i}")(h)])
    model = keras.Model(x_in, keras.layers.Dense(4, name="head")(h))
    x = tf.random.normal([16, 32])
    model(x)
    before = _graph_ids()
    gc.disable()
    try:
        tc.plan_model(model, x, budget="min", mode=mode)
        left = [g.name for g in _graphs() if id(g) not in before]
    finally:
        gc.enable()
    assert left == []


def _graphs():
    """The traced graphs alive (or not yet collected)."""
    return [g for g in gc.get_objects() if isinstance(g, FuncGraph)]


def _graph_ids():
    gc.collect()
    return {id(g) for g in _graphs()}
