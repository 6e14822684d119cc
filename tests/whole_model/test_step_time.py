"""Whole-model plans predict their step time: the plain step measured while
planning, plus the forward seconds their replays run (issue 50; see
docs/decisions/0039-step-time-model.md). The time model must order plans as
their measured steps do, and the prediction must survive a plan file."""

import dataclasses
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import sgd_step

import tf_checkpointing as tc
from tf_checkpointing._graph_runner import model_runner
from tf_checkpointing.planning.layer_graph._blocks import inner_block_choices
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
from tf_checkpointing.planning.solving._planning import Option, Planning
from tf_checkpointing.planning.solving._region_solver import NO_POLICY, Solution
from tf_checkpointing.planning.solving._step_time import block_work, replay_scale

ROUNDS = 7  # interleaved timing rounds; each plan's time is its fastest


def _heavy_and_cheap(seed=0):
    """A wide matrix product (``heavy``, ~0.5 GFLOP a forward) and a ReLU after it
    (``cheap``): replaying the first costs far more than replaying the second,
    more than timing noise on a loaded machine can flip."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((512,))
    h = keras.layers.Dense(2048, name="heavy")(x)
    h = keras.layers.ReLU(name="cheap")(h)
    h = keras.layers.Dense(64, name="down")(h)
    return keras.Model(x, keras.layers.Dense(1, name="head")(h))


def _fastest(steps, x):
    """Each step's least time over interleaved rounds (a slow moment of the
    machine hits every step alike)."""
    for step in steps:
        step(x).numpy()  # traced
    best = [float("inf")] * len(steps)
    for _ in range(ROUNDS):
        for k, step in enumerate(steps):
            started = time.perf_counter()
            step(x).numpy()
            best[k] = min(best[k], time.perf_counter() - started)
    return best


def test_replaying_a_matrix_product_is_predicted_and_measured_slower_than_a_relu():
    """The matrix product's region holds the ReLU too: alone, its replay's
    output is read by no backward (a Dense's gradient reads its input), and the
    graph prunes the whole replay (measured: 26.8 ms against the ReLU's 27.3)."""
    x = tf.random.stateless_normal([512, 512], [0, 1])
    model = _heavy_and_cheap()
    graph = read_graph(model)
    planning = Planning.start(graph, x, None, mode="graph",
                              runner=model_runner(graph), policies=())
    names = [call.name for call in graph.calls]
    plans = {}
    for name, (start, stop) in {"heavy": ("heavy", "cheap"), "cheap": ("cheap", "cheap")}.items():
        span = (names.index(start), names.index(stop) + 1, ())
        option = Option(Solution(0.0, (span,), (NO_POLICY,)))
        plans[name] = planning.plan(option)
    heavy, cheap = plans["heavy"], plans["cheap"]
    assert heavy.plain_step_seconds == cheap.plain_step_seconds > 0
    assert heavy.predicted_step_seconds > cheap.predicted_step_seconds >= cheap.plain_step_seconds
    assert "predicted step" in str(heavy).splitlines()[0]

    steps = []
    for plan in (heavy, cheap):
        twin = _heavy_and_cheap()
        tc.apply_checkpointing(twin, plan=plan)
        steps.append(sgd_step(twin))
    measured_heavy, measured_cheap = _fastest(steps, x)
    assert measured_heavy > measured_cheap, (measured_heavy, measured_cheap)


def test_plan_model_predicts_a_step_no_faster_than_plain():
    keras.utils.set_random_seed(0)
    x = keras.Input((64,))
    h = x
    for _ in range(4):
        h = keras.layers.Add()([h, keras.layers.Dense(64)(keras.layers.Dense(256,
                                                                        activation="gelu")(h))])
    model = keras.Model(x, keras.layers.Dense(1)(h))
    plan = tc.plan_model(model, tf.random.stateless_normal([256, 64], [0, 2]), budget="min",
                         mode="graph")
    assert plan.regions
    assert plan.plain_step_seconds > 0
    assert plan.predicted_step_seconds >= plan.plain_step_seconds
    head = str(plan).splitlines()[0]
    ratio = plan.predicted_step_seconds / plan.plain_step_seconds
    assert "x the plain step's measured" in head and f"{ratio:.2f}x" in head, head


def _plan(**fields):
    return tc.ModelPlan(names=("a", "b", "c"), mode="graph", budget_bytes="min",
                        pieces=tc.ModelPlan.from_config(dict(
                            names=["a", "b", "c"], policies=[],
                            pieces=[[0, 2, True, [], None], [2, 3, False, [], None]])).pieces,
                        predicted_peak_bytes=2**20, plain_peak_bytes=2**22,
                        min_budget_bytes=2**21, **fields)


def test_the_step_time_is_in_the_summary_and_survives_the_config():
    plan = _plan(plain_step_seconds=0.0102, predicted_step_seconds=0.01224,
                 predicted_extra_seconds=0.002)
    head = str(plan).splitlines()[0]
    assert head.endswith("; predicted step 12.2 ms, 1.20x the plain step's measured "
                         "10.2 ms"), head
    slow = dataclasses.replace(plan, plain_step_seconds=1.5, predicted_step_seconds=1.8)
    assert str(slow).splitlines()[0].endswith("predicted step 1.800 s, 1.20x the plain "
                                              "step's measured 1.500 s")
    config = plan.to_config()
    assert config["predicted_step_seconds"] == 0.01224
    assert tc.ModelPlan.from_config(config) == plan


def test_a_plan_file_without_step_times_still_loads():
    config = _plan(plain_step_seconds=0.01, predicted_step_seconds=0.012).to_config()
    del config["plain_step_seconds"], config["predicted_step_seconds"]
    old = tc.ModelPlan.from_config(config)
    assert old.predicted_step_seconds is None and old.plain_step_seconds is None
    assert "predicted step" not in str(old)


@pytest.mark.parametrize("plain, least, replay, scale", [
    (0.10, 0.13, 0.06, 0.5),    # XLA: the least plan's measured replays
    (0.10, None, 0.06, 1.0),    # tf.function: the per-call unit as it is
    (0.10, 0.09, 0.06, 0.1),    # a least plan timed faster than plain: the floor
    (0.10, 0.13, 0.0, 1.0),     # a least plan that replays nothing says nothing
])
def test_the_replay_scale(plain, least, replay, scale):
    assert replay_scale(plain, least, replay) == pytest.approx(scale)


def test_blocks_replay_their_share_of_their_call():
    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(16)

        def call(self, x):
            return x + self.dense(x)

    class Stack(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.blocks = [Block() for _ in range(4)]

        def call(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    x = keras.Input((16,))
    model = keras.Model(x, keras.layers.Dense(1)(Stack()(keras.layers.Dense(16)(x))))
    graph = read_graph(model)
    refs = inner_block_choices(graph)[0]
    cost = np.array([0.5, 2.0, 0.25])
    assert block_work(graph, cost, refs) == pytest.approx(2.0)
    assert block_work(graph, cost, refs[:1]) == pytest.approx(0.5)


def test_the_steps_a_time_model_compares_are_timed_in_rounds():
    # The XLA anchor's plain and least steps: timed one after the other, a change
    # in the machine's load between them landed in their difference, which sets
    # the replay scale (it hit both of its clamps on a loaded machine).
    from tf_checkpointing.planning.measuring._whole_step import interleaved_seconds

    order = []

    def run(name, seconds):
        def step():
            order.append(name)
            time.sleep(seconds)
        return step

    plain, least = interleaved_seconds([run("plain", 0.001), run("least", 0.02)], rounds=3)
    assert order == ["plain", "least"] * 3
    assert 0.001 <= plain < least and least >= 0.02
