"""Every argument of ``apply_checkpointing``, checked once, before the model changes.

One call (``apply_checkpointing(model, budget="min")``, then the first ``fit``
step) used to be checked in four files: the selection in ``_keras``, the plan,
the budget and the planner's options in ``_whole_model``, the model's graph and
the plan's fit in the plan maker, and whether the model has any layer call inside
the first training step. A newcomer could not tell which check owns an argument,
and a model the planner cannot use was refused only inside ``fit``. Here each
argument is checked once, where the user passes it, in the order the arguments
are read: the model, which of ``select`` / ``budget`` / ``plan`` is given, the
options that go with it, then what the model must have for it (a layer graph, a
plan made for it, layer calls to checkpoint). What comes after (the runner, the
plan maker, planning) takes the checked values and refuses nothing of the user's
but what only a measurement can tell (a budget below the least plan).
"""

from __future__ import annotations

import os
import reprlib
from typing import Any, NamedTuple, Optional

import keras

from tf_checkpointing.planning._errors import PlanningValueError, worded
from tf_checkpointing.planning.layer_graph._blocks import sublayers
from tf_checkpointing.planning.layer_graph._layer_graph import (
    LayerGraph,
    read_graph,
)
from tf_checkpointing.planning.measuring._allocator import expect_statistics
from tf_checkpointing.planning.measuring._choices import expect_policies
from tf_checkpointing.planning.plans._budget import Budget, below_least, expect_budget
from tf_checkpointing.planning.plans._plan import ModelPlan
from tf_checkpointing.planning.plans._plan_files import expect_folder
from tf_checkpointing.planning.plans._reuse import plans_made_ahead

__all__: list[str] = []

_API = "apply_checkpointing"


class WholeModel(NamedTuple):
    """The checked arguments of ``apply_checkpointing(model, budget=...)`` or
    ``plan=``: the model's layer graph, and the plan or the budget to plan for."""

    graph: LayerGraph
    plan: Optional[ModelPlan]
    budget: Optional[Budget]
    policies: tuple[Any, ...]
    plan_cache: Any


def expect_arguments(model: Any, select: Any, *, budget: Any, plan: Any, policy: Any,
                     policies: Any, plan_cache: Any) -> Optional[WholeModel]:
    """Checks every argument of one ``apply_checkpointing`` call; returns them
    checked for ``budget`` / ``plan`` (None with ``select``, whose layers
    ``_keras`` then chooses, naming what it cannot find)."""
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"{_API}: argument `model` must be a Keras model or layer; "
            f"received {model!r} of type {type(model).__name__}. Pass the model "
            f"object, e.g. {_API}(model, ['block_1'])."
        )
    given = [name for name, value in (("select", select), ("budget", budget), ("plan", plan))
             if value is not None]
    if len(given) != 1:
        raise TypeError(
            f"{_API}: pass exactly one of `select`, `budget` and `plan`; "
            f"received {', '.join(given) or 'none of them'}. Pass e.g. "
            f"{_API}(model, budget='min') to let the library choose, or "
            f"{_API}(model, ['block_1']) to choose layers."
        )
    if select is not None:
        _expect_no_planner_options(plan_cache, policies)
        return None
    if policy is not None:
        raise TypeError(
            f"{_API}: argument `policy` (one save policy for chosen layers) "
            f"cannot be combined with `budget` or `plan`; received policy={policy!r} "
            f"with {given[0]}. To let the planner choose a save policy per region, pass "
            "policies=[...] (or policies='auto') with budget=...; or select=[...] with "
            "policy=... for a save policy on chosen layers."
        )
    with worded(_API):
        return _expect_whole_model(model, budget=budget, plan=plan, policies=policies,
                                   plan_cache=plan_cache)


def _expect_no_planner_options(plan_cache: Any, policies: Any) -> None:
    """Raises for the planner's options (``plan_cache``, ``policies``) given with
    ``select``."""
    if plan_cache is not None:
        raise TypeError(
            f"{_API}: argument `plan_cache` keeps the plans made for a "
            f"`budget`, but layers were chosen with `select`; received plan_cache="
            f"{plan_cache!r} with select. Pass budget=... with plan_cache=..., or drop it.")
    if policies is not None:
        raise TypeError(
            f"{_API}: argument `policies` is for the planner (with `budget`), "
            f"but layers were chosen with `select`; received policies={policies!r} with "
            "select. Pass policy=... for one save policy on the chosen layers, or "
            "budget=... with policies=... to let the planner choose per region."
        )


def _expect_whole_model(model: Any, *, budget: Any, plan: Any, policies: Any,
                        plan_cache: Any) -> WholeModel:
    """The checks of ``budget=`` / ``plan=`` and their options (inside
    ``worded``: planning's validators raise typed errors it words)."""
    _expect_plan_type(plan)
    candidates = expect_policies(policies)
    if plan is not None and candidates:
        raise TypeError(
            f"{_API}: argument `policies` chooses save policies while planning for a "
            f"budget, but a plan was given (its regions' policies are in it); received "
            f"policies={policies!r} with plan. Pass plan_model(model, inputs, budget=..., "
            "policies=...) as plan=, or budget=... with policies=..."
        )
    checked = None if plan is not None else expect_budget(budget)
    folder = isinstance(plan_cache, (str, os.PathLike))
    if plan_cache is not None and (checked is None or not folder):
        raise TypeError(
            f"{_API}: argument `plan_cache` must be a folder (a str or os.PathLike) given "
            f"with `budget`; received plan_cache={plan_cache!r}"
            f"{' with plan' if checked is None else ''}. Pass e.g. budget='min', "
            "plan_cache='plans/' (a plan given as plan= is saved with plan.to_config()).")
    if checked is not None:
        expect_statistics()
        _refuse_what_plans_made_ahead_rule_out(model, checked, candidates)
    if plan_cache is not None:
        expect_folder(plan_cache)
    graph = read_graph(model)
    if plan is not None:
        _expect_plan_fits(plan, graph)
    else:
        expect_layer_calls(graph)  # else the first training step would find none
    return WholeModel(graph, plan, checked, candidates, plan_cache)


def _expect_plan_type(plan: Any) -> None:
    """Refuses a ``plan`` that is not a :class:`ModelPlan` (a plan's config, say)."""
    if isinstance(plan, dict):  # a plan's config, as saved with plan.to_config()
        raise TypeError(
            f"{_API}: argument `plan` must be a ModelPlan; received a dict (a plan's "
            f"config, with keys {sorted(plan)[:6]}...). Fix: pass "
            "ModelPlan.from_config(config), e.g. apply_checkpointing(model, "
            "plan=tf_checkpointing.ModelPlan.from_config(json.load(file))).")
    if plan is not None and not isinstance(plan, ModelPlan):
        raise TypeError(
            f"{_API}: argument `plan` must be a ModelPlan from plan_model; received "
            f"{reprlib.repr(plan)} of type {type(plan).__name__}. Make one with "
            "plan_model(model, inputs, budget=...)."
        )


def _refuse_what_plans_made_ahead_rule_out(model: Any, budget: Any,
                                           policies: tuple) -> None:
    """Refuses a budget of bytes below the least that ``plan_model`` found for
    ``model`` (with these policies) in the mode its compiled step runs in (any
    mode planned, when it is not compiled yet): it cannot be met, and would be
    refused inside the first training step, after that step's planning."""
    if not isinstance(budget, int):
        return
    mode = _compiled_mode(model)
    known = [(plan.min_budget_bytes, made_for, specs)
             for made_for, specs, plan in plans_made_ahead(model, policies)
             if plan.min_budget_bytes and (mode is None or made_for == mode)]
    if not known or not below_least(budget, min(least for least, _, _ in known)):
        return
    least, made_for, specs = min(known, key=lambda item: item[0])
    shapes = ", ".join(str(tuple(spec.shape)) for spec in specs)
    raise ValueError(
        f"{_API}: argument `budget` is below the least memory any plan of `{model.name}` "
        f"needs in {made_for} steps, as plan_model found it on inputs of shape {shapes}: "
        f"expected at least {least} bytes ({least / 2**20:.2f} MiB), received "
        f"budget={budget} ({budget / 2**20:.2f} MiB). Fix: pass budget={least} or more, "
        "or budget='min'; to train on smaller batches, plan_model(model, x_small, "
        f"budget=..., mode={str(made_for)!r}) with them first.")


def _compiled_mode(model: Any) -> Optional[str]:
    """The mode ``model``'s compiled ``fit`` step runs in, or None before
    ``compile``."""
    if not getattr(model, "compiled", False):
        return None
    if getattr(model, "run_eagerly", False):
        return "eager"
    return "xla" if getattr(model, "jit_compile", False) is True else "graph"


def expect_layer_calls(graph: LayerGraph) -> None:
    """Raises if ``graph`` has no layer call: a model that returns its inputs
    (``keras.Model(i, i)``) has no region to checkpoint, and the profile of an
    empty chain has nothing to measure (it used to fail with an IndexError).
    For ``plan_model`` and ``apply_checkpointing(budget=...)``, before anything is
    measured (a ``PlanningValueError``, which the API called words)."""
    if graph.calls:
        return
    raise PlanningValueError(
        f"`{graph.model.name}` has no layer calls between its inputs and its "
        "outputs (e.g. keras.Model(inputs, inputs) returns its inputs), so there is "
        "nothing to checkpoint; received a model with 0 layer calls. Train "
        "it without apply_checkpointing / plan_model, or pass a model that calls "
        "layers on its inputs."
    )


def _expect_plan_fits(plan: ModelPlan, graph: LayerGraph) -> None:
    """Refuses a given plan made for another model (other layer calls, or blocks
    inside calls this model does not have)."""
    model = graph.model
    names = tuple(call.name for call in graph.calls)
    # Another instance of the same architecture (its layers numbered on by
    # Keras) runs the plan too: regions are positions in the same graph. The
    # same names are not enough where the plan knows what each call computes
    # (a Conv2D "stem" of other width, a slice h[:, :1] for h[:, :64]).
    fits = plan.call_kinds == graph.kinds() if plan.call_kinds else names == plan.names
    if not fits:
        same = names == plan.names
        named = ("" if len(names) != len(plan.names)
                 else " with the same names" if same else " with other names")
        computed = ("" if not plan.call_kinds else
                    f" {'but' if same else 'and'} other layers, arguments or connections")
        raise ValueError(
            f"{_API}: argument `plan` was made for another model: it has "
            f"{len(plan.names)} layer calls, `{model.name}` has {len(names)}{named}"
            f"{computed}; {_first_difference(plan, graph)}. "
            "Make the plan with plan_model(model, inputs, budget=...) on this model."
        )
    if not all(i < len(graph.calls) and k < len(sublayers(graph.calls[i].layer))
               for i, k in plan.blocks):
        raise ValueError(
            f"{_API}: argument `plan` checkpoints blocks inside calls that `{model.name}` "
            f"does not have ({', '.join(plan.block_names[:3])}...). Make the plan with "
            "plan_model(model, inputs, budget=...) on this model.")


def _first_difference(plan: ModelPlan, graph: LayerGraph) -> str:
    """The first layer call where ``plan`` and ``graph`` differ, in words: its
    name, or what the plan says it computes against what the model's does."""
    names = [call.name for call in graph.calls]
    kinds = graph.kinds() if plan.call_kinds else ()
    for i in range(min(len(names), len(plan.names))):
        if plan.names[i] != names[i] and not plan.call_kinds:
            return (f"the first that differs is call {i}: `{plan.names[i]}` in the plan, "
                    f"`{names[i]}` here")
        if plan.call_kinds and plan.call_kinds[i] != kinds[i]:
            ours, theirs = plan.call_kinds[i], kinds[i]
            at = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b) \
                if ours[:len(theirs)] != theirs[:len(ours)] else min(len(ours), len(theirs))
            start = max(0, at - 30)
            return (f"the first that differs is call {i}, `{names[i]}` here (`{plan.names[i]}` "
                    f"in the plan): the plan's reads ...{ours[start:at + 30]}... where this "
                    f"model's reads ...{theirs[start:at + 30]}...")
    return f"the first {min(len(names), len(plan.names))} calls are alike, then one has more"
