"""Chain plans (``CheckpointedSequential(budget=)``) of layers with a frozen prefix.

A compiled step asks for the trainable variables' gradients only: when no tape
differentiates the chain's input, the leading layers without trainable weights
are on no path to them, and keep nothing. The chain planner used to profile
them as trained: with 4 of 8 convolution blocks frozen it read the plain step
as 272 MiB against 152 measured, and its least plan replayed the frozen
blocks too.
"""

import json

import keras
import pytest
import tensorflow as tf
from conftest import compile_step
from helpers import STEP, Replays, assert_all_close, run_script

import tf_checkpointing as tc
from tf_checkpointing.planning.layer_graph._frozen import backprop_calls, frozen_prefix
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
from tf_checkpointing.planning.solving import _chain


def frozen_blocks(frozen=2, blocks=4, width=8):
    """Blocks of convolution, BatchNorm, relu and dropout (each counting its
    replays); the first ``frozen`` are frozen."""
    layers = [keras.Sequential([
        keras.layers.Conv2D(width, 3, padding="same"), keras.layers.BatchNormalization(),
        keras.layers.Activation("relu"), keras.layers.Dropout(0.3), Replays(name=f"count{i}"),
    ], name=f"block{i}") for i in range(blocks)]
    for layer in layers[:frozen]:
        layer.trainable = False
    return layers


def model_of(body, width=8, image=16, stem=False):
    """``body`` between an image input (through a trainable convolution with
    ``stem``) and a dense head."""
    x = keras.Input((image, image, width))
    h = keras.layers.Conv2D(width, 3, padding="same", name="stem")(x) if stem else x
    out = keras.layers.Dense(2, name="head")(keras.layers.GlobalAveragePooling2D()(body(h)))
    return keras.Model(x, out)


def fit_step(model, x, mode):
    """Loss and trainable variables' gradients, the input not watched (as ``fit``)."""

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True) ** 2)
        return loss, tape.gradient(loss, model.trainable_variables)

    return compile_step(step, mode)(x)


def test_frozen_prefix_is_the_leading_layers_without_trainable_weights():
    layers = frozen_blocks(frozen=2, blocks=3)
    for layer in layers:
        layer.build((None, 8, 8, 8))
    assert frozen_prefix(layers, input_grad=False, mode="graph") == 2
    assert frozen_prefix(layers, input_grad=True, mode="graph") == 0
    assert frozen_prefix(layers, input_grad=False, mode="eager") == 0  # the tape keeps all
    # A function may read variables the planner cannot see: it counts as reached.
    assert frozen_prefix([tf.nn.relu] + layers, input_grad=False, mode="graph") == 0


def test_fresh_layers_are_planned_as_trained():
    # Layers not built yet have no weights to show: they were taken as frozen, and
    # checkpoint_sequential(budget=) on fresh layers in a tf.function ran all plainly.
    layers = [keras.layers.Dense(64, activation="relu") for _ in range(6)]
    assert frozen_prefix(layers, input_grad=False, mode="graph") == 0
    x = tf.random.stateless_normal([256, 64], [0, 1])
    variables = []

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            y = tc.checkpoint_sequential(layers, x, budget="min")
            loss = tf.reduce_sum(y ** 2)
        variables[:] = [v for layer in layers for v in layer.trainable_variables]
        return tape.gradient(loss, variables)

    step(x)
    (_, profile, _, plans), = _chain._profiles.values()  # the plan of the call
    (plan,) = plans.values()
    assert profile.frozen_prefix == 0 and any(p.checkpointed for p in plan.pieces), str(plan)


class BuildsItsDense(keras.layers.Layer):
    """Creates its sublayer in ``build``, as keras_hub's TransformerEncoder does."""

    def build(self, shape):
        self.dense = keras.layers.Dense(shape[-1])
        self.dense.build(shape)

    def call(self, x):
        return self.dense(x)


def test_a_layer_frozen_before_its_build_trains_and_is_reached():
    # Keras leaves the sublayers it builds afterwards trainable: fit trains them
    # (model.trainable_variables lists them) while its trainable_weights is empty.
    # Taken as frozen, a keras_hub encoder stack was read at 71 MiB plain against
    # 137 measured, and its plan peaked at 100 MiB against 29 predicted.
    block = BuildsItsDense()
    block.trainable = False
    x = keras.Input((8,))
    model = keras.Model(x, keras.layers.Dense(1)(block(x)))
    assert len(model.trainable_variables) == 4 and not block.trainable_weights
    assert frozen_prefix([block], input_grad=False, mode="graph") == 0
    assert all(backprop_calls(read_graph(model)))


def test_frozen_prefix_runs_plainly_and_gradients_equal_plain(mode):
    keras.utils.set_random_seed(0)
    layers = frozen_blocks()
    chain = tc.CheckpointedSequential(layers, budget="min")
    model, plain = model_of(chain), model_of(keras.Sequential(layers))
    x = tf.random.stateless_normal([4, 16, 16, 8], [0, 1])
    model(x)
    plain.get_layer("head").set_weights(model.get_layer("head").get_weights())
    before = [v.numpy() for v in model.variables]
    expected = fit_step(plain, x, mode), [v.numpy() for v in plain.variables]
    for variable, value in zip(model.variables, before):
        variable.assign(value)
    for i in range(4):
        layers[i].get_layer(f"count{i}").replays = 0
    got = fit_step(model, x, mode), [v.numpy() for v in model.variables]
    assert_all_close(got[0][0], expected[0][0])
    assert_all_close(got[0][1], expected[0][1], atol=1e-5)
    assert_all_close(got[1], expected[1], atol=1e-5)  # BatchNorm statistics, seeds
    replays = [layers[i].get_layer(f"count{i}").replays for i in range(4)]
    plan = chain.plan
    if mode == "eager":  # the eager tape keeps what frozen layers make: all reached
        assert plan.profile.frozen_prefix == 0
        return
    assert plan.profile.frozen_prefix == 2, str(plan)
    assert all(not piece.checkpointed for piece in plan.pieces if piece.start < 2), str(plan)
    assert replays[:2] == [0, 0] and any(replays[2:]), (replays, str(plan))


def test_a_differentiated_input_plans_every_layer():
    # Behind a trainable convolution the chain's input gets a gradient, so the
    # frozen blocks' backward runs and is planned.
    keras.utils.set_random_seed(0)
    chain = tc.CheckpointedSequential(frozen_blocks(), budget="min")
    model = model_of(chain, stem=True)
    x = tf.random.stateless_normal([4, 16, 16, 8], [0, 1])
    fit_step(model, x, "graph")
    assert chain.plan.profile.frozen_prefix == 0, str(chain.plan)


def test_unfreezing_plans_the_chain_anew():
    keras.utils.set_random_seed(0)
    layers = frozen_blocks()
    chain = tc.CheckpointedSequential(layers, budget="min")
    model = model_of(chain)
    x = tf.random.stateless_normal([4, 16, 16, 8], [0, 1])
    fit_step(model, x, "graph")
    frozen_plan = chain.plan
    for layer in layers:
        layer.trainable = True
    fit_step(model, x, "graph")
    assert frozen_plan.profile.frozen_prefix == 2
    assert chain.plan.profile.frozen_prefix == 0, str(chain.plan)
    for layer in layers[:2]:
        layer.trainable = False
    fit_step(model, x, "graph")
    assert chain.plan is frozen_plan  # the plan made for these frozen layers


CHAIN = STEP + """
import sys
sys.path.insert(0, "tests/planning")  # the scripts run from the repository's root
from test_chain_frozen import frozen_blocks, model_of

x = tf.random.normal([16, 64, 64, 32])
keras.utils.set_random_seed(0)
# The planned chains share their layers: the halfway plan reuses the least plan's
# profile (a chain is profiled once per layers, shapes and mode), as a second budget
# of a user's chain does. Each plan runs right after it is made.
chain = frozen_blocks(frozen=4, blocks=8, width=32)

def measured(budget):
    keras.utils.set_random_seed(0)
    layers = frozen_blocks(frozen=4, blocks=8, width=32) if budget is None else chain
    body = keras.Sequential(layers) if budget is None else tc.CheckpointedSequential(
        layers, budget=budget)
    model = model_of(body, width=32, image=64)
    step = make_step(model)
    step(x)
    peaks = sorted(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(3))
    return peaks, getattr(body, "plan", None)

plain, _ = measured(None)
least, plan = measured("min")
budget = (plan.min_budget_bytes + plan.plain_peak_bytes) // 2
half, half_plan = measured(budget)
print("RESULT", json.dumps({
    "plain": plain[1], "planned_plain": plan.plain_peak_bytes,
    "least": least[1], "least_predicted": plan.predicted_peak_bytes,
    "budget": budget, "half_largest": half[-1], "half": half[1],
    "half_predicted": half_plan.predicted_peak_bytes,
    "replayed_frozen": sum(p.stop - p.start for p in plan.pieces
                           if p.checkpointed and p.start < 4)}))
"""


@pytest.mark.slow
def test_a_frozen_prefix_is_planned_as_the_step_runs():
    r = json.loads(run_script(CHAIN).split("RESULT", 1)[1])
    message = json.dumps({k: round(v / 2**20, 2) if k != "replayed_frozen" else v
                          for k, v in r.items()})
    # Before: plain read 1.8x its measured peak (272 MiB against 152 at batch 16
    # in another run), and the least plan replayed all four frozen blocks. The
    # reading is one run of the plain graph (1.06-1.11x here in three runs), and
    # the least plan's allocator chunks the chain planner does not model (its
    # prediction was 0.88-0.94x).
    assert abs(r["planned_plain"] / r["plain"] - 1) <= 0.20, message
    assert r["replayed_frozen"] == 0, message
    assert abs(r["least_predicted"] / r["least"] - 1) <= 0.20, message
    assert r["half_largest"] <= 1.05 * r["budget"], message
    assert abs(r["half_predicted"] / r["half"] - 1) <= 0.15, message
