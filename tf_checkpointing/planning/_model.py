"""``plan_model``: where the checkpoints of a whole functional model go, for a budget.

The model's layer graph (:mod:`._graph`) is profiled as a chain of states
(:mod:`._model_profile`), and the regions are chosen by the program of
:mod:`._regions`. This module is the glue: it turns the model's peaks into
predicted step peaks (the allocator's chunk factor, or XLA's measured anchor),
picks the plan for the budget, and says what the budget must be at least. The
plan type is :class:`~tf_checkpointing.planning._plan.ModelPlan`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any, Optional

from tf_checkpointing.planning import _progress
from tf_checkpointing.planning._budget import LEAST, Budget
from tf_checkpointing.planning._constants import CHUNKS as _CHUNKS
from tf_checkpointing.planning._constants import HEADROOM as _HEADROOM
from tf_checkpointing.planning._frozen import warn_eager_frozen
from tf_checkpointing.planning._graph import LayerGraph
from tf_checkpointing.planning._graph_choices import policy_arrays
from tf_checkpointing.planning._model_profile import (
    cached_choices,
    cached_profile,
    calibrated,
    profile_key,
)
from tf_checkpointing.planning._modes import step_mode
from tf_checkpointing.planning._no_trace import nothing_left
from tf_checkpointing.planning._plan import ModelPlan, pieces_of_spans
from tf_checkpointing.planning._region_solver import NO_POLICY, Solution, nested_options, solve
from tf_checkpointing.planning._runner import PlanRunner
from tf_checkpointing.planning._xla import (
    measure_plan,
    model_anchor,
    plan_within,
)
from tf_checkpointing.policies import reductions_saveable

__all__ = ["plan_graph"]

# The constants are explained where they are defined (planning/_constants.py).


def plan_graph(graph: LayerGraph, inputs: Any, budget: Budget, *, mode: str, api: str,
               runner: PlanRunner, policies: tuple[Any, ...] = ()) -> ModelPlan:
    """The plan for ``graph`` (profiled on ``inputs``) and a validated ``budget``,
    choosing among the (validated) save ``policies`` per region; an XLA plan is
    measured by running it with ``runner``. Every state the model owns is as it
    was before (see ``_no_trace``)."""
    _expect_layer_calls(graph, api)
    with nothing_left(), _progress.planning(api, f"`{graph.model.name}`"):
        return _plan_graph(graph, inputs, None if budget == LEAST else int(budget), mode=mode,
                           api=api, runner=runner, policies=policies)


def _plan_graph(graph: LayerGraph, inputs: Any, budget: Optional[int], *, mode: str,
                api: str, runner: PlanRunner, policies: tuple[Any, ...]) -> ModelPlan:
    mode = step_mode(mode)
    if mode == "eager":  # a policy keeps nothing in eager mode: no choice
        policies = ()
        warn_eager_frozen(graph, api)
    else:
        policies = with_reductions(policies)
    blocks = block_spans(graph)
    # The least plan for an XLA step compiles no step to be made, unless the model
    # repeats a block of its own (both plans are then measured, below): it is the
    # tf.function profile's, and so are its numbers (see
    # docs/decisions/0024-least-plans-under-xla.md).
    measured = "graph" if mode == "xla" and budget is None and not blocks else mode
    profile, costs = cached_profile(graph, inputs, measured, api)
    if policies:
        choices = cached_choices(graph, inputs, measured, api, policies)
        kept, cost = policy_arrays(choices, costs.kept, costs.cost)
        costs = dataclasses.replace(costs, policy_kept=kept, policy_cost=cost)
    region_model = calibrated(costs, profile.plain_peak_bytes)
    nested = nested_options(region_model)
    least = solve(region_model, None, nested=nested)
    assert least is not None  # every call alone, checkpointed or not, is a plan
    plain_peak = profile.plain_peak_bytes
    # For XLA, the model's peaks are mapped onto two measured XLA steps (see _xla).
    key = profile_key(graph, inputs, measured)
    model_plain = region_model.peak(())
    anchor = None if measured != "xla" else model_anchor(
        key, graph, inputs, least.spans, runner, model_least=least.value,
        model_plain=model_plain, plain_bytes=profile.plain_peak_bytes, api=api)
    chunks = _CHUNKS if measured == "graph" else 1.0

    def predict(model_bytes: float, checkpointed: bool = True) -> float:
        # The plain step's chunks are what the profile calibrated on: no factor.
        if anchor is not None:
            return anchor.predict(model_bytes)
        if not checkpointed:
            return model_bytes
        return model_bytes * chunk_factor(model_bytes, model_plain, least.value, chunks)

    def policies_of(chosen: tuple[int, ...]) -> tuple[Any, ...]:
        return tuple(None if p == NO_POLICY else policies[p] for p in chosen)

    if anchor is not None and not anchor.helps:
        least = Solution(least.value, (), ())
    min_peak = int(math.ceil(predict(least.value) / (1 - _HEADROOM)))
    names = tuple(call.name for call in graph.calls)
    plan = ModelPlan(names=names, call_kinds=graph.kinds(),
                     pieces=pieces_of_spans(0, len(names), ()), mode=mode,
                     budget_bytes=LEAST if budget is None else budget,
                     predicted_peak_bytes=int(predict(model_plain, False)),
                     plain_peak_bytes=plain_peak, min_budget_bytes=min(min_peak, plain_peak),
                     policies=policies, predicted_extra_seconds=0.0,
                     predicted_for=None if measured == mode else measured)
    measured_bytes: Optional[int] = None
    chosen = least
    if budget is None:
        if least.spans and predict(region_model.peak(least.spans,
                                                     policies=least.policies)) >= plain_peak:
            # The least plan is no better than plain (a model whose body is one
            # layer call, as keras_hub's ViTBackbone's encoder): run it plainly.
            chosen = Solution(least.value, (), ())
        if mode != "eager" and blocks and blocks != chosen.spans:
            # Never above the selection a user would write, apply_checkpointing(model,
            # [Block]): the model's errors can put its least plan there (see
            # docs/decisions/0021-least-plan-against-the-blocks.md). Both are measured.
            ours = measure_plan(graph, inputs, api, runner, chosen.spans,
                                policies_of(chosen.policies), mode=mode)
            theirs = measure_plan(graph, inputs, api, runner, blocks, mode=mode)
            if theirs < ours:
                chosen = Solution(region_model.peak(blocks), blocks, (NO_POLICY,) * len(blocks))
            measured_bytes = min(ours, theirs)
    elif budget >= plain_peak:
        return plan
    elif budget < plan.min_budget_bytes:
        raise ValueError(
            f"{api}: argument `budget` is below the least memory any plan of "
            f"`{graph.model.name}` needs (its least predicted peak, plus {_HEADROOM:.0%} "
            f"for the allocator): expected at least {plan.min_budget_bytes} bytes "
            f"({plan.min_budget_bytes / 2**20:.2f} MiB), received budget={budget} "
            f"({budget / 2**20:.2f} MiB). Raise the budget, pass budget='min', or use a "
            "smaller batch."
        )
    else:
        usable = budget * (1 - _HEADROOM)
        if anchor is None:
            # Chosen with the least plan's factor, predicted with the plan's own:
            # the gap is a margin for the model's errors (see docs/decisions/0019-chunk-factor.md).
            found = solve(region_model, usable / chunks, nested=nested)
        else:  # chosen on the measured curve, and measured (see _xla.plan_within)
            def solve_for(limit: float) -> Optional[Solution]:
                got = solve(region_model, limit, nested=nested)
                return None if got is None else got._replace(
                    value=region_model.peak(got.spans, policies=got.policies))

            found, measured_bytes, anchor = plan_within(
                key, anchor, usable, solve_for,
                lambda spans, chosen: measure_plan(graph, inputs, api, runner, spans,
                                                   policies_of(chosen)))
        chosen = found if found is not None else least
    spans = chosen.spans
    return dataclasses.replace(
        plan, pieces=pieces_of_spans(0, len(names), spans, policies_of(chosen.policies)),
        predicted_peak_bytes=int(measured_bytes if measured_bytes is not None else predict(
            region_model.peak(spans, policies=chosen.policies), bool(spans))),
        predicted_extra_seconds=region_model.extra_work(spans, chosen.policies))


def block_spans(graph: LayerGraph) -> tuple:
    """Each call of the model's repeated block as a region of its own: the calls
    of the most frequent layer class with weights that Keras does not define
    (a transformer's decoder block), if it is called at least twice; else ().
    What ``apply_checkpointing(model, [Block])`` runs.

        >>> import keras
        >>> from tf_checkpointing.planning._graph import read_graph
        >>> from tf_checkpointing.planning._model import block_spans
        >>> class Block(keras.layers.Dense): pass
        >>> x = keras.Input((4,))
        >>> model = keras.Model(x, Block(4)(keras.layers.Dense(4)(Block(4)(x))))
        >>> block_spans(read_graph(model, "doc"))
        ((0, 1, ()), (2, 3, ()))
    """
    counts = Counter(type(call.layer) for call in graph.calls
                     if getattr(call.layer, "weights", None)
                     and not type(call.layer).__module__.startswith("keras."))
    if not counts:
        return ()
    block, n = counts.most_common(1)[0]
    if n < 2:
        return ()
    return tuple((i, i + 1, ()) for i, call in enumerate(graph.calls) if type(call.layer) is block)


def chunk_factor(model_bytes: float, plain_bytes: float, least_bytes: float,
                 chunks: float = _CHUNKS) -> float:
    """The allocator's chunks over the tensors, for a plan whose model peak is
    ``model_bytes``: ``chunks`` at the least plan's peak (and below), falling in
    proportion to the bytes the plan saves to 1 at plain's, whose chunks the
    profile was calibrated on. The predicted peak; plans are chosen with
    ``chunks`` itself (a margin). Falling, because a fixed factor counted the
    chunks of a plan that runs most of the model plainly twice (see
    docs/decisions/0019-chunk-factor.md).

        >>> from tf_checkpointing.planning._model import chunk_factor
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


def _expect_layer_calls(graph: LayerGraph, api: str) -> None:
    """Raises if ``graph`` has no layer call: a model that returns its inputs
    (``keras.Model(i, i)``) has no region to checkpoint, and the profile of an
    empty chain has nothing to measure (it used to fail with an IndexError).
    Checked before any profiling, so the message comes first and at once."""
    if graph.calls:
        return
    raise ValueError(
        f"{api}: `{graph.model.name}` has no layer calls between its inputs and its "
        "outputs (e.g. keras.Model(inputs, inputs) returns its inputs), so there is "
        "nothing to checkpoint; received a model with 0 layer calls. Train "
        "it without apply_checkpointing / plan_model, or pass a model that calls "
        "layers on its inputs."
    )
