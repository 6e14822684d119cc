"""The region program's memory model on hand-made costs (no TensorFlow run).

A chain of four calls, each keeping 10 units for its backward and passing a
1-unit tensor to the next: the plain call right after a checkpointed region
is still held while the region replays (the executor computes that call's
input gradient before its weight gradients), so the model counts it there.
"""

import dataclasses

import numpy as np
import pytest

from tf_checkpointing.planning._constants import CHUNKS as _CHUNKS
from tf_checkpointing.planning.solving._planning import chunk_factor
from tf_checkpointing.planning.solving._region_solver import solve
from tf_checkpointing.planning.solving._regions import GraphCosts, RegionModel


def _chain_costs(n=4, kept=10.0):
    # tensor t: made by call t - 1 (t = 0: the model input), read by call t.
    return GraphCosts(
        kept=np.full(n, kept), fwd=np.full(n, kept), fwd0=np.full(n, 1.0),
        bwd=np.zeros(n), wgrad=np.zeros(n), cost=np.ones(n), dx=np.ones(n + 1),
        size=np.ones(n + 1), producer=np.arange(-1, n), last=np.arange(0, n + 1),
        readers=[[t] if t < n else [] for t in range(n + 1)],
        floating=np.ones(n + 1, bool))


def test_the_plain_call_after_a_region_counts_during_its_replay():
    model = RegionModel(_chain_costs())
    # Region [0, 2) then plain calls 2 and 3: the replay of [0, 2) needs its two
    # calls' 20 units (+ its input copy and gradient), and call 2's 10 are still held.
    followed = model.peak(((0, 2, ()),))
    region_alone = model.need(0, 2, True)
    assert followed >= region_alone + 10.0
    # Followed by another region instead, nothing plain is held during it.
    assert model.peak(((0, 2, ()), (2, 4, ()))) < followed


def test_the_program_plans_with_it():
    model = RegionModel(_chain_costs())
    found = solve(model, None)
    assert found is not None
    peak, spans, _ = found
    assert np.isclose(peak, model.peak(spans), rtol=0.02)  # agree, up to its units
    limit = model.peak(((0, 2, ()), (2, 4, ())))
    work, spans, _ = solve(model, limit)
    assert model.peak(spans) <= limit


def _skip_costs(savers):
    # Calls: 0 makes the skip s (10 units), 1 pools it (its backward reads s),
    # 2 works on the pooled p, 3 concatenates s and 2's output (its backward
    # reads neither), 4 is the head. Tensors: the input, s, p, m, c, the output.
    n = 5
    return GraphCosts(
        kept=np.array([10.0, 1, 1, 3, 1]), fwd=np.array([10.0, 1, 1, 3, 1]),
        fwd0=np.array([10.0, 1, 1, 3, 1]), bwd=np.zeros(n), wgrad=np.zeros(n),
        cost=np.ones(n), dx=np.ones(n + 1), size=np.array([1.0, 10, 1, 1, 3, 1]),
        producer=np.arange(-1, n), last=np.array([0, 3, 2, 3, 4, 5]),
        readers=[[0], [1, 3], [2], [3], [4], []], floating=np.ones(n + 1, bool),
        savers=savers)


def test_a_skip_no_later_backward_reads_is_not_held_by_its_region():
    # Region [0, 2) makes s and pools it inside; after it only the concatenation
    # reads s, whose backward does not: s is free once the forward read it.
    model = RegionModel(_skip_costs([[0], [1], [2], [], [4], [5]]))
    assert model.held(0, 2, True) == 1.0  # p only
    # Cut between s and the pooling: a later backward (the pooling's) reads s.
    assert model.held(0, 1, True) == 10.0
    # A region that reads s after its last saver keeps it as its input.
    assert model.held(3, 5, True) >= 10.0 and model.need(3, 5, True) >= 10.0
    # Without knowing which backward reads what, s is held by the region making it.
    assert RegionModel(_skip_costs(None)).held(0, 2, True) == 11.0


def test_the_least_plan_cuts_after_the_last_backward_reading_the_skip():
    model = RegionModel(_skip_costs([[0], [1], [2], [], [4], [5]]))
    peak, spans, _ = solve(model, None)
    assert model.peak(((0, 2, ()),)) < model.peak(((0, 1, ()), (1, 3, ())))
    assert peak < RegionModel(_skip_costs(None)).peak(spans)


def _block_costs(savers):
    # A residual block: call 0 makes x (10 units), calls 1 (branch conv) and 2
    # (branch BatchNorm, whose output no backward reads) form the main branch, 3
    # is the shortcut conv beside them, 4 adds. Tensors: input, x, h1, h2, s, y.
    n = 5
    return GraphCosts(
        kept=np.array([10.0, 4, 4, 4, 1]), fwd=np.array([10.0, 4, 4, 4, 1]),
        fwd0=np.array([10.0, 4, 4, 4, 1]), bwd=np.array([0.0, 1, 8, 3, 0]),
        wgrad=np.zeros(n), cost=np.ones(n), dx=np.ones(n + 1),
        size=np.array([1.0, 10, 4, 4, 4, 1]), producer=np.arange(-1, n),
        last=np.array([0, 3, 2, 4, 4, 5]), readers=[[0], [1, 3], [2], [4], [4], []],
        floating=np.ones(n + 1, bool), savers=savers)


_SAVERS = [[0], [1, 3], [2], [], [], [5]]  # h2 (BatchNorm's output) and s: no backward


def test_a_replay_holds_no_output_that_no_backward_reads():
    model = RegionModel(_block_costs(_SAVERS))
    assert model.free_out[2] == 4.0 and model.free_out[0] == 0.0
    # Replaying the block's calls 1-4 holds calls 1 and 3's kept bytes, not call
    # 2's output (read only by the add): 20 units fewer than all of them.
    everything = RegionModel(_block_costs([[0], [1, 3], [2], [4], [4], [5]]))
    assert model.bwd_region[1, 5] < everything.bwd_region[1, 5]


def test_an_output_its_own_backward_reads_is_not_free():
    # relu-like: call 2's own backward reads h2 (a saver at its producer).
    own = [[0], [1, 3], [2], [2], [], [5]]
    assert RegionModel(_block_costs(own)).free_out[2] == 0.0
    assert RegionModel(_block_costs(_SAVERS)).free_out[2] == 4.0


def test_branches_beside_each_other_run_their_backward_together():
    model = RegionModel(_block_costs(_SAVERS))
    # Call 3 (the shortcut) is beside calls 1 and 2; call 4 (the add) and call 0 are not.
    assert list(model.costs.bwd[[1, 2, 3]]) == [1, 8, 3]
    from tf_checkpointing.planning.measuring._lifetimes import concurrent_backward
    beside = concurrent_backward(model.costs)
    assert beside[3] == 8.0 and beside[1] == 3.0 and beside[2] == 3.0
    assert beside[0] == 0.0 and beside[4] == 0.0


def test_a_region_input_is_counted_twice_only_when_original_and_copy_both_live():
    # x (10 units) enters region [1, 4): its copy lives while call 1's backward
    # reads it. The original lives on only if a backward before the region reads
    # it too (call 0 saving its own output); else the region's copy replaces it.
    copied_only = RegionModel(_block_costs(_SAVERS))
    assert copied_only.double[1, 4] == 0.0
    assert copied_only.enter[1, 4] == 10.0   # at the replay's start, the copy
    both = RegionModel(_block_costs([[0], [0, 1, 3], [2], [], [], [5]]))
    assert both.double[1, 4] == 10.0
    assert both.need(1, 4, True) >= copied_only.need(1, 4, True) + 10.0 - 1e-9


def test_a_replay_counts_a_backward_that_allocates_after_its_output_is_freed():
    # Call 2 is a BatchNorm: its reading (8 units of backward above its kept 4,
    # its output) was taken with the output still held, but in a replay the
    # output is freed once the add read it, and the backward's temporaries (8
    # units above what it kept, so 12 above the rest) come after.
    alone = np.array([0.0, 1, 8, -4, -1])  # call 3 (the shortcut) frees its output too
    measured = RegionModel(dataclasses.replace(_block_costs(_SAVERS), bwd_alone=alone))
    unmeasured = RegionModel(_block_costs(_SAVERS))
    assert measured.free_out[2] == 4.0
    assert measured.bwd_region[1, 5] == unmeasured.bwd_region[1, 5] + 4.0
    # A backward that allocates nothing once its output is gone (bwd_alone -4)
    # keeps its reading: the model never counts less than it did.
    freeing = RegionModel(dataclasses.replace(_block_costs(_SAVERS), bwd_alone=np.array(
        [0.0, 1, -4, -4, -1])))
    assert freeing.bwd_region[1, 5] == unmeasured.bwd_region[1, 5]
    # Plain calls keep their reading above all they kept: nothing changes there.
    assert np.array_equal(measured.plain_need, unmeasured.plain_need)


def _add_graph(later_reader, op=False):
    import keras

    from tf_checkpointing.planning.layer_graph._layer_graph import read_graph

    x = keras.Input((8,))
    short = keras.layers.Dense(8, name="short")(x)
    branch = keras.layers.Dense(8, name="branch")(short)
    # `short + branch` is a Keras op node (an Operation, not a layer), as much
    # hand-written functional code adds a residual.
    added = short + branch if op else keras.layers.Add(name="add")([short, branch])
    # Keras runs "row" after "add": reading short, it keeps short's gradient apart.
    row = keras.layers.Dense(1, name="row")(short if later_reader else added)
    out = keras.layers.Add(name="broadcast")([added, row])  # (None, 8) + (None, 1)
    return read_graph(keras.Model(x, out))


@pytest.mark.parametrize("op", [False, True], ids=["layer", "op_node"])
@pytest.mark.parametrize("later_reader", [False, True])
def test_the_inputs_of_an_add_share_one_gradient_until_another_reader(later_reader, op):
    # tf.add passes its output's gradient to each same-shaped input: at the cut
    # before the Add, a branch output and a shortcut that nothing else reads
    # afterwards have one gradient tensor between them.
    from tf_checkpointing.planning.layer_graph._layer_graph import tensor_keys
    from tf_checkpointing.planning.solving._model_profile import _shared_gradients

    graph = _add_graph(later_reader, op)
    sizes = {key: (32, True) for key in tensor_keys(graph)}
    order = [call.name for call in graph.calls]
    # The op node's name is numbered; the layer's and the op's classes are both Add.
    order[next(i for i, c in enumerate(graph.calls) if type(c.layer).__name__ == "Add")] = "add"
    shared = _shared_gradients(graph, sizes)
    assert shared[order.index("add")] == (0 if later_reader else 32)
    # Before the branch ran, short still has another reader (the branch).
    assert shared[order.index("branch")] == 0
    # The broadcast Add's inputs have gradients of their own (one is reduced).
    assert shared[order.index("broadcast")] == 0


@pytest.mark.parametrize("least_share", [0.2, 0.5, 0.95])
def test_the_chunk_factor_falls_to_one_at_plain(least_share):
    """A graph plan's prediction is its model peak times the chunk factor: the
    full factor at the least plan (and below), 1 at plain (calibrated on plain's
    chunks), falling in proportion to the bytes saved in between."""
    plain, least = 100.0, 100.0 * least_share
    assert chunk_factor(least, plain, least) == pytest.approx(_CHUNKS)
    assert chunk_factor(least / 2, plain, least) == pytest.approx(_CHUNKS)
    assert chunk_factor(plain, plain, least) == pytest.approx(1.0)
    middle = (plain + least) / 2
    assert chunk_factor(middle, plain, least) == pytest.approx(1 + (_CHUNKS - 1) / 2)
    assert chunk_factor(50.0, plain_bytes=100.0, least_bytes=100.0) == _CHUNKS  # nothing to save
