"""``budget="min"`` is never above the selection a user would write,
``apply_checkpointing(model, [Block])``: where a model repeats a block of its
own, the least plan and the per-block plan are both measured, and the lower
one is the plan (on keras_hub's GPT2Backbone the model's least plan measured
61 MiB, the per-block selection 53)."""

import keras
import pytest
import tensorflow as tf
from helpers import conv_bn_net

import tf_checkpointing as tc
from tf_checkpointing._graph_runner import model_runner
from tf_checkpointing.planning.layer_graph._blocks import (
    block_spans,
    named_block_spans,
    plain_filters_replayed,
    segment_spans,
)
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
from tf_checkpointing.planning.measuring._whole_step import StepReading
from tf_checkpointing.planning.solving import _planning
from tf_checkpointing.planning.solving._region_solver import NO_POLICY, Solution


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(8)

    def call(self, x):
        return x + self.out(self.inner(x))


def _model_of_blocks():
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = keras.layers.Dense(8, name="stem")(x)
    for k in range(3):
        h = Block(name=f"block{k}")(h)
    return keras.Model(x, keras.layers.Dense(1, name="head")(h))


def test_block_spans_are_the_calls_of_the_repeated_block():
    model = _model_of_blocks()
    plan = tc.ModelPlan.from_regions(model, [["stem"]])
    names = list(plan.names)
    spans = block_spans(read_graph(model))
    assert [names[a] for a, _, _ in spans] == ["block0", "block1", "block2"]


@pytest.mark.parametrize("blocks_lower", [True, False])
def test_the_least_plan_is_the_lower_measured_of_itself_and_the_blocks(monkeypatch, blocks_lower):
    model = _model_of_blocks()
    x = tf.random.stateless_normal([64, 8], [0, 1])
    measured = {}

    def fake_measure(graph, inputs, runner, spans, region_policies=(), mode="xla"):
        is_blocks = spans == block_spans(graph)
        measured[is_blocks] = spans
        return StepReading(100 if is_blocks == blocks_lower else 200, 0.01)

    monkeypatch.setattr(_planning, "measure_plan", fake_measure)
    plan = tc.plan_model(model, x, budget="min", mode="graph")
    assert set(measured) == {True, False}  # both measured
    blocks = [["block0"], ["block1"], ["block2"]]
    assert (plan.regions == blocks) == blocks_lower, plan.regions
    assert plan.predicted_peak_bytes == 100  # the measured peak of the plan chosen


def test_an_eager_least_plan_measures_nothing(monkeypatch):
    monkeypatch.setattr(_planning, "measure_plan", lambda *a, **k: pytest.fail("measured"))
    tc.plan_model(_model_of_blocks(), tf.ones([4, 8]), budget="min", mode="eager")


def _model_of_named_blocks():
    """Residual blocks whose layers share a numbered name prefix, joined by
    `Add` layers that Keras names otherwise (as in ConvNeXt)."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,))
    h = keras.layers.Dense(8, name="stem")(x)
    for k in range(3):
        y = keras.layers.Dense(16, activation="relu", name=f"stage_block{k}_in")(h)
        y = keras.layers.Dense(8, name=f"stage_block{k}_out")(y)
        h = keras.layers.Add(name=f"add_{k}")([h, y])
    return keras.Model(x, keras.layers.Dense(1, name="head")(h))


def test_named_block_spans_are_the_blocks_a_user_selects_by_name_prefix():
    graph = read_graph(_model_of_named_blocks())
    names = [call.name for call in graph.calls]
    spans = named_block_spans(graph)
    assert [names[a:b] for a, b, _ in spans] == [
        [f"stage_block{k}_in", f"stage_block{k}_out"] for k in range(3)]
    assert spans != segment_spans(graph)  # the adds are left out


def test_the_least_plan_is_the_named_blocks_where_they_measure_lowest(monkeypatch):
    model = _model_of_named_blocks()
    measured = []

    def fake_measure(graph, inputs, runner, spans, region_policies=(), mode="xla"):
        measured.append(spans)
        return StepReading(100 if spans == named_block_spans(graph) else 200,
                           0.01)

    monkeypatch.setattr(_planning, "measure_plan", fake_measure)
    monkeypatch.setattr(_planning, "_SELECTION_MARGIN", 1e9)  # measured whatever predicted
    plan = tc.plan_model(model, tf.random.stateless_normal([64, 8], [0, 1]), budget="min",
                         mode="graph")
    assert len(measured) == len(set(measured)) >= 2  # each candidate measured once
    assert plan.regions == [[f"stage_block{k}_in", f"stage_block{k}_out"] for k in range(3)]
    assert plan.predicted_peak_bytes == 100


@pytest.mark.parametrize("margin", [1e9, 0.0])
def test_a_selection_is_measured_only_where_its_prediction_leaves_it_a_chance(monkeypatch,
                                                                             margin):
    measured = []

    def fake_measure(graph, inputs, runner, spans, region_policies=(), mode="xla"):
        measured.append(spans)
        return StepReading(200, 0.01)

    monkeypatch.setattr(_planning, "measure_plan", fake_measure)
    monkeypatch.setattr(_planning, "_SELECTION_MARGIN", margin)
    tc.plan_model(_model_of_named_blocks(), tf.random.stateless_normal([64, 8], [0, 1]),
                  budget="min", mode="graph")
    graph = read_graph(_model_of_named_blocks())
    selections = {named_block_spans(graph), segment_spans(graph)}
    assert set(measured) & selections == (selections if margin > 1 else set())


def test_an_xla_least_plan_is_also_measured_with_its_plain_filters_replayed():
    """Under XLA the least plan's plain pieces that hold a filter would save
    everything; the plan with them replayed in full is one more candidate, its
    own regions under their policies, the new ones fully replayed."""
    model = conv_bn_net(blocks=4, channels=3, dense_head=True)  # the head holds no filter
    graph = read_graph(model)
    names = [call.name for call in graph.calls]
    planning = _planning.Planning.start(graph, tf.random.stateless_normal([8, 8, 8, 3], [0, 1]),
                                        None, mode="xla", runner=model_runner(graph),
                                        policies=())
    bn1, relu3 = names.index("bn1"), names.index("relu3")
    planning.least = Solution(1.0, ((bn1, relu3 + 1, ()),), (0,))  # conv0 and the head plain
    replayed = plain_filters_replayed(graph, planning.least.spans)
    assert replayed == ((0, bn1, ()), (bn1, relu3 + 1, ()))  # not the head: no filter
    options = [o.solution for o in planning.selections()]
    assert [(o.spans, o.policies) for o in options if o.spans == replayed] == [
        (replayed, (NO_POLICY, 0))]
    # Where no stretch that holds a filter is plain, nothing more to measure.
    planning.least = Solution(1.0, replayed, (NO_POLICY, 0))
    assert all(o.solution.spans != replayed for o in planning.selections())
