"""Which plan a model with ``apply_checkpointing(model, budget=...)``, or a
``CheckpointedSequential(budget=...)``, runs: one per mode and batch shape,
made on the first call that needs it.

A plan made for one batch size or mode and run for another is not within its
budget: a batch-4 warm-up, then batch-32 training, ran the batch-4 plan (no
regions) at 1.42x the budget; an eager sanity step pinned an eager plan that
``Model.fit`` then ran.
"""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import assert_all_close, partly_frozen

import tf_checkpointing as tc
from tf_checkpointing import _plan_maker, _sequential_layer


@pytest.fixture
def plans_made(monkeypatch):
    """The (mode, input shapes) of each plan the runner makes."""
    made = []
    original = _plan_maker.plan_graph

    def counting(graph, inputs, budget, *, mode, **kwargs):
        made.append((mode, tuple(tuple(x.shape) for x in tf.nest.flatten(inputs))))
        return original(graph, inputs, budget, mode=mode, **kwargs)

    monkeypatch.setattr(_plan_maker, "plan_graph", counting)
    return made


def _train_step(model):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)
    return step


def _batch(n):
    return tf.random.stateless_normal([n, 8, 8, 3], [n, 1])


def _net():
    """helpers.residual_net's blocks (convolution, BatchNorm, dropout, a replay
    counter), two of them: which plan runs shows as well, planned in less time."""
    model = partly_frozen(frozen_blocks=0, blocks=2, count=True)
    model.get_layer("stem").trainable = True  # partly_frozen's stem is always frozen
    return model


def test_a_larger_batch_is_planned_anew_and_a_smaller_one_reuses_its_plan(plans_made):
    keras.utils.set_random_seed(0)
    model = _net()
    tc.apply_checkpointing(model, budget="min")
    step = _train_step(model)
    step(_batch(2))  # a warm-up step on a few examples
    step(_batch(16))
    assert plans_made == [("graph", ((2, 8, 8, 3),)), ("graph", ((16, 8, 8, 3),))]
    assert model.call.plan.regions == tc.plan_model(
        model, _batch(16), budget="min", mode="graph").regions
    step(_batch(8))  # a smaller batch keeps less: the batch-16 plan
    assert len(plans_made) == 2
    assert model.call.plan is model.call.maker.plans.plans("graph")[-1]


def test_unfreezing_layers_plans_anew(plans_made):
    # A compiled step keeps nothing for frozen layers (see test_whole_model_frozen):
    # a plan made while a backbone is frozen is not within the budget once it trains.
    keras.utils.set_random_seed(0)
    model = partly_frozen(frozen_blocks=1, blocks=2)
    tc.apply_checkpointing(model, budget="min")
    _train_step(model)(_batch(4))
    for layer in model.layers:  # fine-tuning's second phase: the whole model trains
        layer.trainable = True
    _train_step(model)(_batch(4))
    assert plans_made == [("graph", ((4, 8, 8, 3),))] * 2
    _train_step(model)(_batch(4))  # the same layers frozen: the same plan
    assert len(plans_made) == 2


def test_an_eager_step_then_fit_plans_for_the_graph(plans_made):
    keras.utils.set_random_seed(0)
    model = _net()
    tc.apply_checkpointing(model, budget="min")
    x = np.random.default_rng(0).random((8, 8, 8, 3), np.float32)
    with tf.GradientTape() as tape:  # an eager sanity step
        loss = tf.reduce_sum(model(x[:4], training=True))
    tape.gradient(loss, model.trainable_variables)
    model.compile("sgd", "mse")
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, epochs=1, verbose=0)
    assert [mode for mode, _ in plans_made] == ["eager", "graph"]
    assert model.call.plan.mode == "graph"


def test_a_batch_of_unknown_size_runs_the_plan_of_the_largest_batch(plans_made):
    """A function traced again for an epoch's last, smaller batch with
    ``reduce_retracing`` (as Model.fit's is) sees a None batch dimension."""
    keras.utils.set_random_seed(0)
    model = _net()
    tc.apply_checkpointing(model, budget="min")

    @tf.function(reduce_retracing=True)
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    step(_batch(4))
    with pytest.warns(UserWarning, match=r"unknown batch size.*runs the plan made for "
                                         r"inputs of shapes \[\(4, 8, 8, 3\)\], whose "
                                         r"budget holds only for inputs no larger"):
        step(_batch(3))
    assert step.experimental_get_tracing_count() == 2
    assert plans_made == [("graph", ((4, 8, 8, 3),))]


def test_an_unknown_dimension_other_than_the_batch_is_named(plans_made):
    """A sequence length traced as None is not a batch size: the warning names the
    axis and a fix that applies to it (drop_remainder would not)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((None, 16))
    h = x
    for _ in range(3):
        h = keras.layers.Add()([h, keras.layers.Dense(16, activation="relu")(h)])
    model = keras.Model(x, keras.layers.Dense(1)(h))
    tc.apply_checkpointing(model, budget="min")

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    tf.function(step)(tf.random.normal([4, 8, 16]))
    ragged_length = tf.function(step, input_signature=[tf.TensorSpec([4, None, 16])])
    with pytest.warns(UserWarning, match=r"unknown size \(axis 1 of input 0\).*"
                                         r"give that dimension a fixed size") as caught:
        ragged_length(tf.random.normal([4, 6, 16]))
    assert not any("drop_remainder" in str(w.message) for w in caught)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_frozen_model_under_a_tape_is_planned_and_exact(mode, plans_made):
    """Fine-tuning through a backbone called with training=False (BatchNorm in
    inference mode) takes gradients: it is planned, not run plainly."""
    keras.utils.set_random_seed(0)
    plain, ours = _net(), _net()
    ours.set_weights(plain.get_weights())
    tc.apply_checkpointing(ours, budget="min")
    x = _batch(4)

    def grads(model):
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=False) ** 2)
            return loss, tape.gradient(loss, model.trainable_variables)
        return step() if mode == "eager" else tf.function(step)()

    expected, got = grads(plain), grads(ours)
    assert plans_made and ours.call.plan.regions
    assert_all_close(got[0], expected[0])
    assert_all_close(got[1], expected[1], atol=1e-5)


def test_predict_and_evaluate_before_training_plan_nothing(plans_made):
    keras.utils.set_random_seed(0)
    model = _net()
    model.compile("sgd", "mse")
    tc.apply_checkpointing(model, budget="min")
    x = np.random.default_rng(0).random((8, 8, 8, 3), np.float32)
    model.predict(x, verbose=0)
    model.evaluate(x, np.zeros((8, 2), np.float32), verbose=0)
    assert plans_made == []
    model.fit(x, np.zeros((8, 2), np.float32), batch_size=4, verbose=0)
    model.evaluate(x, np.zeros((8, 2), np.float32), batch_size=8, verbose=0)
    assert plans_made == [("graph", ((4, 8, 8, 3),))]  # evaluate runs the training plan


def test_a_chain_plans_per_mode_and_larger_batch_and_not_for_inference(monkeypatch):
    made = []
    original = _sequential_layer.cached_plan

    def counting(layers, inputs, budget, *args, mode, **kwargs):
        made.append((mode, tuple(inputs.shape)))
        return original(layers, inputs, budget, *args, mode=mode, **kwargs)

    monkeypatch.setattr(_sequential_layer, "cached_plan", counting)
    keras.utils.set_random_seed(0)
    body = tc.CheckpointedSequential(
        [keras.layers.Dense(32, activation="relu") for _ in range(6)], budget="min")
    model = keras.Sequential([keras.Input((32,)), body, keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).random((16, 32), np.float32)
    model.predict(x, batch_size=8, verbose=0)  # inference: nothing planned
    assert made == []
    with tf.GradientTape() as tape:  # an eager step on a few examples
        loss = tf.reduce_sum(model(x[:4], training=True))
    tape.gradient(loss, model.trainable_variables)
    model.fit(x, np.zeros((16, 1), np.float32), batch_size=8, verbose=0)
    model.fit(x, np.zeros((16, 1), np.float32), batch_size=4, verbose=0)
    assert made == [("eager", (4, 32)), ("graph", (8, 32))]


def test_an_unknown_batch_in_a_new_mode_runs_another_modes_plan_and_warns(plans_made):
    """No plan can be made for a None batch: rather than fail the step, the plan
    of another mode runs, and the warning says its budget may not hold."""
    keras.utils.set_random_seed(0)
    model = _net()
    x = _batch(4)
    model(x)
    before = [v.numpy() for v in model.variables]

    def two_steps():
        with tf.GradientTape() as tape:  # an eager step (checkpointed: an eager plan)
            loss = tf.reduce_sum(model(x, training=True))
        tape.gradient(loss, model.trainable_variables)

        @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 3])])
        def step(x):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True) ** 2)
            return tape.gradient(loss, model.trainable_variables)
        return step(x)

    expected = two_steps()
    for variable, value in zip(model.variables, before):
        variable.assign(value)
    tc.apply_checkpointing(model, budget="min")
    with pytest.warns(UserWarning, match=r"apply_checkpointing: this graph step has an "
                                         r"input of unknown batch size.*runs the plan made "
                                         r"for inputs of shapes.*and for eager steps.*Fix:"):
        got = two_steps()
    assert plans_made == [("eager", ((4, 8, 8, 3),))]
    assert model.call.plan.regions
    assert_all_close(got, expected, atol=1e-5)


def test_a_plan_given_for_another_mode_warns_once_and_runs_exactly():
    keras.utils.set_random_seed(0)
    model = _net()
    x = _batch(4)
    model(x)
    before = [v.numpy() for v in model.variables]
    step = _train_step(model)
    expected = step(x)
    for variable, value in zip(model.variables, before):
        variable.assign(value)
    plan = tc.plan_model(model, x, budget="min", mode="eager")
    assert plan.regions
    tc.apply_checkpointing(model, plan=plan)
    with pytest.warns(UserWarning, match=r"`plan` was made for eager steps \(mode='eager'\) "
                                         r"and runs in a graph step.*mode='graph'"):
        got = _train_step(model)(x)
    assert_all_close(got, expected, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_step(model)(x)  # once per mode
        tc.apply_checkpointing(model, plan=tc.plan_model(model, x, budget="min", mode="graph"))
        _train_step(model)(x)  # the plan's own mode: no warning


def test_an_unknown_batch_of_larger_inputs_than_planned_is_not_given_a_plan(plans_made):
    """A plan made for smaller images does not serve a None batch of larger ones:
    planning is asked for, and says why it cannot (the batch size is unknown)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((None, None, 3))
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(x)
    h = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(h)
    model = keras.Model(x, keras.layers.GlobalAveragePooling2D()(h))
    tc.apply_checkpointing(model, budget="min")

    @tf.function(input_signature=[tf.TensorSpec([None, 16, 16, 3])])
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    _train_step(model)(_batch(4))  # planned for 8x8 images
    with pytest.raises(ValueError, match=r"needs the full input shape"):
        step(tf.zeros([4, 16, 16, 3]))
