"""Which runs of consecutive layer calls of a DAG to checkpoint, for a memory budget.

The choice of algorithm. Checkmate (Jain et al. 2020) solves the general
rematerialization problem exactly as a MILP over every (stage, node) pair:
optimal, but minutes to hours for ResNet50-sized graphs and it needs an ILP
solver (not a dependency we may add). Rockmate (Zhao et al. 2023) finds
blocks in the graph, solves each with a small ILP, and chains the blocks
with rotor; Kumar et al. (2019) decompose by treewidth, with bounds but no
practical speed. torch.compile's min-cut partitioner (with
``activation_memory_budget``) picks *which tensors to save* in one joint
forward+backward graph, which our runtime (one ``custom_gradient`` per
region) cannot express. What our runtime can run is a sequence of regions
of consecutive calls in a topological order, each either plain or
checkpointed, and for that family the optimum is found exactly by a dynamic
program over cut positions, in ``O(n^2 U)`` vector steps for ``n`` calls and
``U`` memory units (ResNet50: 177 calls, well under a second of NumPy):

``best[c'][h']`` is the least recomputation to run calls ``[0, c')`` with
``h'`` bytes (in units) held for the backward, reached from ``best[c][h]`` by
either one plain call ``c`` (holding what its tape keeps, ``kept[c]``) or a
checkpointed region ``[c, c')`` (holding only its tensors read after ``c'``;
recomputing its forward). Every region must fit: ``h`` plus the region's
forward peak and its backward peak (its replay's kept bytes, the gradients in
flight across the cut, and in eager mode the weight gradients of later calls; a
compiled step applies each one as it is made, as ``fit`` does) within the
budget. The held bytes are what makes DAGs different from chains: a tensor
is counted once, where it is made, however many region boundaries it crosses
(a U-Net skip made in the encoder and read by the decoder is held once, not
at every cut in between), so a graph without articulation points is planned
like any other. The same program with ``max`` in place of ``+`` gives the
least peak of any plan (``budget="min"``).

All bytes come from the allocator (:mod:`tf_checkpointing.planning._profile`,
run on the graph as a chain of "live tensor" states), and the per-call bytes
are scaled to the measured plain step, as the chain planner does. Regions are
not nested (a flat plan); the chain planner nests.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__: list[str] = []

_UNITS = 400


@dataclasses.dataclass
class GraphCosts:
    """The numbers the program needs, per call ``i`` (``n`` calls) and per tensor.

    ``kept, fwd, fwd0, bwd, wgrad, cost``: per call (from the profile).
    ``dx``: ``n + 1`` gradient bytes of the tensors alive at each cut.
    ``size, producer, last, readers``: per tensor: bytes, the call making it
    (-1 for a model input), the last call reading it (``n`` for an output),
    and whether it is floating (``floating``).
    """

    kept: np.ndarray
    fwd: np.ndarray
    fwd0: np.ndarray
    bwd: np.ndarray
    wgrad: np.ndarray
    cost: np.ndarray
    dx: np.ndarray
    size: np.ndarray
    producer: np.ndarray
    last: np.ndarray
    readers: list
    floating: np.ndarray

    @property
    def n(self) -> int:
        return len(self.kept)


class RegionModel:
    """Tables of the memory model over all ``(start, stop)`` pairs of cuts.

    ``plain_scale`` multiplies the per-call bytes of calls run plainly (not
    those of replays): a compiled step frees the intermediates of plain calls
    sooner than their per-call graphs do, which a factor fitted to the
    measured plain step captures (0.57 on ResNet50); a replay, one tape
    inside a custom gradient, keeps what the per-call graphs measured (with
    the raw numbers the ResNet50 least plan is predicted at 175 MiB, measured
    176 MiB).
    """

    def __init__(self, costs: GraphCosts, plain_scale: float = 1.0) -> None:
        n = self.n = costs.n
        self.costs = costs
        self.kept_prefix = np.concatenate([[0.0], np.cumsum(costs.kept)])
        self.cost_prefix = np.concatenate([[0.0], np.cumsum(costs.cost)])
        w_suffix = np.concatenate([np.cumsum(costs.wgrad[::-1])[::-1], [0.0]])
        # by_made_alive[p + 1, i]: bytes made by call p (row 0: inputs) alive at cut i.
        by_made_alive = np.zeros((n + 1, n + 1))
        for size, p, last in zip(costs.size, costs.producer, costs.last):
            by_made_alive[p + 1, p + 1:last + 1] += size
        made_prefix = np.vstack([np.zeros((1, n + 1)), np.cumsum(by_made_alive, axis=0)])
        # live[a, i]: bytes made by calls [a, i) still read at or after i.
        rows = np.arange(n + 1)
        self.live = made_prefix[rows[None, :] + 1, rows[None, :]] - made_prefix[rows[:, None] + 1,
                                                                                 rows[None, :]]
        # enter[a, c]: floating bytes made before a and read in [a, c) (the
        # replay's fresh copies of its inputs).
        self.enter = np.zeros((n + 1, n + 1))
        for t, reads in enumerate(costs.readers):
            if not costs.floating[t] or not reads:
                continue
            reads, at = sorted(reads), 0
            for a in range(costs.producer[t] + 1, reads[-1] + 1):
                while reads[at] < a:
                    at += 1
                self.enter[a, reads[at] + 1:] += costs.size[t]
        self.fwd_ckpt = np.full((n + 1, n + 1), -np.inf)
        self.bwd_region = np.full((n + 1, n + 1), -np.inf)
        for a in range(n):
            k = np.arange(a, n)
            ckpt = np.maximum.accumulate(self.live[a, k] + costs.fwd0[k])
            back = np.maximum.accumulate(self.kept_prefix[k + 1] - self.kept_prefix[a]
                                         + costs.dx[k + 1] + w_suffix[k + 1] + costs.bwd[k])
            self.fwd_ckpt[a, a + 1:] = ckpt
            self.bwd_region[a, a + 1:] = back
        self._w_suffix, self.plain_scale = w_suffix, 1.0
        self.rescale_plain(plain_scale)

    def rescale_plain(self, scale: float) -> None:
        """Sets ``plain_scale``: the need and held bytes of each plain call."""
        costs, k = self.costs, np.arange(self.n)
        self.plain_scale = scale
        self.plain_held = scale * costs.kept
        self.plain_need = np.maximum(scale * costs.fwd, scale * (costs.kept + costs.bwd)
                                     + costs.dx[k + 1] + self._w_suffix[k + 1])

    def need(self, a: int, c: int, checkpointed: bool) -> float:
        """Peak of running ``[a, c)`` (forward and backward) above what is held before."""
        if checkpointed:
            return max(self.fwd_ckpt[a, c], self.bwd_region[a, c] + self.enter[a, c])
        assert c == a + 1  # plain runs are planned call by call
        return float(self.plain_need[a])

    def held(self, a: int, c: int, checkpointed: bool) -> float:
        """Bytes ``[a, c)`` leaves held for the backward."""
        if checkpointed:
            return float(self.live[a, c])
        return float(self.plain_held[a:c].sum())

    def peak(self, spans: tuple[tuple[int, int], ...]) -> float:
        """The peak the model predicts for checkpointing ``spans``."""
        held, peak = 0.0, 0.0
        for a, c, checkpointed in pieces(self.n, spans):
            peak = max(peak, held + self.need(a, c, checkpointed))
            held += self.held(a, c, checkpointed)
        return peak


def pieces(n: int, spans: tuple[tuple[int, int], ...]) -> list[tuple[int, int, bool]]:
    """The plan as a cover of ``[0, n)``: checkpointed spans, plain calls between."""
    out, at = [], 0
    for a, c in spans:
        out.extend((k, k + 1, False) for k in range(at, a))
        out.append((a, c, True))
        at = c
    out.extend((k, k + 1, False) for k in range(at, n))
    return out


def solve(model: RegionModel, limit: Optional[float]) -> Optional[tuple[float, tuple]]:
    """With ``limit``: the least recomputation whose modelled peak fits it, as
    ``(work, spans)``, or None. Without: the least peak (ties: least work), as
    ``(peak, spans)``."""
    n = model.n
    unit = max(limit if limit is not None else model.peak(()), 1.0) / _UNITS
    size = _UNITS + 1
    # value: least work (with a limit) or least peak so far, at (cut, held units).
    value = np.full((n + 1, size), np.inf)
    work = np.full((n + 1, size), np.inf)
    came_from = np.full((n + 1, size, 3), -1, np.int32)  # (cut, held units, checkpointed)
    value[0, 0] = work[0, 0] = 0.0
    held_bytes = np.arange(size) * unit
    for a in range(n):
        if not np.isfinite(value[a]).any():
            continue
        for c in range(a + 1, n + 1):
            for checkpointed in (False, True) if c == a + 1 else (True,):
                add = int(np.ceil(model.held(a, c, checkpointed) / unit - 1e-9))
                if add >= size:
                    continue
                need = model.need(a, c, checkpointed)
                extra = model.cost_prefix[c] - model.cost_prefix[a] if checkpointed else 0.0
                if limit is None:
                    new_value = np.maximum(value[a], held_bytes + need)
                else:
                    new_value = np.where(held_bytes + need <= limit, value[a] + extra, np.inf)
                new_value, new_work = new_value[:size - add], (work[a] + extra)[:size - add]
                old_value, old_work = value[c, add:], work[c, add:]
                better = np.isfinite(new_value) & (
                    (new_value < old_value * (1 - 1e-9))
                    | ((new_value <= old_value * (1 + 1e-9)) & (new_work < old_work)))
                idx = np.nonzero(better)[0]
                if idx.size:
                    value[c, add + idx] = new_value[idx]
                    work[c, add + idx] = new_work[idx]
                    came_from[c, add + idx] = np.stack(
                        [np.full_like(idx, a), idx, np.full_like(idx, int(checkpointed))], 1)
    if not np.isfinite(value[n]).any():
        return None
    low = np.min(value[n])
    ties = np.nonzero(value[n] <= low * (1 + 1e-9))[0]
    h = int(ties[np.argmin(work[n, ties])])
    result = float(value[n, h])
    spans, c = [], n
    while c > 0:
        a, h, checkpointed = (int(v) for v in came_from[c, h])
        if checkpointed:
            spans.append((a, c))
        c = a
    return result, tuple(reversed(spans))
