"""What planning one model for one budget knows, and the plans it may choose.

:class:`Planning` holds the model's profile as a region model (:mod:`._model_profile`),
its least region plan, and how a model peak maps onto the step's: the
allocator's chunk factor (:func:`chunk_factor`) for a ``tf.function`` step, or
XLA's measured anchor (:mod:`._xla`). An :class:`Option` is a plan it may choose:
regions, or a user's selection of blocks (:meth:`Planning.selections`), which it
measures where the model's predictions are not enough. The choice itself is
:mod:`._model_planner`'s.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

from tf_checkpointing.planning._constants import CHUNKS as _CHUNKS
from tf_checkpointing.planning._constants import SELECTION_MARGIN as _SELECTION_MARGIN
from tf_checkpointing.planning.layer_graph._blocks import (
    BlockRef,
    block_layers,
    block_spans,
    inner_block_choices,
    named_block_spans,
    plain_filters_replayed,
    segment_spans,
)
from tf_checkpointing.planning.layer_graph._frozen import warn_eager_frozen
from tf_checkpointing.planning.layer_graph._graph_choices import policy_arrays
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.measuring._modes import step_mode
from tf_checkpointing.planning.measuring._whole_step import StepReading
from tf_checkpointing.planning.plans._budget import LEAST, model_headroom
from tf_checkpointing.planning.plans._plan import ModelPlan, PlanRunner, pieces_of_spans
from tf_checkpointing.planning.solving._model_profile import (
    cached_choices,
    cached_profile,
    calibrated,
    measured_step,
    profile_key,
)
from tf_checkpointing.planning.solving._region_solver import (
    NO_POLICY,
    Solution,
    nested_options,
    solve,
)
from tf_checkpointing.planning.solving._step_time import (
    StepTime,
    block_work,
    replay_scale,
    step_time,
)
from tf_checkpointing.planning.solving._xla import XlaAnchor, measure_plan, model_anchor
from tf_checkpointing.policies import reductions_saveable

__all__ = ["PLAIN", "Option", "Planning", "chunk_factor", "with_reductions"]

# The constants are explained where they are defined (planning/_constants.py).


class Option(NamedTuple):
    """A plan the planner may choose: regions (with their policies' indices) and
    blocks inside calls checkpointed one by one."""

    solution: Solution
    blocks: tuple[BlockRef, ...] = ()


@dataclasses.dataclass
class Planning:
    """What planning one model for one budget knows: the profile's region model,
    its least plan, and how a model peak maps onto the step's (the allocator's
    chunk factor, or XLA's measured anchor)."""

    graph: LayerGraph
    inputs: Any
    budget: Optional[int]
    mode: str
    runner: PlanRunner
    policies: tuple[Any, ...]
    region_model: Any
    nested: dict
    least: Solution
    plain_peak: int
    key: Any
    anchor: Optional[XlaAnchor]
    chunks: float
    inner: list[tuple[BlockRef, ...]]
    plain_seconds: Optional[float] = None
    time: Optional[StepTime] = None
    # XLA: the least plan's measured step time and the forward seconds it replays
    least_replay: tuple[Optional[float], float] = (None, 0.0)

    @classmethod
    def start(cls, graph: LayerGraph, inputs: Any, budget: Optional[int], *, mode: str,
              runner: PlanRunner, policies: tuple[Any, ...]) -> Planning:
        """Profiles the model (once per model, inputs and mode: cached) and
        solves for its least plan."""
        mode = step_mode(mode)
        if mode == "eager":  # a policy keeps nothing in eager mode: no choice
            policies = ()
            warn_eager_frozen(graph)
        else:
            policies = with_reductions(policies)
        inner = inner_block_choices(graph)
        # An XLA step is planned on the tf.function profile, anchored on its plain
        # and least plans compiled and measured (see
        # docs/decisions/0024-least-plans-under-xla.md): one profile for every budget.
        measured = "graph" if mode == "xla" else mode
        profile, costs = cached_profile(graph, inputs, measured)
        if policies:
            choices = cached_choices(graph, inputs, measured, policies)
            kept, cost = policy_arrays(choices, costs.kept, costs.cost)
            costs = dataclasses.replace(costs, policy_kept=kept, policy_cost=cost)
        region_model = calibrated(costs, profile.plain_peak_bytes)
        nested = nested_options(region_model)
        least = solve(region_model, None, nested=nested)
        assert least is not None  # every call alone, checkpointed or not, is a plan
        planning = cls(graph=graph, inputs=inputs, budget=budget, mode=mode, runner=runner,
                       policies=policies, region_model=region_model,
                       nested=nested, least=least, key=profile_key(graph, inputs, measured),
                       anchor=None, chunks=_CHUNKS if mode == "graph" else 1.0, inner=inner,
                       plain_peak=profile.plain_peak_bytes,
                       plain_seconds=profile.plain_step_seconds)
        if mode == "xla":
            planning.anchor_on_xla_steps()
        planning.time = planning.step_time()
        return planning

    def anchor_on_xla_steps(self) -> None:
        """Maps the model's peaks onto the plain and least plans' XLA steps,
        measured (see _xla), and takes XLA's plain peak as the plain step's."""
        least = self.least
        anchor = model_anchor(self.key, self.graph, self.inputs, least.spans, self.runner,
                              model_least=least.value, model_plain=self.region_model.peak(()),
                              least_policies=self.policies_of(least.policies))
        self.anchor, self.plain_peak = anchor, anchor.plain_bytes
        self.plain_seconds = anchor.plain_seconds
        self.least_replay = (anchor.least_seconds,
                             self.region_model.extra_work(least.spans, least.policies))
        for option, step in ((Option(PLAIN), StepReading(anchor.plain_bytes,
                                                         anchor.plain_seconds)),
                             (Option(least), StepReading(anchor.least_bytes,
                                                         anchor.least_seconds))):
            measured_step(self.key, (self.mode, _memo_key(option)), lambda step=step: step)
        if not anchor.helps:
            self.least = Solution(least.value, (), ())

    def step_time(self) -> Optional[StepTime]:
        """The time model: the plain step measured, and per-call forward seconds
        as they are (a ``tf.function`` step replays the same graph ops), or under
        XLA scaled so that it predicts the least plan's measured step (XLA fuses
        a replay otherwise than the per-call graphs run it; see
        docs/decisions/0039-step-time-model.md)."""
        least_seconds, least_replay = self.least_replay
        return step_time(self.plain_seconds, replay_scale(
            self.plain_seconds, least_seconds, least_replay))

    def predict(self, model_bytes: float, checkpointed: bool = True) -> float:
        """The step's peak for a plan the model predicts ``model_bytes`` for."""
        if self.anchor is not None:
            return self.anchor.predict(model_bytes)
        if not checkpointed:  # the plain step's chunks are what the profile calibrated on
            return model_bytes
        model_plain = self.region_model.peak(())
        return model_bytes * chunk_factor(model_bytes, model_plain, self.least.value,
                                          self.chunks)

    def policies_of(self, chosen: tuple[int, ...]) -> tuple[Any, ...]:
        return tuple(None if p == NO_POLICY else self.policies[p] for p in chosen)

    def measure(self, option: Option) -> int:
        """The peak of the step run by ``option``, measured (once per profile)."""
        return self.measured(option).peak_bytes

    def measured(self, option: Option) -> StepReading:
        """The step run by ``option``, measured (once per profile)."""
        blocks = {"blocks": option.blocks} if option.blocks else {}
        return measured_step(self.key, (self.mode, _memo_key(option)), lambda: measure_plan(
            self.graph, self.inputs, self.runner, option.solution.spans,
            self.policies_of(option.solution.policies), mode=self.mode, **blocks))

    def replay_seconds(self, option: Option) -> float:
        """The forward seconds ``option`` replays, in the profile's per-call unit:
        its regions' (under their policies), or the share of its blocks' calls
        that the blocks hold (see _step_time.block_work)."""
        if option.blocks:
            return block_work(self.graph, self.region_model.costs.cost, option.blocks)
        return self.region_model.extra_work(option.solution.spans, option.solution.policies)

    def selections(self) -> list[Option]:
        """The plans a user could write, besides the planner's regions: the
        model's own blocks (``apply_checkpointing(model, [Block])``), at the top
        of the graph or inside its calls, its pieces between residual joins, and
        its blocks by layer-name prefix (``conv2_block1_*``). A region plan must
        not lose to them, so they are measured (see
        docs/decisions/0021-least-plan-against-the-blocks.md): those of regions
        where the model's prediction leaves them a chance to (see
        docs/decisions/0044-selections-that-could-win.md)."""
        options = []
        if self.mode != "eager":  # eager region plans are predicted from exact readings
            could_win = self.predict(self.least.value) * _SELECTION_MARGIN
            for spans in dict.fromkeys((block_spans(self.graph), segment_spans(self.graph),
                                        named_block_spans(self.graph))):
                if not spans or spans == self.least.spans:
                    continue
                peak = self.region_model.peak(spans)
                if self.predict(peak) <= could_win:
                    options.append(Option(Solution(peak, spans, (NO_POLICY,) * len(spans))))
            if self.mode == "xla" and self.least.spans:
                # The least plan with its plain pieces that hold a filter replayed
                # in full, not saving everything: less memory, a slower step (see
                # docs/decisions/0054-xla-least-plans-replay-their-plain-pieces.md).
                spans = plain_filters_replayed(self.graph, self.least.spans)
                if spans != self.least.spans:
                    chosen = dict(zip(self.least.spans, self.least.policies))
                    policies = tuple(chosen.get(span, NO_POLICY) for span in spans)
                    options.append(Option(Solution(
                        self.region_model.peak(spans, policies=policies), spans, policies)))
        return options + [Option(PLAIN, refs) for refs in self.inner]

    def solve(self, limit: Optional[float]) -> Optional[Solution]:
        """The region plan with least recomputation whose model peak is at most
        ``limit`` (None: the least peak), or None. Never more than the plan
        that offers only ``reductions_saveable``, the policy every plan has."""
        return solve(self.region_model, limit, nested=self.nested, base_policies=1)

    def min_budget(self) -> int:
        """The least budget accepted: the least peak of the least region plan
        (predicted) and of the selections (measured), plus the headroom."""
        least = min([self.predict(self.least.value),
                     *(self.measure(option) for option in self.selections())])
        return min(int(math.ceil(least / (1 - model_headroom(self.mode)))), self.plain_peak)

    def plan(self, option: Option, predicted: Optional[float] = None) -> ModelPlan:
        """The :class:`ModelPlan` of ``option`` (``predicted``: its measured peak)."""
        names = tuple(call.name for call in self.graph.calls)
        spans = option.solution.spans
        if predicted is None:
            predicted = self.predict(
                self.region_model.peak(spans, policies=option.solution.policies), bool(spans))
        layers = block_layers(self.graph, option.blocks)
        replay = self.replay_seconds(option)
        return ModelPlan(
            names=names, call_kinds=self.graph.kinds(),
            pieces=pieces_of_spans(0, len(names), spans,
                                   self.policies_of(option.solution.policies)),
            mode=self.mode, budget_bytes=LEAST if self.budget is None else self.budget,
            predicted_peak_bytes=int(predicted), plain_peak_bytes=self.plain_peak,
            min_budget_bytes=self.min_budget(), policies=self.policies,
            predicted_extra_seconds=replay,
            plain_step_seconds=None if self.time is None else self.time.plain_seconds,
            predicted_step_seconds=None if self.time is None else self.time.predict(replay),
            blocks=option.blocks,
            block_names=tuple(f"{self.graph.calls[i].name}/{layer.name}"
                              for (i, _), layer in zip(option.blocks, layers)))


PLAIN = Solution(0.0, (), ())  # the plan that checkpoints nothing


def _memo_key(option: Option) -> tuple:
    """What a measured step depends on: regions, their policies, blocks."""
    policies = tuple(NO_POLICY if p is None else p for p in option.solution.policies)
    policies = policies if any(p != NO_POLICY for p in policies) else ()
    return option.solution.spans, policies, option.blocks


def chunk_factor(model_bytes: float, plain_bytes: float, least_bytes: float,
                 chunks: float = _CHUNKS) -> float:
    """The allocator's chunks over the tensors, for a plan whose model peak is
    ``model_bytes``: ``chunks`` at the least plan's peak (and below), falling in
    proportion to the bytes the plan saves to 1 at plain's, whose chunks the
    profile was calibrated on. The predicted peak; plans are chosen with
    ``chunks`` itself (a margin). Falling, because a fixed factor counted the
    chunks of a plan that runs most of the model plainly twice (see
    docs/decisions/0019-chunk-factor.md).

        >>> from tf_checkpointing.planning.solving._planning import chunk_factor
        >>> chunk_factor(60.0, plain_bytes=100.0, least_bytes=20.0, chunks=1.1)
        1.05
    """
    if plain_bytes <= least_bytes:
        return chunks
    share_saved = (plain_bytes - model_bytes) / (plain_bytes - least_bytes)
    return 1 + (chunks - 1) * min(1.0, max(0.0, share_saved))


def with_reductions(policies: tuple[Any, ...]) -> tuple[Any, ...]:
    """``policies`` with ``policies.reductions_saveable`` first: a region may
    always keep its reductions' results (a BatchNorm's batch moments, a
    LayerNorm's), which cost almost no memory and spare the replay the passes
    that made them (see docs/decisions/0022-reductions-saveable-per-region.md)."""
    return (reductions_saveable,) + tuple(p for p in policies if p is not reductions_saveable)
