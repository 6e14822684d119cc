"""``plan_model``: where the checkpoints of a whole functional model go, for a budget.

The model's layer graph (:mod:`..layer_graph._layer_graph`) is profiled as a chain of states
(:mod:`._model_profile`), and the regions are chosen by the program of
:mod:`._regions`; what planning knows of one model is a :class:`._planning.Planning`.
This module chooses: the least plan, or the least recomputation that fits the
budget, and says what the budget must be at least. The plan type is
:class:`~tf_checkpointing.planning.plans._plan.ModelPlan`.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Optional

from tf_checkpointing.planning._errors import BudgetTooLow, caller
from tf_checkpointing.planning.layer_graph._blocks import sublayers
from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph
from tf_checkpointing.planning.measuring import _progress
from tf_checkpointing.planning.measuring._leave_no_trace import nothing_left
from tf_checkpointing.planning.plans._budget import (
    LEAST,
    Budget,
    below_least,
    model_headroom,
    plain_fits,
)
from tf_checkpointing.planning.plans._plan import ModelPlan, PlanRunner
from tf_checkpointing.planning.solving._planning import PLAIN, Option, Planning
from tf_checkpointing.planning.solving._region_solver import Solution
from tf_checkpointing.planning.solving._xla import plan_within

__all__ = ["plan_graph"]

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
        planning = Planning.start(graph, inputs, None if budget == LEAST else int(budget),
                                  mode=mode, runner=runner, policies=policies)
        if planning.budget is None:
            return _least_plan(planning)
        return _budget_plan(planning, planning.budget)


def _least_plan(planning: Planning, *, warn: bool = True) -> ModelPlan:
    """The least memory: the least region plan, or, where the model repeats a
    block of its own, whichever of it and the blocks checkpointed one by one
    (``apply_checkpointing(model, [Block])``) measures lower: the model's errors
    can put its least plan there (see docs/decisions/0021-least-plan-against-the-blocks.md),
    and no region reaches the blocks inside a call. ``warn``: say so where the least
    plan is the plain model (not for a budget in bytes within the slack below the
    least, which the plain step is taken to fit, as a budget above it would)."""
    least = planning.least
    if least.spans and planning.predict(planning.region_model.peak(
            least.spans, policies=least.policies)) >= planning.plain_peak:
        least = PLAIN  # no better than plain (a model whose body is one call): plainly
    options = [Option(least), *planning.selections()]
    if len(options) == 1:
        chosen, peak = options[0], None
    else:
        peaks = [planning.measure(option) for option in options]
        best = min(range(len(options)), key=lambda k: peaks[k])  # the first of equals
        chosen, peak = options[best], peaks[best]
    if warn and not chosen.solution.spans and not chosen.blocks:
        _warn_nothing_to_save(planning)
    return planning.plan(chosen, predicted=peak)


def _warn_nothing_to_save(planning: Planning) -> None:
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


def _budget_plan(planning: Planning, budget: int) -> ModelPlan:
    """The least recomputation whose predicted peak fits ``budget``: regions
    where they can fit it, else the blocks inside calls checkpointed one by one."""
    if plain_fits(budget, planning.plain_peak, planning.mode):
        return planning.plan(Option(PLAIN))
    min_budget = planning.min_budget()
    headroom = model_headroom(planning.mode)
    if below_least(budget, min_budget):
        raise BudgetTooLow(  # the API the user called names itself (see planning._errors)
            "argument `budget` is below the least memory any plan of "
            f"`{planning.graph.model.name}` needs (its least predicted peak, plus "
            f"{headroom:.0%} kept free): expected at least {min_budget} bytes "
            f"({min_budget / 2**20:.2f} MiB), received budget={budget} "
            f"({budget / 2**20:.2f} MiB). Raise the budget, pass budget='min', or use a "
            "smaller batch.", budget=budget, least=min_budget)
    if budget < min_budget:
        # Within the slack below the least (another process's reading of it): the
        # least plan, which fits such a budget with most of the headroom.
        return _least_plan(planning, warn=False)
    usable = budget * (1 - headroom)
    if planning.predict(planning.least.value) <= usable:
        found, measured = _regions_within(planning, usable)
        return planning.plan(Option(found if found is not None else planning.least),
                             predicted=measured)
    # No region plan fits, a user's selection does: the one that keeps the most
    # (recomputes least).
    measured = [(planning.measure(option), k, option)
                for k, option in enumerate(planning.selections())]
    fitting = [item for item in measured if item[0] <= usable]
    if not fitting:
        # Only above plain's peak, where the least budget is plain's own (no plan
        # keeps less with the headroom) and plain does not fit it with the headroom
        # (see plain_fits): plain, which keeps no more than the least plan.
        return planning.plan(Option(PLAIN))
    peak, _, option = max(fitting)
    return planning.plan(option, predicted=peak)


def _regions_within(planning: Planning, usable: float) -> tuple[Optional[Solution],
                                                                Optional[int]]:
    """The region plan with least recomputation for ``usable`` bytes, and its
    measured peak (XLA) or None."""
    model = planning.region_model
    if planning.anchor is None:
        # Chosen with the least plan's factor, predicted with the plan's own:
        # the gap is a margin for the model's errors (see docs/decisions/0019-chunk-factor.md).
        return planning.solve(usable / planning.chunks), None

    def solve_for(limit: float) -> Optional[Solution]:
        got = planning.solve(limit)
        return None if got is None else got._replace(
            value=model.peak(got.spans, policies=got.policies))

    # Chosen on the measured curve, and measured (see _xla.plan_within).
    found, measured, planning.anchor = plan_within(
        planning.key, planning.anchor, usable, solve_for,
        lambda spans, chosen: planning.measure(Option(Solution(0.0, spans, chosen))),
        work=model.extra_work)
    return found, measured
