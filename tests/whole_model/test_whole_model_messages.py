"""What the whole-model APIs say when they cannot plan, and that the fixes they
name work: only arguments the raising API has, and, for an unknown batch size
(Model.fit with a partial last batch), fixes that actually train."""

import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_checkpointing as tc
from tf_checkpointing.planning._constants import LEAST_BUDGET_SLACK


def _mlp():
    keras.utils.set_random_seed(0)
    x = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu", name="d1")(x)
    return keras.Model(x, keras.layers.Dense(2, name="d2")(h))


def _data(n=10):
    rng = np.random.default_rng(0)
    return rng.random((n, 4), np.float32), rng.random((n, 2), np.float32)


def test_a_step_of_unknown_batch_size_names_fixes_that_work():
    """A training step of one's own traced with a None batch dimension (an
    input_signature): nothing says how large its batches are, so no plan can be
    made (Model.fit says it itself: tests/whole_model/test_fit_batches.py)."""
    model = _mlp()
    tc.apply_checkpointing(model, budget="min")

    @tf.function(input_signature=[tf.TensorSpec([None, 4])])
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    with pytest.raises(ValueError) as caught:
        step(tf.ones([4, 4]))
    message = str(caught.value)
    assert "apply_checkpointing: planning for a memory budget needs the full input shape" \
        in message
    assert "tf_checkpointing.plan_model(model, x[:batch_size]" in message
    assert "mode='graph'" in message and "apply_checkpointing(model, plan=plan)" in message
    assert "drop_remainder=True" in message
    # Neither an argument apply_checkpointing lacks, nor the eager-call advice
    # (an eager call plans nothing, so the step failed the same way after it).
    assert "segments" not in message and "eagerly" not in message


def test_a_plan_made_ahead_trains_with_a_partial_last_batch():
    x, y = _data()
    model = _mlp()
    plan = tc.plan_model(model, x[:4], budget="min", mode="graph")  # the fix named above
    tc.apply_checkpointing(model, plan=plan)
    model.compile("sgd", "mse")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history["loss"]
    assert all(np.isfinite(history))
    # ... and with a tf.data dataset whose last batch is partial
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), epochs=1, verbose=0,
              shuffle=False)
    assert model.call.plan is plan  # never planned again


def test_a_budget_runs_the_plan_made_ahead_for_it_where_the_batch_is_unknown():
    """keras_hub's task models (GPT2CausalLM) trace ``fit`` with an unknown batch
    size from the first step: a plan_model made on one batch, for the same budget,
    is what apply_checkpointing(budget=...) runs there, with no warning."""
    x, y = _data()
    model = _mlp()
    plan = tc.plan_model(model, x[:4], budget="min", mode="graph")
    tc.apply_checkpointing(model, budget="min")
    model.compile("sgd", "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)  # (None, 4) batches
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(dataset, epochs=1, verbose=0, shuffle=False)
    assert model.call.plan is plan
    # Another budget is another plan: it is not run; fit's batch size is planned for.
    other = _mlp()
    ahead = tc.plan_model(other, x[:4], budget=10**9, mode="graph")
    tc.apply_checkpointing(other, budget="min")
    other.compile("sgd", "mse")
    other.fit(dataset, epochs=1, verbose=0, shuffle=False)
    assert other.call.plan is not ahead and other.call.plan.budget_bytes == "min"


def test_clear_caches_forgets_the_plans_made_ahead():
    """Plans plan_model made ahead are planning state like the profiles: one
    clear_caches() empties them, so a test (or a user) starts from nothing."""
    from tf_checkpointing.planning import clear_caches
    from tf_checkpointing.planning.plans._reuse import made_ahead

    x, _ = _data()
    model = _mlp()
    ahead = tc.plan_model(model, x[:4], budget="min", mode="graph")
    assert [plan for _, _, plan in made_ahead(model, "min", ())] == [ahead]
    clear_caches()
    assert made_ahead(model, "min", ()) == []
    tc.apply_checkpointing(model, budget="min")
    model.call.maker.plans.adopt(made_ahead(model, "min", ()))
    assert model.call.maker.plans.plans("graph") == []


def test_a_budget_below_the_least_is_a_typed_error_worded_by_the_api_called():
    """Planning raises BudgetTooLow with the numbers, without naming a public
    function; plan_model and apply_checkpointing put their own name in front."""
    from tf_checkpointing.planning._errors import BudgetTooLow

    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    h = x
    for _ in range(4):
        h = keras.layers.Dense(256, activation="relu")(h)
    model = keras.Model(x, keras.layers.Dense(1)(h))
    batch = tf.random.normal([64, 64])
    plan = tc.plan_model(model, batch, budget="min", mode="eager")
    least = plan.min_budget_bytes
    # Refused below the slack that another process's reading of the least may need.
    refused = math.ceil(least * (1 - LEAST_BUDGET_SLACK)) - 1
    with pytest.raises(BudgetTooLow, match=r"^plan_model: argument `budget` is below the "
                                           rf"least memory.*expected at least {least} "
                       ) as caught:
        tc.plan_model(model, batch, budget=refused, mode="eager")
    assert (caught.value.budget, caught.value.least) == (refused, least)
    # Within it, the least plan.
    within = tc.plan_model(model, batch, budget=refused + 1, mode="eager")
    assert within.pieces == plan.pieces and within.budget_bytes == refused + 1
    assert within.predicted_peak_bytes <= refused + 1, str(within)
    # Planned ahead, the budget is refused at once (see the test below); forgotten,
    # it is planned, and refused, in the first training call. Planned again, an
    # eager step's least can read a few bytes lower (the allocator's state differs),
    # so this budget is well below it.
    from tf_checkpointing.planning import clear_caches

    clear_caches()
    tc.apply_checkpointing(model, budget=least // 2)
    # (Keras puts "Exception encountered when calling ..." before it, keeping the type.)
    with pytest.raises(BudgetTooLow, match=r"apply_checkpointing: argument `budget` is "
                                           r"below.*Raise the budget"):
        with tf.GradientTape():
            model(batch, training=True)


def test_a_budget_below_what_plan_model_found_is_refused_by_apply_checkpointing():
    """Where plan_model has found the least for the model, apply_checkpointing
    refuses a budget below it at once, naming the mode and the inputs, and leaves
    the model as it was; in the mode the compiled step runs (and only there)."""
    x, y = _data(8)
    model = _mlp()
    least = tc.plan_model(model, x, budget="min", mode="graph").min_budget_bytes
    refused = math.ceil(least * (1 - LEAST_BUDGET_SLACK)) - 1
    with pytest.raises(ValueError, match=r"^apply_checkpointing: argument `budget` is below "
                       r"the least memory any plan of `functional.*` needs in graph steps, as "
                       rf"plan_model found it on inputs of shape \(8, 4\): expected at least "
                       rf"{least} bytes .* received budget={refused} .*Fix: pass "
                       rf"budget={least} or more"):
        tc.apply_checkpointing(model, budget=refused)
    assert "call" not in vars(model)  # not installed: the model runs as it did
    model.compile("sgd", "mse", jit_compile=True)  # an XLA step: nothing known for it
    tc.apply_checkpointing(model, budget=refused)
    model.compile("sgd", "mse", jit_compile=False)  # a graph step: refused
    with pytest.raises(ValueError, match="needs in graph steps"):
        tc.apply_checkpointing(model, budget=refused)
    # Within the slack below the least (another process may read the least that much
    # higher), accepted: the least plan.
    tc.apply_checkpointing(model, budget=refused + 1)
    assert np.isfinite(model.train_on_batch(x, y))


def test_plan_model_on_a_symbolic_input_says_pass_a_concrete_batch():
    with pytest.raises(ValueError, match=r"plan_model: .*full input shape.*Fix: pass a "
                                         r"concrete batch") as caught:
        tc.plan_model(_mlp(), keras.Input((4,)), budget="min")
    assert "segments" not in str(caught.value)


@pytest.mark.parametrize("budget", [0, -5, float("nan")])
def test_a_bad_budget_suggests_only_arguments_of_the_api(budget):
    with pytest.raises(ValueError, match=r"positive, finite.*budget=\"min\".*select=") as c:
        tc.apply_checkpointing(_mlp(), budget=budget)
    assert "segments" not in str(c.value)
    with pytest.raises(ValueError, match=r"plan_model: .*positive, finite") as c:
        tc.plan_model(_mlp(), tf.ones([2, 4]), budget=budget)
    assert "segments" not in str(c.value) and "select" not in str(c.value)
    with pytest.raises(ValueError, match=r"checkpoint_sequential: .*segments=k"):
        tc.checkpoint_sequential([keras.layers.Dense(2)], tf.ones([2, 4]), budget=budget)


def test_a_fractional_budget_is_refused_when_given_with_how_to_get_bytes():
    """budget=0.5 meant "half of plain"; it was truncated to 0 bytes and failed
    inside the first training step, naming budget=0."""
    model = _mlp()
    with pytest.raises(ValueError, match=r"apply_checkpointing: .*bytes, not a fraction"
                                         r".*received budget=0\.5.*plan_model\(model, x"
                                         r".*int\(0\.5 \* plan\.plain_peak_bytes\)"):
        tc.apply_checkpointing(model, budget=0.5)
    assert "call" not in vars(model)  # nothing installed
    with pytest.raises(ValueError, match=r"CheckpointedSequential: .*not a fraction.*"
                                         r"plan_sequential\(layers, x"):
        tc.CheckpointedSequential([keras.layers.Dense(2)], budget=0.25)


@pytest.mark.parametrize("budget", [1, 2.5, 1000])
def test_a_budget_of_a_few_bytes_is_refused_with_the_units(budget):
    with pytest.raises(ValueError, match=r"apply_checkpointing: .*number of bytes; received "
                                         rf"budget={budget}, less than 1024 bytes.*"
                                         rf"budget={budget} \* 2\*\*20 for {budget} MiB"):
        tc.apply_checkpointing(_mlp(), budget=budget)
    with pytest.raises(ValueError, match=r"CheckpointedSequential: .*less than 1024 bytes"):
        tc.CheckpointedSequential([keras.layers.Dense(2)], budget=budget)


def test_a_model_with_no_layer_calls_is_a_clear_error():
    i = keras.Input((4,))
    identity = keras.Model(i, i, name="identity")
    with pytest.raises(ValueError, match=r"plan_model: `identity` has no layer calls.*"
                                         r"nothing to checkpoint"):
        tc.plan_model(identity, tf.ones([2, 4]), budget="min", mode="eager")
    # Refused when the model is given, not inside its first training step.
    with pytest.raises(ValueError, match=r"apply_checkpointing: `identity` has no layer "
                                         r"calls"):
        tc.apply_checkpointing(identity, budget="min")


def test_min_passed_as_select_suggests_the_budget():
    with pytest.raises(ValueError, match=r"do not exist: \['min'\].*did you mean "
                                         r"budget='min'\?.*apply_checkpointing\(model, "
                                         r"budget='min'\)"):
        tc.apply_checkpointing(_mlp(), "min")


def test_plan_model_refuses_inputs_that_are_not_the_models():
    """Keras only warns when a one-input model gets a list: the plan would be made
    for a call that then fails."""
    x = keras.Input((8,))
    model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Dense(8)(x)))
    batch = tf.ones([4, 8])
    with pytest.raises(ValueError, match=r"plan_model: argument `inputs` must be a batch of "
                                         r".*1 tensor\(s\) of shapes \[\(None, 8\)\]; "
                                         r"received 2 of shapes \[\(4, 8\), \(4, 8\)\]"):
        tc.plan_model(model, [batch, batch], budget="min")


def test_a_numpy_batch_and_the_steps_tensor_share_one_profile():
    """plan_model(model, numpy_batch) and the training step (which traces a tensor
    of that shape) key the profile alike, so the step reuses it, and enforces the
    least plan_model reported, instead of measuring the model again."""
    from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
    from tf_checkpointing.planning.solving._model_profile import profile_key

    x, _ = _data(8)
    graph = read_graph(_mlp())
    assert profile_key(graph, x, "graph") == profile_key(graph, tf.constant(x), "graph")
    assert profile_key(graph, x, "graph") != profile_key(graph, x.astype("float64"), "graph")
