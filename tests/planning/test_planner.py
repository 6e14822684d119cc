"""plan_sequential: the schedule is optimal (against brute force), nests when the budget
demands it, fits its budget on real layers, and recomputes nothing at a large budget."""

import dataclasses
import itertools
import logging
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import Counter, assert_all_close, grads_of

from tf_checkpointing import CheckpointedSequential, checkpoint_sequential
from tf_checkpointing.planning._constants import LEAST_BUDGET_SLACK
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile, LayerProfile
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.plans._plan import Segment, SequentialPlan
from tf_checkpointing.planning.solving import _rotor
from tf_checkpointing.planning.solving._chain_costs import predict_peak
from tf_checkpointing.planning.solving._rotor import _inner, solve
from tf_checkpointing.plans import plan_sequential

MIB = 2**20


def _synthetic(x, kept, seconds, weight=0, plain=None):
    """A profile of layers with inputs of x[i] bytes, keeping kept[i] bytes."""
    layers = tuple(
        LayerProfile(name=f"l{i}", kept_bytes=k, forward_peak_bytes=k + x[i + 1] // 2,
                     untaped_peak_bytes=x[i + 1] + x[i + 1] // 2,
                     backward_peak_bytes=x[i] + weight, weight_grad_bytes=weight,
                     seconds=c)
        for i, (k, c) in enumerate(zip(kept, seconds)))
    profile = ChainProfile(layers=layers, boundary_bytes=tuple(x),
                           boundary_grad_bytes=tuple(x), plain_peak_bytes=0, device="CPU:0")
    plain_peak = predict_peak(profile, (Segment(0, len(kept), False),))
    return ChainProfile(layers=layers, boundary_bytes=tuple(x), boundary_grad_bytes=tuple(x),
                        plain_peak_bytes=plain_peak if plain is None else plain,
                        device="CPU:0")


def _schedules(s, t):
    """Every schedule of layers [s, t): plain layers and nested checkpoints."""
    if s == t:
        yield ()
        return
    for rest in _schedules(s + 1, t):
        yield (Segment(s, s + 1, False),) + rest
    for mid in range(s + 1, t):
        for inner, rest in itertools.product(list(_schedules(s, mid)),
                                             list(_schedules(mid, t))):
            yield (Segment(s, mid, True, _inner(inner)),) + rest


def _work(profile, pieces):
    seconds = [layer.seconds for layer in profile.layers]
    counts = SequentialPlan(tuple(map(str, range(len(seconds)))), pieces).forward_counts
    return sum(c * s for c, s in zip(counts, seconds))


@pytest.mark.parametrize("seed", range(3))
def test_least_work_and_least_memory_match_brute_force(seed, monkeypatch):
    monkeypatch.setattr(_rotor, "_HEADROOM", 0.0)  # the program itself, exactly
    rng = np.random.default_rng(seed)
    n = 6
    x = [int(v) for v in rng.integers(1, 5, n + 1) * 1000]
    kept = [int(v) for v in rng.integers(1, 6, n) * 1000]
    profile = _synthetic(x, kept, rng.uniform(1.0, 3.0, n), weight=100)
    candidates = [(predict_peak(profile, p), _work(profile, p), p) for p in _schedules(0, n)]
    least_memory = min(peak for peak, _, _ in candidates)
    plan = solve(profile, 2**40)
    assert plan.min_budget_bytes == pytest.approx(least_memory, abs=1)
    for budget in np.linspace(least_memory, profile.plain_peak_bytes, 7)[1:-1]:
        plan = solve(profile, int(budget))
        best = min(work for peak, work, _ in candidates if peak <= budget)
        slack = min((work for peak, work, _ in candidates if peak <= 0.98 * budget),
                    default=np.inf)
        assert plan.predicted_peak_bytes <= budget
        assert best - 1e-9 <= _work(profile, plan.pieces) <= slack + 1e-9


def test_checkpoints_nest_as_the_budget_shrinks():
    n = 32
    profile = _synthetic([1000] * (n + 1), [4000] * n, [1.0] * n)
    plans = [solve(profile, int(b)) for b in np.linspace(
        solve(profile, 2**40).min_budget_bytes, profile.plain_peak_bytes, 6)]
    depths = [p.depth for p in plans]
    work = [p.extra_forward_layers for p in plans]
    assert depths[0] >= 3 and depths[-1] == 0, depths
    assert work == sorted(work, reverse=True), work  # more memory, less recomputation
    assert work[-1] == 0
    for plan in plans:
        _assert_contiguous(plan.pieces, 0, n)


def _assert_contiguous(pieces, start, stop):
    assert pieces[0].start == start and pieces[-1].stop == stop
    for a, b in zip(pieces, pieces[1:]):
        assert a.stop == b.start and a.start < a.stop
    for piece in pieces:
        if piece.inner:
            assert piece.checkpointed
            _assert_contiguous(piece.inner, piece.start, piece.stop)


# Real layers ----------------------------------------------------------------------


def _layers(n=16, width=64):
    keras.utils.set_random_seed(0)
    return [keras.layers.Dense(width, activation="relu") for _ in range(n)]


def _measured_peak(layers, x, budget):
    variables = [v for layer in layers for v in layer.trainable_variables]

    def step():
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(checkpoint_sequential(layers, x, budget=budget))
        return tape.gradient(loss, [x] + variables)

    step()  # plans (profiles) outside the measurement
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start


def test_plans_fit_their_budget_on_real_layers():
    layers = _layers()
    x = tf.random.normal([1024, 64])  # activations 256 KiB, kernels 16 KiB
    probe = plan_sequential(layers, x, budget=2**40)
    assert probe.extra_forward_layers == 0
    assert probe.min_budget_bytes < 0.8 * probe.plain_peak_bytes
    for fraction in (0.0, 0.3, 0.7):
        budget = int(probe.min_budget_bytes
                     + fraction * (probe.plain_peak_bytes - probe.min_budget_bytes))
        plan = plan_sequential(layers, x, budget=budget)
        _assert_contiguous(plan.pieces, 0, 16)
        assert plan.predicted_peak_bytes <= budget
        assert plan.extra_forward_layers > 0
        measured = _measured_peak(layers, x, budget)
        assert measured <= 1.15 * budget, (fraction, measured / MIB, budget / MIB)
        assert abs(plan.predicted_peak_bytes - measured) <= 0.25 * measured


def _equal_costs(profile):
    """``profile`` with every layer's forward taking one second."""
    layers = tuple(dataclasses.replace(p, seconds=1.0) for p in profile.layers)
    return dataclasses.replace(profile, layers=layers)


def _gelu_chain(blocks=8):
    """Dense + gelu layers: eager backprop keeps every op of the gelu, a graph few."""
    keras.utils.set_random_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [keras.layers.Dense(256, activation="gelu"), keras.layers.Dense(64),
                   keras.layers.LayerNormalization()]
    return layers


def test_graph_plans_fit_their_budget_in_tf_function_and_recompute_less_than_eager():
    layers = _gelu_chain()
    x = tf.random.normal([512, 64])
    variables = [v for layer in layers for v in layer.trainable_variables]
    graph_probe = plan_sequential(layers, x, budget=2**40, mode="graph")
    eager_probe = plan_sequential(layers, x, budget=2**40, mode="eager")
    assert graph_probe.profile.compiled and not eager_probe.profile.compiled
    # The graph keeps less: its plain step peaks lower (measured ~0.65x).
    assert graph_probe.plain_peak_bytes < 0.8 * eager_probe.plain_peak_bytes
    low, high = graph_probe.min_budget_bytes, graph_probe.plain_peak_bytes
    for fraction in (0.0, 0.4, 0.8):
        budget = int(low + fraction * (high - low))
        plan = plan_sequential(layers, x, budget=budget, mode="graph")
        assert plan.predicted_peak_bytes <= budget
        assert plan.extra_forward_layers > 0

        @tf.function(autograph=False)
        def step(x, budget=budget):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(checkpoint_sequential(layers, x, budget=budget))
            return tape.gradient(loss, [x] + variables)

        step(x)  # traces; plans (mode "auto" while tracing: the graph profile above)
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        step(x)
        measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
        assert measured <= 1.15 * budget, (fraction, measured / MIB, budget / MIB)
        if budget >= eager_probe.min_budget_bytes:
            # The plans minimise measured seconds, so how many layers each recomputes
            # depends on timings (graph 7 vs eager 7 under CPU load); with every layer
            # costing the same, the least recomputation is a count set by bytes alone.
            graph, eager = (solve(_equal_costs(probe.profile), budget)
                            for probe in (graph_probe, eager_probe))
            assert graph.extra_forward_layers < eager.extra_forward_layers, (str(graph),
                                                                             str(eager))


@pytest.mark.parametrize("in_function", [False, True])
def test_auto_mode_plans_for_how_the_step_runs(in_function):
    layers = _layers(4, width=8)
    body = CheckpointedSequential(layers, budget=2**40)
    x = tf.random.normal([16, 8])

    def first_call(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = body(x)
        return tape.gradient(y, x)

    # In a tf.function the layers are built in its trace (outside it, so that the
    # profile can run them) and the plan is made while it is traced.
    grad = (tf.function(first_call) if in_function else first_call)(x)
    assert body.plan.profile.compiled is in_function
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = x
        for layer in layers:
            y = layer(y)
    assert_all_close(grad, tape.gradient(y, x))


def test_unknown_mode_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"argument `mode` must be one of 'auto', 'eager', "
                                         r"'graph', 'xla'; received mode='jit'\. Pass "
                                         r"mode='graph'"):
        plan_sequential(_layers(2, width=4), tf.ones([2, 4]), budget=2**20, mode="jit")


def test_recomputation_follows_the_plan_and_stops_at_a_large_budget():
    layers = [Counter(layer) for layer in _layers(12)]
    x = tf.random.normal([1024, 64])
    probe = plan_sequential(layers, x, budget=2**40)
    for budget, recomputes in ((probe.plain_peak_bytes, False),
                               (probe.min_budget_bytes, True)):
        plan = plan_sequential(layers, x, budget=budget)
        for layer in layers:
            layer.calls = 0
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = checkpoint_sequential(layers, x, budget=budget)
        calls_forward = [layer.calls for layer in layers]
        tape.gradient(y, x)
        counts = [layer.calls for layer in layers]
        assert counts == plan.forward_counts, str(plan)
        assert (max(counts) > 1) is recomputes, str(plan)
        assert calls_forward == [1] * 12  # planned already: no profiling in the step
        if not recomputes:
            assert plan.segments == [(0, 12)] and plan.extra_forward_layers == 0


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_profile_leaves_state_and_the_callers_tape_alone(mode):
    keras.utils.set_random_seed(0)
    dropout = keras.layers.Dropout(0.5, seed=3)
    norm = keras.layers.BatchNormalization()
    layers = [keras.layers.Dense(8), norm, dropout, keras.layers.Dense(8)]
    x = tf.random.normal([16, 8])
    for layer in layers:
        x_built = layer(x)
    del x_built
    before = [v.numpy().copy() for v in norm.non_trainable_variables + [
        dropout.seed_generator.state]]
    with tf.GradientTape() as tape:
        plan_sequential(layers, x, budget=2**40, mode=mode, training=True)
        assert not tape.watched_variables()  # the profile ran on no tape of ours
    after = [v.numpy() for v in norm.non_trainable_variables + [dropout.seed_generator.state]]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)


def test_str_describes_the_schedule():
    n = 12
    profile = _synthetic([1000] * (n + 1), [4000] * n, [1.0] * n)
    plan = solve(profile, solve(profile, 2**40).min_budget_bytes)
    text = str(plan)
    assert text.startswith("SequentialPlan (eager): 12 layers, budget ")
    assert "predicted peak" in text and "extra layer forwards" in text
    assert "[0, " in text and "checkpointed" in text
    assert len(text.splitlines()) >= 1 + len(plan.pieces)


def test_str_names_each_number_for_what_it_is():
    """The least budget is above the least plan's predicted peak (plans keep
    headroom): the summary says so instead of printing the two side by side, and a
    replay of small layers is timed in µs, not "0.0 ms"."""
    from tf_checkpointing.plans import Segment, SequentialPlan

    mib = 2**20
    plan = SequentialPlan(names=("a", "b", "c"), mode="graph", budget_bytes="min",
                          pieces=(Segment(0, 2, True), Segment(2, 3, False)),
                          predicted_peak_bytes=43 * mib, plain_peak_bytes=143 * mib,
                          min_budget_bytes=48 * mib, predicted_extra_seconds=4e-5)
    head = str(plan).splitlines()[0]
    assert head.startswith("SequentialPlan (graph): 3 layers, budget min -> predicted peak "
                           "43.00 MiB (0.30x the plain step's measured 143.00 MiB); least "
                           "budget 48.00 MiB (a plan's predicted peak stays within 90% of "
                           "its budget; up to 5% below it, the least plan); "), head
    assert head.endswith("; predicted replay time 40 µs per step"), head
    slow = dataclasses.replace(plan, predicted_extra_seconds=0.0123)
    assert str(slow).splitlines()[0].endswith("; predicted replay time 12.3 ms per step")
    unmeasured = dataclasses.replace(plan, predicted_extra_seconds=0.0)
    assert str(unmeasured).splitlines()[0].endswith("; replay time not measured")


def test_budget_below_the_minimum_names_the_minimum():
    profile = _synthetic([1000] * 5, [4000] * 4, [1.0] * 4)
    minimum = solve(profile, 2**40).min_budget_bytes
    assert solve(profile, minimum).predicted_peak_bytes <= minimum
    # Below the least by at most the slack (another process may read the least that
    # much higher): the least plan, predicted within the budget.
    within = math.ceil(minimum * (1 - LEAST_BUDGET_SLACK))
    plan = solve(profile, within)
    assert plan.pieces == solve(profile, "min").pieces
    assert plan.predicted_peak_bytes <= within
    with pytest.raises(ValueError, match=rf"expected at least {minimum} bytes.*received "
                                         rf"budget={within - 1} .*Raise the budget"):
        solve(profile, within - 1)


def test_plain_is_the_plan_where_it_fits_with_the_headroom_in_a_graph():
    """An eager (or XLA) step reads the same peak each time: a budget at plain's
    peak is plain. A graph's steps peak where the executor's order puts them:
    plain must fit the budget with the headroom every plan keeps, or the least
    work that does is planned."""
    eager = _synthetic([1000] * 9, [4000] * 8, [1.0] * 8)
    graph = dataclasses.replace(eager, mode=Mode.GRAPH)
    plain = eager.plain_peak_bytes
    assert solve(eager, plain).regions == []
    at_plain = solve(graph, plain)
    assert at_plain.regions and at_plain.predicted_peak_bytes <= 0.9 * plain + 1, str(at_plain)
    assert solve(graph, math.ceil(plain / 0.9)).regions == []


def test_cpu_planning_without_allocator_statistics_says_how_to_enable_them(monkeypatch):
    if tf.config.list_logical_devices("GPU"):
        pytest.skip("plans on the GPU, whose allocator always keeps statistics")
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    layers = [keras.layers.Dense(4) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"CPU memory statistics are off.*"
                                           r"TF_CPU_ALLOCATOR_USE_BFC=true before TensorFlow "
                                           r"is imported.*or use fixed segments.*"
                                           r"checkpoint_sequential\(layers, x, segments=k\)"):
        plan_sequential(layers, tf.ones([2, 4]), budget=10**6)


def test_budget_min_is_the_least_memory_schedule_on_every_chain_api(mode):
    layers = _layers(n=8, width=32)
    x = tf.random.stateless_normal([256, 32], seed=[0, 7])
    probe = plan_sequential(layers, x, budget=2**40)
    least = plan_sequential(layers, x, budget="min")
    assert least.budget_bytes == "min" and "budget min ->" in str(least)
    assert least.extra_forward_layers > 0
    assert least.predicted_peak_bytes < probe.plain_peak_bytes
    # No byte budget gives a lower predicted peak than "min".
    assert least.predicted_peak_bytes <= plan_sequential(
        layers, x, budget=least.min_budget_bytes).predicted_peak_bytes

    variables = [v for layer in layers for v in layer.trainable_variables]
    chained = CheckpointedSequential(layers, budget="min")
    def plain(x):
        for layer in layers:
            x = layer(x)
        return x

    expected = grads_of(plain, [x], variables, mode)
    assert_all_close(grads_of(chained, [x], variables, mode), expected)
    assert chained.plan.budget_bytes == "min"
    assert_all_close(grads_of(lambda x: checkpoint_sequential(layers, x, budget="min"),
                              [x], variables, mode), expected)
    assert CheckpointedSequential.from_config(chained.get_config()).budget == "min"


@pytest.mark.parametrize("budget", ["max", "minimum", b"min"])
def test_a_budget_string_other_than_min_names_the_choices(budget):
    with pytest.raises((TypeError, ValueError), match=r'number of bytes or "min".*budget="min"'):
        CheckpointedSequential(_layers(n=2), budget=budget)


def test_identical_layers_share_one_graph_profile(monkeypatch):
    # A transformer's blocks: the same class, configuration and weight shapes on the
    # same input shapes are traced and measured once; a different layer is not.
    from tf_checkpointing.planning.measuring import _step_profile

    measured = []
    original = _step_profile._graph_layer
    monkeypatch.setattr(_step_profile, "_graph_layer",
                        lambda call, x, y, device, name: measured.append(name) or original(
                            call, x, y, device, name))
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(32, activation="relu", name=f"same{i}") for i in range(5)]
    layers.append(keras.layers.Dense(16, name="other"))
    plan = plan_sequential(layers, tf.random.normal([64, 32]), budget=2**40, mode="graph")
    assert measured == ["same0", "other"], measured
    profiled = plan.profile.layers
    assert [p.name for p in profiled] == [layer.name for layer in layers]
    assert len({(p.kept_bytes, p.backward_peak_bytes) for p in profiled[:5]}) == 1


def test_identical_layers_are_timed_once(monkeypatch):
    # A call that computes what an earlier one does gets its time and untaped peak:
    # it is run for its output, not timed again.
    from tf_checkpointing.planning.measuring import _layer_profile

    timed = []
    original = _layer_profile.forward_seconds
    monkeypatch.setattr(_layer_profile, "forward_seconds",
                        lambda call, x: timed.append(call) or original(call, x))
    layers = [keras.layers.Dense(32, activation="relu", name=f"same{i}") for i in range(5)]
    layers.append(keras.layers.Dense(16, name="other"))
    plan = plan_sequential(layers, tf.random.normal([64, 32]), budget=2**40, mode="graph")
    assert len(timed) == 2, timed
    profiled = plan.profile.layers
    assert len({(p.seconds, p.untaped_peak_bytes) for p in profiled[:5]}) == 1


def test_readings_stop_once_their_median_is_settled(monkeypatch):
    # Runs whose readings agree stop once one reading holds the majority of
    # GRAPH_RUNS (a layer's) or PLAIN_STEPS (the plain step's): more runs could not
    # move the median. An allocator that reads the same in every run stands in for
    # one on a quiet machine (a busy one moves readings by a chunk or two).
    from tf_checkpointing.planning.measuring import _step_profile, _whole_step

    class Steady(_step_profile.Allocator):
        def current(self):
            return 0

        def mark(self):
            super().mark()
            return 0

        def peak_since_mark(self):
            return 0

    asked = []
    original = _step_profile.median_settled
    def counted(values, runs):
        asked.append((len(values), runs))
        return original(values, runs)

    for module in (_step_profile, _whole_step):  # a layer's readings, the whole step's
        monkeypatch.setattr(module, "Allocator", Steady)
        monkeypatch.setattr(module, "median_settled", counted)
    plan_sequential([keras.layers.ReLU()], tf.random.normal([64, 32]), budget=2**40,
                    mode="graph")
    runs_of = {runs: max(n for n, r in asked if r == runs) for _, runs in asked}
    assert runs_of == {_step_profile._GRAPH_RUNS: _step_profile._GRAPH_RUNS // 2 + 1,
                       _whole_step._PLAIN_STEPS: _whole_step._PLAIN_STEPS // 2 + 1}
    assert original([3, 3, 3], 5) and not original([3, 5, 5, 3], 5)


def test_an_xla_profile_measures_no_tf_function_plain_step(monkeypatch):
    # An XLA plan reads the plain step compiled by XLA; the tf.function one, a trace
    # and a few runs of the whole step, would be thrown away.
    from tf_checkpointing.planning.measuring import _step_profile

    compiled = []
    original = _step_profile.graph_plain_step
    monkeypatch.setattr(_step_profile, "graph_plain_step",
                        lambda calls, x, device, jit_compile=False, *args: compiled.append(
                            jit_compile) or original(calls, x, device, jit_compile, *args))
    plan = plan_sequential([keras.layers.Dense(32, activation="relu") for _ in range(3)],
                           tf.random.normal([64, 32]), budget="min", mode="xla")
    assert compiled == [True]
    assert plan.profile.xla and plan.profile.plain_peak_bytes > 0


def test_planning_does_not_warn_of_retracing():
    # The planner traces a new plain step per profile on purpose; TensorFlow
    # counted them as one function's retraces and warned "5 out of the last 9 calls
    # to <function graph_plain_step.<locals>.chain> triggered tf.function retracing".
    layers = [keras.layers.Dense(8, activation="relu") for _ in range(3)]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = tf.get_logger()
    logger.addHandler(handler)
    try:
        for batch in range(2, 10):  # a new profile, and plain step, per batch size
            plan_sequential(layers, tf.ones([batch, 8]), budget="min", mode="graph")
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "retracing" in r.getMessage()]
