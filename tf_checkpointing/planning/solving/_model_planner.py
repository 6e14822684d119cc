"""``plan_model``: where the checkpoints of a whole functional model go, for a budget.

The model's layer graph (:mod:`..layer_graph._layer_graph`) is profiled as a chain of states
(:mod:`._model_profile`), and the regions are chosen by the program of
:mod:`._regions`. This module is the glue: it turns the model's peaks into
predicted step peaks (the allocator's chunk factor, or XLA's measured anchor),
picks the plan for the budget, and says what the budget must be at least. The
plan type is :class:`~tf_checkpointing.planning.plans._plan.ModelPlan`.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import warnings
from typing import Any, NamedTuple, Optional

from tf_checkpointing.planning._constants import CHUNKS as _CHUNKS
from tf_checkpointing.planning._constants import HEADROOM as _HEADROOM
from tf_checkpointing.planning._errors import BudgetTooLow, caller
from tf_checkpointing.planning.layer_graph._blocks import (
    BlockRef,
    block_layers,
    block_spans,
    inner_block_choices,
    named_block_spans,
    segment_spans,
    sublayers,
)
from tf_checkpointing.planning.layer_graph._frozen import warn_eager_frozen
from tf_checkpointing.planning.layer_graph._graph_choices import policy_arrays
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.measuring import _progress
from tf_checkpointing.planning.measuring._leave_no_trace import nothing_left
from tf_checkpointing.planning.measuring._modes import step_mode
from tf_checkpointing.planning.measuring._whole_step import StepReading
from tf_checkpointing.planning.plans._budget import LEAST, Budget
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
from tf_checkpointing.planning.solving._xla import (
    XlaAnchor,
    measure_plan,
    model_anchor,
    plan_within,
)
from tf_checkpointing.policies import reductions_saveable

__all__ = ["block_spans", "plan_graph"]

# The constants are explained where they are defined (planning/_constants.py).


def plan_graph(graph: LayerGraph, inputs: Any, budget: Budget, *, mode: str,
               runner: PlanRunner, policies: tuple[Any, ...] = ()) -> ModelPlan:
    """The plan for ``graph`` (profiled on ``inputs``) and a validated ``budget``,
    choosing among the (validated) save ``policies`` per region; an XLA plan is
    measured by running it with ``runner``. Every state the model owns is as it
    was before (see ``measuring._leave_no_trace``)."""
    assert graph.calls, "the API checks that the model has layer calls"
    plan = _plan(graph, inputs, budget, mode=mode, runner=runner, policies=policies)
    # What planning traced and ran is in reference cycles (functions, graphs) that
    # hold small buffers: collected now, or the caller's step would allocate next
    # to them, above the memory planning used (see docs/decisions/0042-shared-gradients.md).
    gc.collect()
    return plan


def _plan(graph: LayerGraph, inputs: Any, budget: Budget, *, mode: str,
          runner: PlanRunner, policies: tuple[Any, ...]) -> ModelPlan:
    with nothing_left(), _progress.planning(f"`{graph.model.name}`"):
        planning = _Planning.start(graph, inputs, None if budget == LEAST else int(budget),
                                   mode=mode, runner=runner, policies=policies)
        if planning.budget is None:
            return _least_plan(planning)
        return _budget_plan(planning, planning.budget)


class _Option(NamedTuple):
    """A plan the planner may choose: regions (with their policies' indices) and
    blocks inside calls checkpointed one by one."""

    solution: Solution
    blocks: tuple[BlockRef, ...] = ()


@dataclasses.dataclass
class _Planning:
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
              runner: PlanRunner, policies: tuple[Any, ...]) -> _Planning:
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
        for option, step in ((_Option(_PLAIN), StepReading(anchor.plain_bytes,
                                                           anchor.plain_seconds)),
                             (_Option(least), StepReading(anchor.least_bytes,
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

    def measure(self, option: _Option) -> int:
        """The peak of the step run by ``option``, measured (once per profile)."""
        return self.measured(option).peak_bytes

    def measured(self, option: _Option) -> StepReading:
        """The step run by ``option``, measured (once per profile)."""
        blocks = {"blocks": option.blocks} if option.blocks else {}
        return measured_step(self.key, (self.mode, _memo_key(option)), lambda: measure_plan(
            self.graph, self.inputs, self.runner, option.solution.spans,
            self.policies_of(option.solution.policies), mode=self.mode, **blocks))

    def replay_seconds(self, option: _Option) -> float:
        """The forward seconds ``option`` replays, in the profile's per-call unit:
        its regions' (under their policies), or the share of its blocks' calls
        that the blocks hold (see _step_time.block_work)."""
        if option.blocks:
            return block_work(self.graph, self.region_model.costs.cost, option.blocks)
        return self.region_model.extra_work(option.solution.spans, option.solution.policies)

    def selections(self) -> list[_Option]:
        """The plans a user could write, besides the planner's regions: the
        model's own blocks (``apply_checkpointing(model, [Block])``), at the top
        of the graph or inside its calls, its pieces between residual joins, and
        its blocks by layer-name prefix (``conv2_block1_*``). A region plan must
        not lose to them, so they are measured (see
        docs/decisions/0021-least-plan-against-the-blocks.md)."""
        options = []
        if self.mode != "eager":  # eager region plans are predicted from exact readings
            for spans in dict.fromkeys((block_spans(self.graph), segment_spans(self.graph),
                                        named_block_spans(self.graph))):
                if spans and spans != self.least.spans:
                    options.append(_Option(Solution(self.region_model.peak(spans), spans,
                                                    (NO_POLICY,) * len(spans))))
        return options + [_Option(_PLAIN, refs) for refs in self.inner]

    def min_budget(self) -> int:
        """The least budget accepted: the least peak of the least region plan
        (predicted) and of the selections (measured), plus the headroom."""
        least = min([self.predict(self.least.value),
                     *(self.measure(option) for option in self.selections())])
        return min(int(math.ceil(least / (1 - _HEADROOM))), self.plain_peak)

    def plan(self, option: _Option, predicted: Optional[float] = None) -> ModelPlan:
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


_PLAIN = Solution(0.0, (), ())


def _memo_key(option: _Option) -> tuple:
    """What a measured step depends on: regions, their policies, blocks."""
    policies = tuple(NO_POLICY if p is None else p for p in option.solution.policies)
    policies = policies if any(p != NO_POLICY for p in policies) else ()
    return option.solution.spans, policies, option.blocks


def _least_plan(planning: _Planning) -> ModelPlan:
    """The least memory: the least region plan, or, where the model repeats a
    block of its own, whichever of it and the blocks checkpointed one by one
    (``apply_checkpointing(model, [Block])``) measures lower: the model's errors
    can put its least plan there (see docs/decisions/0021-least-plan-against-the-blocks.md),
    and no region reaches the blocks inside a call."""
    least = planning.least
    if least.spans and planning.predict(planning.region_model.peak(
            least.spans, policies=least.policies)) >= planning.plain_peak:
        least = _PLAIN  # no better than plain (a model whose body is one call): plainly
    options = [_Option(least), *planning.selections()]
    if len(options) == 1:
        chosen, peak = options[0], None
    else:
        peaks = [planning.measure(option) for option in options]
        best = min(range(len(options)), key=lambda k: peaks[k])  # the first of equals
        chosen, peak = options[best], peaks[best]
    if not chosen.solution.spans and not chosen.blocks:
        _warn_nothing_to_save(planning)
    return planning.plan(chosen, predicted=peak)


def _warn_nothing_to_save(planning: _Planning) -> None:
    """Says that the least plan is the plain model, naming what the planner saw:
    the calls that run the most layers of their own (where a user's selection
    could still reach), or that every call is one layer."""
    graph = planning.graph
    holders = sorted(((len(sublayers(call.layer)), call) for call in graph.calls),
                     key=lambda item: -item[0])
    holders = [(n, call) for n, call in holders[:3] if n]
    if holders:
        seen = ", ".join(f"`{call.name}` ({type(call.layer).__name__}, {n} layers inside)"
                         for n, call in holders)
        where = (f"Its {len(graph.calls)} layer calls include {seen}, each run as one call, "
                 "with no block repeated inside that the planner could checkpoint. Select "
                 "layers inside them yourself: apply_checkpointing(model, [LayerClass]) "
                 "checkpoints every instance of a class, at any depth")
    else:
        where = (f"Its {len(graph.calls)} layer calls each keep about what their inputs "
                 "take, so a checkpoint, which keeps its inputs, saves nothing here")
    warnings.warn(
        f"{caller()}: budget='min' found no plan of `{graph.model.name}` below the plain "
        f"step's peak in {planning.mode} steps, so the model runs plainly. {where}.",
        UserWarning, stacklevel=2)


def _budget_plan(planning: _Planning, budget: int) -> ModelPlan:
    """The least recomputation whose predicted peak fits ``budget``: regions
    where they can fit it, else the blocks inside calls checkpointed one by one."""
    if budget >= planning.plain_peak:
        return planning.plan(_Option(_PLAIN))
    min_budget = planning.min_budget()
    if budget < min_budget:
        raise BudgetTooLow(  # the API the user called names itself (see planning._errors)
            "argument `budget` is below the least memory any plan of "
            f"`{planning.graph.model.name}` needs (its least predicted peak, plus "
            f"{_HEADROOM:.0%} for the allocator): expected at least {min_budget} bytes "
            f"({min_budget / 2**20:.2f} MiB), received budget={budget} "
            f"({budget / 2**20:.2f} MiB). Raise the budget, pass budget='min', or use a "
            "smaller batch.", budget=budget, least=min_budget)
    usable = budget * (1 - _HEADROOM)
    if planning.predict(planning.least.value) <= usable:
        found, measured = _regions_within(planning, usable)
        return planning.plan(_Option(found if found is not None else planning.least),
                             predicted=measured)
    # No region plan fits, a user's selection does: the one that keeps the most
    # (recomputes least).
    fitting = [(planning.measure(option), k, option)
               for k, option in enumerate(planning.selections())]
    peak, _, option = max(item for item in fitting if item[0] <= usable)
    return planning.plan(option, predicted=peak)


def _regions_within(planning: _Planning, usable: float) -> tuple[Optional[Solution],
                                                                Optional[int]]:
    """The region plan with least recomputation for ``usable`` bytes, and its
    measured peak (XLA) or None."""
    model = planning.region_model
    if planning.anchor is None:
        # Chosen with the least plan's factor, predicted with the plan's own:
        # the gap is a margin for the model's errors (see docs/decisions/0019-chunk-factor.md).
        return solve(model, usable / planning.chunks, nested=planning.nested), None

    def solve_for(limit: float) -> Optional[Solution]:
        got = solve(model, limit, nested=planning.nested)
        return None if got is None else got._replace(
            value=model.peak(got.spans, policies=got.policies))

    # Chosen on the measured curve, and measured (see _xla.plan_within).
    found, measured, planning.anchor = plan_within(
        planning.key, planning.anchor, usable, solve_for,
        lambda spans, chosen: planning.measure(_Option(Solution(0.0, spans, chosen))))
    return found, measured


def chunk_factor(model_bytes: float, plain_bytes: float, least_bytes: float,
                 chunks: float = _CHUNKS) -> float:
    """The allocator's chunks over the tensors, for a plan whose model peak is
    ``model_bytes``: ``chunks`` at the least plan's peak (and below), falling in
    proportion to the bytes the plan saves to 1 at plain's, whose chunks the
    profile was calibrated on. The predicted peak; plans are chosen with
    ``chunks`` itself (a margin). Falling, because a fixed factor counted the
    chunks of a plan that runs most of the model plainly twice (see
    docs/decisions/0019-chunk-factor.md).

        >>> from tf_checkpointing.planning.solving._model_planner import chunk_factor
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
