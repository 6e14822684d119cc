"""The region program's memory model on hand-made costs (no TensorFlow run).

A chain of four calls, each keeping 10 units for its backward and passing a
1-unit tensor to the next: the plain call right after a checkpointed region
is still held while the region replays (the executor computes that call's
input gradient before its weight gradients), so the model counts it there.
"""

import numpy as np

from tf_checkpointing.planning._region_solver import solve
from tf_checkpointing.planning._regions import GraphCosts, RegionModel


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
    peak, spans = found
    assert np.isclose(peak, model.peak(spans), rtol=0.02)  # agree, up to its units
    limit = model.peak(((0, 2, ()), (2, 4, ())))
    work, spans = solve(model, limit)
    assert model.peak(spans) <= limit
