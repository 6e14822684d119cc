"""Which runs of consecutive layer calls of a DAG to checkpoint, for a memory budget.

The choice of algorithm. Checkmate (Jain et al. 2020) solves the general
rematerialization problem exactly as a MILP over every (stage, node) pair:
optimal, but minutes to hours for a model of a few hundred layer calls, and
it needs an ILP solver (not a dependency we may add). Rockmate (Zhao et al.
2023) finds blocks in the graph, solves each with a small ILP, and chains the
blocks with rotor; Kumar et al. (2019) decompose by treewidth, with bounds but no
practical speed. torch.compile's min-cut partitioner (with
``activation_memory_budget``) picks *which tensors to save* in one joint
forward+backward graph, which our runtime (one ``custom_gradient`` per
region) cannot express. What our runtime can run is a sequence of regions
of consecutive calls in a topological order, each either plain or
checkpointed, and for that family the optimum is found exactly by a dynamic
program over cut positions, in ``O(n^2 U)`` vector steps for ``n`` calls and
``U`` memory units (well under a second of NumPy for a few hundred calls; see
docs/decisions/0014-regions-by-dynamic-program.md):

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
(a skip connection made in an encoder and read by its decoder is held once,
not at every cut in between), so a graph without articulation points is
planned like any other. The same program with ``max`` in place of ``+`` gives the
least peak of any plan (``budget="min"``).

A region's replay starts as soon as the gradient of its outputs arrives, and in
a graph that is before the plain call run right after it has finished its
backward: the executor computes that call's input gradient first and its weight
gradients later, so the tensors it keeps are still held while the region
replays (see docs/decisions/0015-region-program.md). So a region followed by a plain
call is one step of the program, whose need counts that call's held bytes
during the region's backward; a plain call may follow only a plain call (or
the start), never a region directly.

Checkpoints nest one level, as in rotor (Beaumont et al. 2019): a region's
replay may itself checkpoint sub-regions, which lowers what the replay holds
(every call of a replay, its sub-regions' plain calls included, keeps what its
per-call profile measured). For each short region, the same program run
from its start gives the least peak of its replay with sub-regions (one run
per start gives every end), and the outer program may take the region flat or
nested (paying the sub-regions' recomputation too; see docs/decisions/0016-nesting.md).

This module is the memory model (:class:`RegionModel`), built on the tensor
lifetimes of :mod:`..measuring._lifetimes`; the program itself is :mod:`._region_solver`.
All bytes come from the allocator (:mod:`tf_checkpointing.planning.measuring._profile`,
run on the graph as a chain of "live tensor" states), and the per-call bytes of
plain calls are scaled to the measured plain step, as the chain planner does.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np

from tf_checkpointing.planning.measuring._lifetimes import GraphCosts, Lifetimes

__all__ = ["GraphCosts", "RegionModel", "pieces"]


class RegionModel:
    """Tables of the memory model over all ``(start, stop)`` pairs of cuts.

    ``plain_scale`` multiplies the per-call bytes of calls run plainly (not
    those of replays): fitted so that the model predicts the measured plain
    step, it absorbs what per-call graphs measure differently from one whole
    step (see docs/decisions/0017-plain-step-calibration.md). A replay's calls keep
    what their per-call graphs measured, less those outputs, and a call's
    backward runs beside those of parallel branches (see :mod:`..measuring._lifetimes`).
    """

    def __init__(self, costs: GraphCosts, plain_scale: float = 1.0) -> None:
        n = self.n = costs.n
        self.costs = costs
        self.cost_prefix = np.concatenate([[0.0], np.cumsum(costs.cost)])
        w_suffix = np.concatenate([np.cumsum(costs.wgrad[::-1])[::-1], [0.0]])
        tables = Lifetimes(costs)
        self.live, self.held_live, self.passing = tables.live, tables.held_live, tables.passing
        self.kept_in, self.free_out = tables.kept_in, tables.free_out
        self.enter, self.double = tables.enter, tables.double
        # A replay is a graph too: the outputs no backward reads are freed as soon
        # as the forward read them (BatchNorm and Add outputs), so its calls hold
        # what they keep without those (see docs/decisions/0018-memory-model.md).
        self.kept_prefix = np.concatenate([[0.0], np.cumsum(np.maximum(
            costs.kept - self.free_out, 0.0))])
        self.fwd_ckpt = np.full((n + 1, n + 1), -np.inf)
        self.bwd_region = np.full((n + 1, n + 1), -np.inf)
        # A replay's weight gradients wait for all its gradients (so that no
        # optimizer update runs before the replay read the weights), so those of
        # calls [k, c) are held at the backward of call k of region [a, c).
        own = np.zeros(n) if costs.own_wgrad is None else costs.own_wgrad
        own_prefix = np.concatenate([[0.0], np.cumsum(own)])
        beside = self.beside = tables.beside
        # A call's backward peak was read above what its forward kept, its outputs
        # included; in a replay the outputs no backward reads are gone by then
        # (kept_prefix leaves them out), so its backward is its own peak above the
        # rest: a BatchNorm's backward makes three temporaries the size of its
        # output, which the reading above its kept output undercounts (see
        # docs/decisions/0018-memory-model.md).
        replay_bwd = costs.bwd if costs.bwd_alone is None else np.maximum(
            costs.bwd, costs.bwd_alone + self.free_out)
        for a in range(n):
            k = np.arange(a, n)
            ckpt = np.maximum.accumulate(self.live[a, k] + costs.fwd0[k]
                                         + self.passing[a, k])
            back = np.maximum.accumulate(self.kept_prefix[k + 1] - self.kept_prefix[a]
                                         + costs.dx[k + 1] + w_suffix[k + 1] + replay_bwd[k]
                                         + beside[k] - own_prefix[k])
            self.fwd_ckpt[a, a + 1:] = ckpt
            self.bwd_region[a, a + 1:] = back + own_prefix[k + 1]
        # No region holds a model output and a later call reading it (BertBackbone's
        # sequence output and the pooled output made from it): for the user's tape a
        # region's outputs are independent, so a gradient with respect to the first
        # would miss the path through the second (a ChainedOutputWarning that the
        # user of apply_checkpointing cannot act on). Each call alone stays a plan.
        for key in np.nonzero(costs.last == n)[0]:
            made, later = int(costs.producer[key]), [r for r in costs.readers[key] if r < n]
            if made >= 0 and later:
                self.fwd_ckpt[:made + 1, min(later) + 1:] = np.inf
                self.bwd_region[:made + 1, min(later) + 1:] = np.inf
        self._w_suffix, self.plain_scale = w_suffix, 1.0
        # [cut, policy] prefix sums: what a region under a policy keeps on top of
        # its inputs, and the replay time it costs.
        policy_kept = np.zeros((n, 0)) if costs.policy_kept is None else costs.policy_kept
        policy_cost = np.zeros((n, 0)) if costs.policy_cost is None else costs.policy_cost
        zero = np.zeros((1, policy_kept.shape[1]))
        self.policy_kept_prefix = np.vstack([zero, np.cumsum(policy_kept, axis=0)])
        self.policy_cost_prefix = np.vstack([zero, np.cumsum(policy_cost, axis=0)])
        self.rescale_plain(plain_scale)

    def replay_need(self, a: int, c: int, replay_peak: float) -> float:
        """Peak of checkpointed region ``[a, c)`` whose replay (its calls'
        backward, from the first copy on) peaks at ``replay_peak``."""
        return max(self.fwd_ckpt[a, c], replay_peak + self.double[a, c],
                   self.enter[a, c] + self.kept_in[a, c] + self.costs.dx[c])

    def rescale_plain(self, scale: float, beside: bool = False) -> None:
        """Sets ``plain_scale``: the need and held bytes of each plain call (with
        ``beside``, its backward beside those of parallel branches)."""
        costs, k = self.costs, np.arange(self.n)
        self.plain_scale = scale
        self.plain_held = scale * np.maximum(costs.kept - self.free_out, 0.0)
        self.plain_need = np.maximum(scale * costs.fwd + self.passing[k, k],
                                     scale * (costs.kept + costs.bwd)
                                     + costs.dx[k + 1] + self._w_suffix[k + 1]
                                     + (self.beside if beside else 0.0))

    def in_replay(self) -> RegionModel:
        """The model of calls run inside a replay: every call keeps what its
        per-call profile measured (no plain-step scale), its backward runs beside
        those of parallel branches, as in a flat replay (a residual block's two
        last BatchNorms, plain inside a nested replay, have both backward passes'
        temporaries alive at once; see docs/decisions/0018-memory-model.md), and no
        policies."""
        # Regions inside a replay are full replays (policies are for the top level).
        view = self.with_policies(0)
        view.rescale_plain(1.0, beside=True)
        return view

    def with_policies(self, count: int) -> RegionModel:
        """The model that offers only its first ``count`` policies (the same
        tables otherwise)."""
        view = copy.copy(self)
        view.policy_kept_prefix = self.policy_kept_prefix[:, :count]
        view.policy_cost_prefix = self.policy_cost_prefix[:, :count]
        return view

    @property
    def num_policies(self) -> int:
        return int(self.policy_kept_prefix.shape[1])

    def policy_kept(self, a: int, c: int, policy: int) -> float:
        """Bytes region ``[a, c)`` replayed under ``policy`` keeps on top of its inputs."""
        return float(self.policy_kept_prefix[c, policy] - self.policy_kept_prefix[a, policy])

    def work(self, a: int, c: int, policy: int = -1) -> float:
        """Replay seconds of region ``[a, c)``, fully or under ``policy``."""
        if policy < 0:
            return float(self.cost_prefix[c] - self.cost_prefix[a])
        return float(self.policy_cost_prefix[c, policy] - self.policy_cost_prefix[a, policy])

    def need(self, a: int, c: int, checkpointed: bool, policy: int = -1) -> float:
        """Peak of running ``[a, c)`` (forward and backward) above what is held before.

        Under a policy the region's forward holds what it keeps on top of its
        untaped peak, and so does its backward on top of the full replay's: the
        kept tensors come back as they are, where a replay makes them again, so
        counting them in full is the safe side (a kept product that the plain
        call keeps anyway is counted twice)."""
        if checkpointed:
            kept = self.policy_kept(a, c, policy) if policy >= 0 else 0.0
            return self.replay_need(a, c, self.bwd_region[a, c]) + kept
        assert c == a + 1  # plain runs are planned call by call
        return float(self.plain_need[a])

    def held(self, a: int, c: int, checkpointed: bool, policy: int = -1) -> float:
        """Bytes ``[a, c)`` leaves held for the backward."""
        if checkpointed:
            kept = self.policy_kept(a, c, policy) if policy >= 0 else 0.0
            return float(self.held_live[a, c] + self.kept_in[a, c]) + kept
        return float(self.plain_held[a:c].sum())

    def peak(self, spans: tuple = (), start: int = 0, stop: Optional[int] = None,
             policies: tuple = ()) -> float:
        """The peak the model predicts for running ``[start, stop)`` with the
        checkpointed ``spans`` (``(start, stop, inner)`` triples), each replayed
        under the policy of the same position in ``policies`` (indices; -1 or
        missing: a full replay)."""
        held, peak = 0.0, 0.0
        cover = pieces(start, self.n if stop is None else stop, spans, policies)
        for k, (a, c, checkpointed, inner, policy) in enumerate(cover):
            need = self.need(a, c, checkpointed, policy)
            if inner:
                replay = self.in_replay().peak(inner, a, c)
                need = self.replay_need(a, c, replay)
            if checkpointed and k + 1 < len(cover) and not cover[k + 1][2]:
                need += self.plain_held[c]  # the plain call after it, still held
            peak = max(peak, held + need)
            held += self.held(a, c, checkpointed, policy)
        return peak

    def extra_work(self, spans: tuple, policies: tuple = ()) -> float:
        """The replay seconds of ``spans`` (nested ones too) under ``policies``."""
        chosen = list(policies) + [-1] * (len(spans) - len(policies))
        return sum(self.work(a, c, p) + self.extra_work(inner)
                   for (a, c, inner), p in zip(spans, chosen))


def pieces(start: int, stop: int, spans: tuple,
           policies: tuple = ()) -> list[tuple[int, int, bool, tuple, int]]:
    """The plan as a cover of ``[start, stop)``: checkpointed spans (with their
    inner spans and policy index, -1 for none), plain calls between."""
    out: list[Any] = []
    at = start
    chosen = list(policies) + [-1] * (len(spans) - len(policies))
    for (a, c, inner), policy in zip(spans, chosen):
        out.extend((k, k + 1, False, (), -1) for k in range(at, a))
        out.append((a, c, True, inner, policy))
        at = c
    out.extend((k, k + 1, False, (), -1) for k in range(at, stop))
    return out
