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
from typing import Any, Optional, Union

import tensorflow as tf

from tf_checkpointing._seeding import random_state_kept
from tf_checkpointing.planning._allocator import in_xla_context
from tf_checkpointing.planning._chain import _expect_budget
from tf_checkpointing.planning._choices import expect_policies
from tf_checkpointing.planning._frozen import warn_eager_frozen
from tf_checkpointing.planning._graph import LayerGraph, read_graph
from tf_checkpointing.planning._graph_choices import policy_arrays
from tf_checkpointing.planning._model_profile import (
    cached_choices,
    cached_profile,
    calibrated,
    profile_key,
)
from tf_checkpointing.planning._plan import ModelPlan
from tf_checkpointing.planning._region_solver import nested_options, solve
from tf_checkpointing.planning._xla import (
    measure_plan,
    model_anchor,
    plan_within,
)
from tf_checkpointing.policies import reductions_saveable

__all__ = ["ModelPlan", "plan_model"]

_API = "plan_model"
_HEADROOM = 0.10
# A tf.function step's allocator peak over its tensors' (the model's) peak, for the
# least plan. The BFC allocator splits a free chunk only when it is at least twice
# the request, so tensors occupy larger chunks; measured with the allocator's own
# events in fresh processes, the chunks of 19 checkpointed plans of the four
# benchmark models peaked 1.00-1.27x their tensors (GPT2Backbone 1.00-1.07, ResNet50
# 1.08-1.17 on its budget plans, MobileNetV2 up to 1.22, the U-Net's least plan
# 1.27); the middle of that range is the expected peak. The ratio moves by run too:
# a later run measured the same MobileNetV2 least plan at 1.33x. Plans are chosen
# with it; a plan between the least and plain is predicted with less of it (see
# chunk_factor): the plain step's chunks are what the profile was calibrated on.
# (XLA's one buffer is its own size: no factor.)
_CHUNKS = 1.10
_MODES = ("auto", "eager", "graph", "xla")
Budget = Union[int, float, str]


def plan_model(model: Any, inputs: Any, *, budget: Budget, mode: str = "auto",
               policies: Any = None) -> ModelPlan:
    """Plans which regions of a functional model to checkpoint for a memory budget.

    Reads the model's layer graph (functional models, ``keras.Sequential``, and
    functional models nested in them as layers), profiles each layer call on
    ``inputs`` with the device allocator (the state the layers change is put
    back), and picks the regions of consecutive calls to run checkpointed,
    with the least recomputation whose predicted peak fits ``budget`` (see
    :mod:`tf_checkpointing.planning._regions` for the algorithm). The model is
    not changed: pass the plan to ``apply_checkpointing(model, plan=plan)``.

    A region of a ``tf.function`` or XLA plan may be replayed under a save
    policy: it keeps what the policy picks inside it besides its inputs, and
    its replay skips those ops. ``policies.reductions_saveable`` is always
    offered: it keeps the results of reductions (a BatchNorm's batch mean and
    variance, a LayerNorm's), which cost almost no memory, and spares the
    replay the passes over the input that made them (the benchmark U-Net's
    halfway plan took 1.25x plain replaying them, 1.13x keeping them).
    ``policies`` offers more. Each distinct layer call that a policy keeps
    something of is measured under each policy (bytes kept, and its training
    step timed as the chain planner times its layers), and the program picks
    per region the fastest replay that fits; in eager mode a policy keeps
    nothing, so every region replays fully there.

    Args:
        model: a built functional or Sequential Keras model.
        inputs: a batch of its inputs at the training batch size.
        budget: bytes a training step may allocate above what is allocated
            before it (weights, inputs), or ``"min"`` for the least memory.
        mode: how the step runs: ``"eager"``, ``"graph"`` (``tf.function``,
            ``Model.fit``), ``"xla"`` (``jit_compile=True``), or ``"auto"``:
            ``"xla"`` or ``"graph"`` while such a function is traced, else
            ``"eager"``.
        policies: more save policies a region may be replayed under, besides
            ``policies.reductions_saveable``: None (the default: none more),
            ``"auto"`` (``policies.dots_saveable`` and
            ``policies.dots_with_no_batch_dims_saveable``), or a list of
            policies in which ``"auto"`` stands for those two, as for
            :func:`plan_sequential`.

    Returns:
        A :class:`ModelPlan`.

    Raises:
        ValueError: the budget is below the least any plan needs (the message
            gives it), or the model's graph cannot be read.
        TypeError: ``policies`` is not None, ``"auto"`` or a list of policies.

    Example (with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing import plan_model
        >>> x = keras.Input((32,))
        >>> h = x
        >>> for _ in range(6):
        ...     h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
        >>> model = keras.Model(x, keras.layers.Dense(1)(h))
        >>> plan = plan_model(model, tf.random.normal([256, 32]), budget="min")
        >>> plan.predicted_peak_bytes <= plan.plain_peak_bytes
        True
    """
    if mode not in _MODES:
        raise ValueError(
            f"{_API}: argument `mode` must be one of {', '.join(map(repr, _MODES))}; "
            f"received mode={mode!r}. Pass mode='graph' for a tf.function or Model.fit "
            "step, mode='xla' for jit_compile=True, mode='eager' for an eager step."
        )
    budget_bytes = expect_model_budget(budget, _API)
    candidates = expect_policies(policies, _API)
    graph = read_graph(model, _API)
    return plan_graph(graph, inputs, budget_bytes, mode=mode, api=_API, policies=candidates)


def expect_model_budget(budget: Any, api: str) -> Optional[int]:
    """``budget`` in bytes, or None for ``"min"``."""
    if isinstance(budget, str):
        if budget == "min":
            return None
        raise ValueError(
            f"{api}: argument `budget` must be a number of bytes or 'min'; received "
            f"budget={budget!r}. Pass e.g. budget=512 * 2**20, or budget='min' for the "
            "least memory."
        )
    return int(_expect_budget(budget, api))  # "min" was handled above


def plan_graph(graph: LayerGraph, inputs: Any, budget: Optional[int], *, mode: str,
               api: str, policies: tuple[Any, ...] = ()) -> ModelPlan:
    """The plan for ``graph`` (profiled on ``inputs``) and ``budget`` (None: least),
    choosing among the (validated) save ``policies`` per region. The random
    state the layers draw from is as it was before (see ``random_state_kept``)."""
    _expect_layer_calls(graph, api)
    with random_state_kept():
        return _plan_graph(graph, inputs, budget, mode=mode, api=api, policies=policies)


def _plan_graph(graph: LayerGraph, inputs: Any, budget: Optional[int], *, mode: str,
                api: str, policies: tuple[Any, ...]) -> ModelPlan:
    mode = step_mode(mode)
    if mode == "eager":  # a policy keeps nothing in eager mode: no choice
        policies = ()
        warn_eager_frozen(graph, api)
    else:
        policies = with_reductions(policies)
    profile, costs = cached_profile(graph, inputs, mode, api)
    if policies:
        choices = cached_choices(graph, inputs, mode, api, policies)
        kept, cost = policy_arrays(choices, costs.kept, costs.cost)
        costs = dataclasses.replace(costs, policy_kept=kept, policy_cost=cost)
    region_model = calibrated(costs, profile.plain_peak_bytes)
    nested = nested_options(region_model)
    least = solve(region_model, None, nested=nested, with_policies=True)
    assert least is not None  # every call alone, checkpointed or not, is a plan
    plain_peak = profile.plain_peak_bytes
    # For XLA, the model's peaks are mapped onto two measured XLA steps (see _xla).
    key = profile_key(graph, inputs, mode)
    model_plain = region_model.peak(())
    anchor = None if mode != "xla" else model_anchor(
        key, graph, inputs, least[1], model_least=least[0],
        model_plain=model_plain, plain_bytes=profile.plain_peak_bytes, api=api)
    chunks = _CHUNKS if mode == "graph" else 1.0

    def predict(model_bytes: float, checkpointed: bool = True) -> float:
        # The plain step's chunks are what the profile calibrated on: no factor.
        if anchor is not None:
            return anchor.predict(model_bytes)
        if not checkpointed:
            return model_bytes
        return model_bytes * chunk_factor(model_bytes, model_plain, least[0], chunks)

    helps = anchor is None or anchor.helps
    least_spans, least_chosen = (least[1], least[2]) if helps else ((), ())
    min_peak = int(math.ceil(predict(least[0]) / (1 - _HEADROOM)))
    names = tuple(call.name for call in graph.calls)
    plan = ModelPlan(call_names=names, call_kinds=graph.kinds(), spans=(), mode=mode,
                     budget_bytes=budget,
                     predicted_peak_bytes=int(predict(model_plain, False)),
                     plain_peak_bytes=plain_peak, min_budget_bytes=min(min_peak, plain_peak),
                     policies=policies, predicted_extra_seconds=0.0)
    measured: Optional[int] = None
    if budget is None:
        spans, chosen = least_spans, least_chosen
        if spans and predict(region_model.peak(spans, policies=chosen)) >= plain_peak:
            # The least plan is no better than plain (a model whose body is one
            # layer call, as keras_hub's ViTBackbone's encoder): run it plainly.
            spans, chosen = (), ()
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
            # the gap is a margin for the model's errors (a U-Net plan chosen with
            # the plan's own factor had tensors 10% above the model and peaked at
            # 1.09x its budget; the least plan's factor kept every plan within).
            found = solve(region_model, usable / chunks, nested=nested, with_policies=True)
        else:  # chosen on the measured curve, and measured (see _xla.plan_within)
            def solve_for(limit: float) -> Optional[tuple]:
                got = solve(region_model, limit, nested=nested, with_policies=True)
                return None if got is None else (
                    region_model.peak(got[1], policies=got[2]), got[1], got[2])

            found, anchor = plan_within(key, anchor, usable, solve_for, lambda spans, chosen:
                                        measure_plan(graph, inputs, api, spans, tuple(
                                            policies[p] if p >= 0 else None for p in chosen)))
        spans, chosen = ((found[1], found[2]) if found is not None
                         else (least_spans, least_chosen))
        if found is not None and len(found) > 3:
            measured = found[3]  # this very plan's XLA step, measured
    return dataclasses.replace(
        plan, spans=spans,
        predicted_peak_bytes=int(measured if measured is not None else predict(
            region_model.peak(spans, policies=chosen), bool(spans))),
        region_policies=tuple(policies[p] if p >= 0 else None for p in chosen)
        if policies else (),
        predicted_extra_seconds=region_model.extra_work(spans, chosen))


def chunk_factor(model_bytes: float, plain_bytes: float, least_bytes: float,
                 chunks: float = _CHUNKS) -> float:
    """The allocator's chunks over the tensors, for a plan whose model peak is
    ``model_bytes``: ``chunks`` at the least plan's peak (and below), falling in
    proportion to the bytes the plan saves to 1 at plain's, whose chunks the
    profile was calibrated on. The predicted peak; plans are chosen with
    ``chunks`` itself (a margin). A fixed factor counted the chunks of a plan
    that runs most of the model plainly twice: the benchmark U-Net's plan at 75%
    of the way to plain was predicted 12% above its median peak (its chunks held
    its tensors within 3%), and its plans at 65-90% of the way 8-15% above.

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
    that made them (the U-Net's halfway plan: 1.25x plain replaying them, 1.13x
    keeping them; ResNet50's: 1.13x and 1.03x; measured 2026-11-25)."""
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


def step_mode(mode: str) -> str:
    """``"auto"`` resolved: ``"xla"`` while a ``jit_compile=True`` function is
    traced, ``"graph"`` while another ``tf.function`` is, else ``"eager"``."""
    if mode != "auto":
        return mode
    if not tf.inside_function():
        return "eager"
    return "xla" if in_xla_context() else "graph"
