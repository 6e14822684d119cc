"""checkpoint_sequential and CheckpointedSequential: exact gradients, keyword routing,
recomputation counts, memory, Keras training and saving, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import Counter, assert_all_close, ran_in_fresh_process

from tf_checkpointing import CheckpointedSequential, checkpoint_sequential
from tf_checkpointing._sequential import run_plan
from tf_checkpointing.planning.plans._plan import Segment, SequentialPlan
from tf_checkpointing.plans import plan_sequential

MIB = 2**20


def _chain(n=6, width=8, seed=0):
    """Keras layers and plain functions, one Dropout (training only), one layer
    without a `training` argument that fails if it receives one."""
    keras.utils.set_random_seed(seed)
    layers = []
    for i in range(n):
        if i % 3 == 0:
            layers.append(keras.layers.Dense(width, activation="tanh", name=f"dense_{i}"))
        elif i % 3 == 1:
            layers.append(lambda x: tf.nn.gelu(x) * 1.5)  # no **kwargs: must get no training
        else:
            layers.append(keras.layers.LayerNormalization(name=f"norm_{i}"))
    layers.insert(n // 2, keras.layers.Dropout(0.3, seed=7, name="dropout"))
    return layers


def _variables(layers):
    return [v for layer in layers if isinstance(layer, keras.layers.Layer)
            for v in layer.trainable_variables]


_initial_seed_states = {}


def _reset_seeds(layers):
    """Puts each Dropout's seed back, so that two runs draw the same masks."""
    for layer in layers:
        if isinstance(layer, keras.layers.Dropout):
            state = layer.seed_generator.state
            initial = _initial_seed_states.setdefault(id(layer), state.numpy())
            state.assign(initial)


def _grads(runner, layers, x, mode):
    variables = _variables(layers)

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = runner(x)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x] + variables)

    _reset_seeds(layers)
    return compile_step(step, mode)(x)


def _plain(layers, **kwargs):
    def run(x):
        for layer in layers:
            x = layer(x, **kwargs) if isinstance(layer, keras.layers.Layer) else layer(x)
        return x

    return run


NESTED = SequentialPlan(tuple(f"layer{i}" for i in range(7)), (
    Segment(0, 4, True, (Segment(0, 1, True), Segment(1, 3, True, (
        Segment(1, 2, True), Segment(2, 3, False))), Segment(3, 4, False))),
    Segment(4, 5, False),
    Segment(5, 7, True),
))


@pytest.mark.parametrize("segments", [1, "sqrt", 7, "nested"])  # sqrt: 3 of 7 layers
def test_gradients_and_outputs_match_the_plain_chain(segments, mode):
    layers = _chain()
    x = tf.random.stateless_normal([4, 8], seed=[1, 2])
    keras.Sequential(layers[:1]).build((None, 8))  # build the first Dense before comparing
    _plain(layers, training=True)(x)
    expected = _grads(_plain(layers, training=True), layers, x, mode)
    if segments == "nested":
        runner = lambda x: run_plan(layers, NESTED, x, {"training": True}, [
            {"training": True} if isinstance(layer, keras.layers.Layer) else {}
            for layer in layers])
    else:
        runner = lambda x: checkpoint_sequential(layers, x, segments=segments, training=True)
    actual = _grads(runner, layers, x, mode)
    names = ["y", "x"] + [v.path for v in _variables(layers)]
    assert_all_close(actual[0], expected[0], names=names[:1])
    assert_all_close(actual[1], expected[1], names=names[1:])


def test_every_layer_runs_twice_in_checkpointed_segments_and_once_in_the_last():
    layers = [Counter(keras.layers.Dense(4)) for _ in range(8)]
    x = tf.ones([2, 4])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = checkpoint_sequential(layers, x, segments=4)
    tape.gradient(y, x)
    assert [layer.calls for layer in layers] == [2] * 6 + [1] * 2


def test_nested_plan_runs_each_layer_as_often_as_the_plan_says(mode):
    layers = [Counter(lambda x: tf.sin(x) + 1.0) for _ in range(7)]
    x = tf.ones([3])

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = run_plan(layers, NESTED, x, {}, [{}] * 7)
        return tape.gradient(y, x)

    compile_step(step, mode)(x)
    assert [layer.calls for layer in layers] == NESTED.forward_counts == [3, 4, 3, 2, 1, 2, 2]


def test_without_a_tape_each_layer_runs_once():
    layers = [Counter(tf.nn.relu) for _ in range(4)]
    checkpoint_sequential(layers, tf.ones([2]), segments=2)
    assert [layer.calls for layer in layers] == [1] * 4


def test_nested_inputs_and_keyword_tensors_get_gradients(mode):
    seen = []

    def first(inputs, scale):
        x, y = inputs["x"], inputs["y"]
        return (x * scale, y)

    def middle(pair, training=None):
        seen.append(training)
        return (tf.sin(pair[0]) * pair[1], pair[1])

    def last(pair):  # no keyword arguments at all
        return {"out": pair[0] + pair[1]}

    layers = [first, middle, middle, middle, last]
    inputs = {"x": tf.constant([1.0, 2.0]), "y": tf.constant([0.5, 3.0])}
    scale = tf.constant(1.5)

    def step(segments):
        def run(x, y, scale):
            with tf.GradientTape() as tape:
                tape.watch([x, y, scale])
                if segments is None:
                    out = last(middle(middle(middle(first({"x": x, "y": y}, scale),
                                                    training=True), training=True),
                                      training=True))
                else:
                    out = checkpoint_sequential(layers, {"x": x, "y": y}, segments=segments,
                                                scale=scale, training=True)
                loss = tf.reduce_sum(out["out"] ** 2)
            return loss, tape.gradient(loss, [x, y, scale])

        return compile_step(run, mode)(inputs["x"], inputs["y"], scale)

    expected = step(None)
    for segments in (2, 5):
        assert_all_close(step(segments), expected, names=["loss", "x", "y", "scale"])
    assert set(seen) == {True}


def _peak(fn, x):
    fn(x)  # warm up (build layers, trace)
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    fn(x)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start


def _step(runner, variables):
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(runner(x))
        return tape.gradient(loss, [x] + variables)

    return step


def test_sqrt_segments_need_at_most_0_6x_the_memory_of_checkpointing_every_layer(request):
    # 36 layers: sqrt segments keep 6 boundaries plus one 6-layer segment's
    # activations, about a third of what plain backprop or per-layer checkpointing
    # keeps (each checkpointed layer keeps its input, which is what plain keeps). The
    # bound leaves room for the allocator's rounding; the allocator's bytes are read
    # in a process of its own, as earlier tests' cached state shifts them.
    if ran_in_fresh_process(request):
        return
    from tf_checkpointing import checkpointable

    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(64, activation="relu") for _ in range(36)]
    x = tf.random.normal([512, 64])  # activations 128 KiB each, kernels 16 KiB
    _plain(layers)(x)
    variables = _variables(layers)
    each = [checkpointable(layer) for layer in layers]

    def every_layer(x):
        for layer in each:
            x = layer(x, _checkpoint=True)
        return x

    plain = _peak(_step(_plain(layers), variables), x)
    every = _peak(_step(every_layer, variables), x)
    sqrt = _peak(_step(lambda x: checkpoint_sequential(layers, x), variables), x)
    print(f"sqrt {sqrt / MIB:.2f} MiB, every layer {every / MIB:.2f}, plain {plain / MIB:.2f}")
    assert sqrt <= 0.6 * every, (sqrt / MIB, every / MIB)
    assert sqrt <= 0.6 * plain, (sqrt / MIB, plain / MIB)


# CheckpointedSequential ------------------------------------------------------------


def _stack(seed=0):
    keras.utils.set_random_seed(seed)
    return [keras.layers.Dense(8, activation="relu"), keras.layers.BatchNormalization(),
            keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(8),
            keras.layers.LayerNormalization(), keras.layers.Dense(4)]


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 4)).astype(
        "float32")


def _model(body):
    model = keras.Sequential([keras.Input((6,)), body])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


@pytest.mark.parametrize("options", ["segments", "budget"])
def test_trains_in_fit_exactly_like_keras_sequential(options):
    x, y = _data()
    plain = _model(keras.Sequential(_stack(), name="body"))
    if options == "budget":  # the least memory: recomputes the most
        layers = _stack(seed=1)
        keras.Sequential(layers).build((None, 6))
        # Profiled here for a graph, as fit runs the step; fit's trace then finds the
        # profile (same layers, shapes, keywords and mode).
        probe = plan_sequential(layers, x[:16], budget=2**40, mode="graph", training=True)
        body = CheckpointedSequential(layers, budget=probe.min_budget_bytes, name="body")
    else:
        body = CheckpointedSequential(_stack(seed=1), segments=3, name="body")
    ours = _model(body)
    ours.set_weights(plain.get_weights())
    assert [w.shape for w in ours.get_weights()] == [w.shape for w in plain.get_weights()]
    history_plain = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    history_ours = ours.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert body.plan.extra_forward_layers > 0, str(body.plan)  # planned inside fit's trace
    np.testing.assert_allclose(history_ours.history["loss"], history_plain.history["loss"],
                               rtol=1e-5, err_msg=str(body.plan))
    assert_all_close(ours.get_weights(), plain.get_weights(),
                     names=[v.path for v in plain.weights])  # BatchNorm statistics too


def test_gradients_match_keras_sequential_in_every_mode(mode):
    x, _ = _data()
    seq = keras.Sequential(_stack())
    ours = CheckpointedSequential(_stack(seed=1), segments=2)
    seq.build((None, 6))
    ours.build((None, 6))
    ours.set_weights(seq.get_weights())

    def grads(layer):
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(layer(x, training=True) ** 2)
            return loss, tape.gradient(loss, layer.trainable_variables)

        return compile_step(step, mode)(tf.constant(x))

    assert_all_close(grads(ours), grads(seq))


def test_weights_move_both_ways_and_through_weight_files(tmp_path):
    seq = keras.Sequential(_stack())
    ours = CheckpointedSequential(_stack(seed=1))
    seq.build((None, 6))
    ours.build((None, 6))
    x = _data()[0]
    ours.set_weights(seq.get_weights())
    assert_all_close(ours(x), seq(x))
    seq2 = keras.Sequential(_stack(seed=2))
    seq2.build((None, 6))
    seq2.set_weights(ours.get_weights())
    assert_all_close(seq2(x), seq(x))

    keras.saving.save_weights(seq, tmp_path / "seq.weights.h5")
    fresh = CheckpointedSequential(_stack(seed=3))
    fresh.build((None, 6))
    keras.saving.load_weights(fresh, tmp_path / "seq.weights.h5")
    assert_all_close(fresh(x), seq(x))
    keras.saving.save_weights(fresh, tmp_path / "ours.weights.h5")
    seq3 = keras.Sequential(_stack(seed=4))
    seq3.build((None, 6))
    seq3.load_weights(tmp_path / "ours.weights.h5")
    assert_all_close(seq3(x), seq(x))


def test_round_trips_through_a_keras_file(tmp_path):
    x, y = _data()
    model = _model(CheckpointedSequential(_stack(), segments=2, name="body"))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    body = loaded.get_layer("body")
    assert isinstance(body, CheckpointedSequential)
    assert body.segments == 2 and body.budget is None and len(body.layers) == 6
    assert_all_close(loaded(x), model(x))
    loaded.fit(x, y, batch_size=32, epochs=1, verbose=0)  # and it still trains


# Errors ------------------------------------------------------------------------------


class TestErrors:
    def test_empty_chain(self):
        with pytest.raises(ValueError, match=r"`layers` must contain at least one layer.*"
                                             r"received an empty list"):
            checkpoint_sequential([], tf.ones([2]))

    @pytest.mark.parametrize("segments", [0, 5])
    def test_segments_out_of_range(self, segments):
        with pytest.raises(ValueError, match=rf"`segments` must be between 1 and the number "
                                             rf"of layers \(4\); received segments={segments}"):
            checkpoint_sequential([tf.nn.relu] * 4, tf.ones([2]), segments=segments)

    @pytest.mark.parametrize("segments", ["half", 2.0, True])
    def test_segments_of_the_wrong_type(self, segments):
        with pytest.raises(TypeError, match=r"`segments` must be an int or 'sqrt'; received"):
            checkpoint_sequential([tf.nn.relu] * 4, tf.ones([2]), segments=segments)

    def test_not_callable(self):
        with pytest.raises(TypeError, match=r"`layers` must contain only callables.*received "
                                            r"3 of type int at index 1"):
            checkpoint_sequential([tf.nn.relu, 3], tf.ones([2]))

    def test_a_class_instead_of_an_instance(self):
        with pytest.raises(TypeError, match=r"at index 0 \(a class: instantiate it\)"):
            checkpoint_sequential([keras.layers.Dense], tf.ones([2]))

    def test_keyword_that_no_layer_takes(self):
        with pytest.raises(TypeError, match=r"'trainng' are accepted by none of the 2 layers"):
            checkpoint_sequential([tf.nn.relu, tf.nn.relu], tf.ones([2]), trainng=True)

    def test_segments_and_budget_together(self):
        with pytest.raises(ValueError, match=r"pass either `segments` or `budget`"):
            checkpoint_sequential([tf.nn.relu] * 2, tf.ones([2]), segments=2, budget=10**6)

    @pytest.mark.parametrize("budget", [-1, 0, float("inf")])
    def test_budget_not_positive(self, budget):
        with pytest.raises(ValueError, match=r"`budget` must be a positive, finite number "
                                             rf"of bytes; received budget={budget}"):
            checkpoint_sequential([tf.nn.relu] * 2, tf.ones([2]), budget=budget)

    @pytest.mark.parametrize(("budget", "error"), [("1GB", ValueError), (True, TypeError)])
    def test_budget_not_a_number(self, budget, error):
        with pytest.raises(error, match=r"`budget` must be a number of bytes or \"min\"; "
                                        r"received"):
            checkpoint_sequential([tf.nn.relu] * 2, tf.ones([2]), budget=budget)

    def test_budget_below_the_minimum(self):
        layers = [keras.layers.Dense(32) for _ in range(4)]
        with pytest.raises(ValueError, match=r"`budget` is below the least memory.*expected "
                                             r"at least \d+ bytes.*received budget=2000 "):
            with tf.GradientTape():
                checkpoint_sequential(layers, tf.ones([64, 32]), budget=2000)

    def test_checkpointed_sequential_needs_keras_layers(self):
        with pytest.raises(TypeError, match=r"only Keras layer instances.*keras.layers."
                                            r"Activation"):
            CheckpointedSequential([keras.layers.Dense(2), tf.nn.relu])

    def test_budget_with_an_unknown_batch_size(self):
        layers = [keras.layers.Dense(4) for _ in range(3)]

        @tf.function(input_signature=[tf.TensorSpec([None, 4])])
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = checkpoint_sequential(layers, x, budget=10**8)
            return tape.gradient(y, x)

        with pytest.raises(ValueError, match=r"needs the full input shape.*shape \(None, 4\)"
                                             r".*drop_remainder=True.*segments= instead of "
                                             r"budget="):
            step(tf.ones([2, 4]))
