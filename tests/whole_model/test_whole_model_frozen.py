"""Whole-model plans of models with frozen layers (fine-tuning a backbone).

A compiled step's backward does not reach a frozen call that reads only the
model's inputs or other frozen calls: it keeps nothing for it. The planner
used to model such calls as backprop would run them: on a MobileNetV2 frozen
under a trainable head it put the plain step at 189 MiB against 32 MiB
measured, and refused every budget below 57 MiB.
"""

import json
import warnings

import keras
import pytest
import tensorflow as tf
from helpers import STEP, assert_all_close, grads_of, partly_frozen, run_script, with_spans

import tf_checkpointing as tc
from tf_checkpointing.planning.layer_graph._frozen import backprop_calls
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph


def test_calls_backprop_reaches():
    model = partly_frozen(frozen_blocks=1, blocks=2)
    graph = read_graph(model)
    reached = dict(zip((c.name for c in graph.calls), backprop_calls(graph)))
    # The frozen stem and block, and the Activation, Dropout and Add reading only
    # them, are outside backprop; the first trainable conv and all after it are in.
    assert [name for name, inside in reached.items() if not inside] == [
        "stem", "conv0", "bn0", "relu0", "drop0", "add0"]
    assert all(backprop_calls(graph, "eager"))  # the eager tape records them all


def _run(model, x, mode):
    loss, grads = grads_of(lambda x: model(x, training=True), [x], model.trainable_variables,
                           mode)
    return loss, grads, [v.numpy() for v in model.variables]


@pytest.mark.filterwarnings("ignore:apply_checkpointing. argument .plan. was made for eager")
@pytest.mark.filterwarnings("ignore:plan_model. .functional. has frozen layers")
def test_regions_over_frozen_layers_equal_plain(mode):
    keras.utils.set_random_seed(0)
    model = partly_frozen(count=True)
    x = tf.random.stateless_normal([4, 8, 8, 3], [0, 1])
    model(x)
    before = [v.numpy() for v in model.variables]
    plain = _run(model, x, mode)
    for variable, value in zip(model.variables, before):
        variable.assign(value)
    plan = tc.plan_model(model, x, budget="min", mode="eager")
    names = list(plan.names)
    # A region of frozen calls only, one from frozen into trainable calls, one of
    # trainable calls only.
    spans = ((0, names.index("add0") + 1, ()),
             (names.index("conv1"), names.index("add2") + 1, ()),
             (names.index("conv3"), names.index("add3") + 1, ()))
    tc.apply_checkpointing(model, plan=with_spans(plan, spans))
    ours = _run(model, x, mode)
    assert_all_close(ours[0], plain[0])
    assert_all_close(ours[1], plain[1], atol=1e-5)
    assert_all_close(ours[2], plain[2], atol=1e-5)
    # The regions with trainable calls were replayed (the frozen-only one need not
    # be: a compiled step's backward does not reach it).
    counts = {i: model.get_layer(f"count{i}").replays for i in range(4)}
    assert counts[1] and counts[2] and counts[3], counts


# One process for the two measured tests of this model: the plain step, then the
# same model with a hand-made region over frozen and trainable layers, then a fresh
# model planned halfway and run right after its plan is made.
FROZEN = STEP + """
from helpers import partly_frozen, plan_of

x = tf.random.normal([16, 32, 32, 3])

def peaks(model):
    step = make_step(model)
    step(x)
    return sorted(tc.debug.measure(lambda: step(x).numpy()).peak_bytes for _ in range(3))

def made():
    keras.utils.set_random_seed(0)
    model = partly_frozen(frozen_blocks=4, blocks=6, width=64, image=32)
    model(x)
    return model

model = made()
plain = peaks(model)
# One region from the input over the stem and the four frozen blocks (calls 0-20)
# into the first trainable block's Conv-BN-ReLU-Dropout (21-24).
names = tuple(layer.name for layer in model.layers[1:])
tc.apply_checkpointing(model, plan=plan_of(names, ((0, 25, ()),)))
region = peaks(model)

model = made()
least = tc.plan_model(model, x, budget="min", mode="graph")
half = (least.min_budget_bytes + least.plain_peak_bytes) // 2
plan = tc.plan_model(model, x, budget=half, mode="graph")
tc.apply_checkpointing(model, plan=plan)
planned = peaks(model)
print("RESULT", json.dumps({"plain": plain[1], "region": region[1],
                            "planned_plain": plan.plain_peak_bytes,
                            "budget": plan.budget_bytes, "largest": planned[-1],
                            "predicted": plan.predicted_peak_bytes, "median": planned[1],
                            "regions": len(plan.regions)}))
"""


@pytest.fixture(scope="module")
def frozen_run():
    """What the FROZEN script measured, in a fresh process."""
    return json.loads(run_script(FROZEN).split("RESULT", 1)[1])


@pytest.mark.slow
def test_a_frozen_backbone_is_planned_as_the_step_runs(frozen_run):
    r = {k: v for k, v in frozen_run.items() if k != "region"}
    message = json.dumps({k: round(v / 2**20, 2) if k != "regions" else v
                          for k, v in r.items()})
    # Before: the frozen blocks' tensors were counted as kept, and the plain step
    # was measured with its input watched: 99.6 MiB against 43 measured, the
    # prediction 57 against 34. (The plain step's peak itself moves by 37-43 MiB
    # between processes, the planner's reading of it by 42-45, and the graph
    # step's 1.1x chunk factor reads high on this model: 1.0-1.23x in four runs;
    # one run in ten read 0.89x, 42.0 against 47.0 MiB.)
    assert -0.15 <= r["planned_plain"] / r["plain"] - 1 <= 0.30, message
    assert r["regions"] > 0 and r["largest"] <= 1.05 * r["budget"], message
    # Below the peak is what breaks a budget: at most 15% there. Above it, up to
    # 35%: the model counts a replayed BatchNorm's backward temporaries all alive
    # at once (the executor does not always run them so), and the 1.1x chunk factor
    # is over on this net, whose chunks hold its tensors within a few percent
    # (predicted 32 MiB against a median of 25 in one run of several, 1.2x on the
    # tensors); the bug above read 1.68x.
    # (A clean CI run read 33.3 predicted against a median of 25.4: 1.31x.)
    assert -0.15 <= r["predicted"] / r["median"] - 1 <= 0.35, message


@pytest.mark.slow
def test_a_region_over_frozen_and_trainable_layers_runs_no_frozen_backward(frozen_run):
    # The replay differentiates every variable its layers read (a frozen layer's
    # kernel is still trainable to TensorFlow) and the model input; the outer
    # backward asks only for the trainable layers' gradients. The variable
    # gradients used to wait for every gradient the replay computed, which ran the
    # frozen layers' backward too and kept their activations: 78-88 MiB against
    # 37-43 plain. They now wait for the replay's reads of variables: 29-36 MiB.
    r = {k: frozen_run[k] for k in ("plain", "region")}
    assert r["region"] < r["plain"], {k: v / 2**20 for k, v in r.items()}


# Under a MirroredStrategy: test_whole_model_keras.test_mirrored_strategy_fit_equals_plain.


def test_an_eager_plan_of_a_model_with_frozen_layers_warns():
    # The eager tape keeps what frozen layers make until the backward ends, which
    # the model does not describe (MobileNetV2, 30 layers frozen: 70 MiB predicted,
    # 149 measured). A tf.function plan is modelled, and warns nothing of it. (Whether
    # a model this small has a plan below plain is the allocator's rounding: a
    # "found no plan" warning comes and goes between runs, and is not this test's.)
    keras.utils.set_random_seed(0)
    model = partly_frozen(frozen_blocks=1, blocks=2)
    x = tf.random.stateless_normal([4, 8, 8, 3], [0, 1])
    with pytest.warns(UserWarning, match=r"frozen layers \(stem, conv0, bn0\).*eager step"):
        tc.plan_model(model, x, budget="min", mode="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*frozen")
        tc.plan_model(model, x, budget="min", mode="graph")
        trained = partly_frozen(frozen_blocks=0, blocks=2)
        trained.layers[1].trainable = True
        tc.plan_model(trained, x, budget="min", mode="eager")
