"""Small layer graphs with made-up costs, for checking the MILP against the program.

Three shapes of graph, each a list of calls reading tensors (tensor ``t + 1`` is
the output of call ``t``, tensor 0 the model input), with random sizes, times
and one save policy: a chain of Dense blocks, a residual CNN whose blocks add
their input back (a skip read two calls later), and a U-Net whose encoder
outputs are read by the decoder's concatenations far later. The costs follow
what a profile gives (a call keeps its inputs, its forward peak holds inputs and
output), enough to exercise every table of ``RegionModel``; no TensorFlow runs.
"""

from __future__ import annotations

import numpy as np

from tf_checkpointing.planning.solving._regions import GraphCosts, RegionModel

__all__ = ["GRAPHS", "region_model"]


def _chain(blocks: int) -> list[list[int]]:
    """Dense, activation, Dense, per block: each call reads the last output."""
    return [[t] for t in range(3 * blocks)]


def _residual(blocks: int) -> list[list[int]]:
    """Per block: conv, batch norm, add(block input, norm), relu."""
    reads: list[list[int]] = [[0]]  # the stem
    for _ in range(blocks):
        x = len(reads)  # the block input's tensor
        reads += [[x], [x + 1], [x, x + 2], [x + 3]]
    return reads


def _unet(levels: int) -> list[list[int]]:
    """Encoder conv, pool per level; a middle conv; per level up, concatenate
    with the encoder's conv output, conv."""
    reads: list[list[int]] = [[0]]
    skips = []
    for _ in range(levels):
        reads.append([len(reads)])  # conv
        skips.append(len(reads))
        reads.append([len(reads)])  # pool
    reads.append([len(reads)])  # middle
    for skip in reversed(skips):
        reads.append([len(reads)])  # up
        reads.append([len(reads), skip])  # concatenate
        reads.append([len(reads)])  # conv
    return reads


GRAPHS = {"chain": lambda: _chain(3), "residual": lambda: _residual(2),
          "unet": lambda: _unet(2)}


def region_model(reads: list[list[int]], seed: int) -> RegionModel:
    """A :class:`RegionModel` of the graph whose call ``i`` reads tensors
    ``reads[i]``, with random costs from ``seed`` and one save policy."""
    rng = np.random.default_rng(seed)
    n = len(reads)
    size = rng.uniform(1.0, 10.0, n + 1)
    readers = [[i for i, r in enumerate(reads) if t in r] for t in range(n + 1)]
    last = np.array([max(r, default=n) if t < n else n for t, r in enumerate(readers)])
    inputs = np.array([size[r].sum() for r in reads])
    out = size[1:]
    # A call keeps its inputs (a Dense, a conv), or only its output (an activation).
    kept = np.where(rng.random(n) < 0.7, inputs, out) * rng.uniform(0.5, 1.0, n)
    alive = np.array([size[(np.arange(n + 1) < c + 1) & (last >= c)].sum() for c in range(n + 1)])
    policy_kept = np.where(rng.random(n) < 0.5, 0.0, out * rng.uniform(0.1, 0.6, n))
    cost = rng.uniform(0.5, 2.0, n)
    savers = [sorted({i for i in readers[t] if rng.random() < 0.8}) for t in range(n + 1)]
    savers[n] = [n]
    costs = GraphCosts(
        kept=kept, fwd=inputs + out, fwd0=out + rng.uniform(0.0, 1.0, n),
        bwd=rng.uniform(0.0, 1.0, n) * out, wgrad=np.zeros(n), cost=cost, dx=alive * 0.5,
        size=size, producer=np.arange(-1, n), last=last, readers=readers,
        floating=np.ones(n + 1, bool), own_wgrad=rng.uniform(0.0, 0.5, n), savers=savers,
        bwd_alone=rng.uniform(0.0, 1.0, n) * out,
        policy_kept=policy_kept[:, None], policy_cost=(cost * rng.uniform(0.2, 0.9, n))[:, None])
    return RegionModel(costs, plain_scale=float(rng.uniform(0.8, 1.2)))
