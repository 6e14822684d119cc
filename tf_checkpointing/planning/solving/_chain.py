"""Where the checkpoints go: the schedule with least recomputation within a memory budget.

Splitting a chain of ``N`` equal layers into ``sqrt(N)`` checkpointed segments
(Chen et al. 2016) is the right answer for one memory level only, and for equal
layers only. Real chains are not equal (a stem keeps 4x the bytes of a head,
attention keeps more than a feed-forward), and a budget may sit anywhere
between "store nothing but one input" and "store everything". This module
measures the real layers once (:mod:`..measuring._profile`, and with save policies
:mod:`..measuring._choices`), models the step (:mod:`._chain_costs`) and solves for the
schedule exactly (:mod:`._rotor`): which layers run plainly, which run as
checkpointed segments (nested inside each other at tight budgets), and, given
``policies``, which layers keep what a save policy picks and replay the rest.
Plans and profiles are cached per chain, input shapes, keywords and mode.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Optional, Union

import tensorflow as tf

from tf_checkpointing.planning._cache import registered
from tf_checkpointing.planning._constants import CHAIN_CACHE_SIZE as _CACHE_SIZE
from tf_checkpointing.planning.layer_graph._calling import layer_names
from tf_checkpointing.planning.layer_graph._frozen import (
    chain_without_backward,
    frozen_prefix,
    trained_variables,
)
from tf_checkpointing.planning.measuring import _progress
from tf_checkpointing.planning.measuring._allocator import (
    concrete_inputs,
    in_fresh_thread,
)
from tf_checkpointing.planning.measuring._choices import PolicyChoices, measure_choices
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile
from tf_checkpointing.planning.measuring._leave_no_trace import nothing_left
from tf_checkpointing.planning.measuring._modes import Mode, step_mode
from tf_checkpointing.planning.measuring._profile import layer_key, profile_chain
from tf_checkpointing.planning.plans._budget import Budget
from tf_checkpointing.planning.plans._plan import PlanRunner, SequentialPlan
from tf_checkpointing.planning.solving._rotor import solve
from tf_checkpointing.planning.solving._xla import XlaAnchor, measure_xla_step

__all__ = ["cached_plan"]

# (layer ids, input shapes and dtypes, keywords, mode) -> (layers, profile,
# {policies: choices}, {(budget, policies): plan})
_profiles: collections.OrderedDict = registered(collections.OrderedDict())


def cached_plan(layers: list[Any], inputs: Any, budget: Budget, kwargs: dict[str, Any],
                routed: list[dict], *, runner: PlanRunner,
                mode: Union[Mode, str] = "auto",
                policies: tuple[Any, ...] = (), input_grad: bool = True) -> SequentialPlan:
    """The plan for ``budget``, profiling the chain only the first time it is
    seen with these input shapes, keywords and mode (the last 16 chains are
    kept). ``mode="auto"`` plans for a graph while a ``tf.function`` is traced.
    ``policies`` (validated) are measured once per chain too, for graphs only.
    Measuring runs the layers; the state they change is put back (see
    ``measuring._leave_no_trace``), only then: ``checkpoint_sequential(budget=)`` asks
    for its plan on every call. Unless ``input_grad`` (a tape differentiates
    ``inputs``), the leading layers without trainable weights are planned as a
    compiled step runs them: outside backprop (see :func:`frozen_prefix`)."""
    mode = step_mode(mode)
    signature = tuple((tuple(leaf.shape), leaf.dtype.name) if hasattr(leaf, "dtype")
                      else _hashable(leaf) for leaf in tf.nest.flatten(inputs))
    frozen = frozen_prefix(layers, input_grad=input_grad,
                           mode="graph" if mode.compiled else "eager")
    key = (tuple(id(layer) for layer in layers), signature,
           tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())), mode, frozen)
    entry = _profiles.get(key)
    if entry is None:
        calls = [functools.partial(_call, layer, kw) for layer, kw in zip(layers, routed)]
        names = layer_names(layers)
        # The plain step differentiates what a compiled step would: the trainable
        # variables, not the input (and so nothing of a frozen prefix).
        trainable = None if not frozen else _variables(layers[frozen:])
        # Identical layers on equal shapes (a transformer's blocks) share one graph
        # profile, which cuts planning time (see
        # docs/decisions/0012-identical-layers-share-a-profile.md).
        with nothing_left(), _progress.planning(f"a chain of {len(layers)} layers"):
            profile = profile_chain(calls, inputs, names=names, mode=mode,
                                    layer_keys=[layer_key(layer, kw) for layer, kw
                                                         in zip(layers, routed)],
                                    trainable=trainable)
            profile = chain_without_backward(profile, frozen)
            if mode is Mode.XLA:
                profile = _anchored(profile, layers, inputs, runner, trainable)
        # The layers are kept alive with the entry, so their ids stay theirs.
        entry = _profiles[key] = (list(layers), profile, {}, {})
        if len(_profiles) > _CACHE_SIZE:
            _profiles.popitem(last=False)
    _profiles.move_to_end(key)
    if not mode.compiled:  # eager: a policy keeps nothing, so it is no choice
        policies = ()
    choices: dict[tuple, PolicyChoices] = entry[2]
    if policies and policies not in choices:
        with nothing_left():
            choices[policies] = in_fresh_thread(lambda: measure_choices(
                layers, routed, concrete_inputs(inputs), policies, mode=mode))
    plans: dict[tuple, SequentialPlan] = entry[3]
    if (budget, policies) not in plans:
        plans[budget, policies] = solve(entry[1], budget, choices=choices.get(policies))
    return plans[budget, policies]


def _anchored(profile: ChainProfile, layers: list[Any], inputs: Any, runner: PlanRunner,
              trainable: Optional[list[Any]] = None) -> ChainProfile:
    """The XLA profile with its least plan compiled and measured (see ``_xla``)."""
    least = solve(profile, "min")
    # Variables, not weights: a Dropout's SeedGenerator state is only among the
    # former, and the measured step advanced it (another mask in every later step).
    state = [v for layer in layers for v in getattr(layer, "non_trainable_variables", ())]
    least_bytes = measure_xla_step(runner(least), inputs, state,
                                   trainable=trainable).peak_bytes
    model_least = least.predicted_peak_bytes or 0
    anchor = XlaAnchor(model_least=model_least, model_plain=profile.plain_peak_bytes,
                       least_bytes=least_bytes, plain_bytes=profile.plain_peak_bytes)
    return dataclasses.replace(profile, xla_anchor=anchor)


def _variables(layers: Sequence[Any]) -> list[Any]:
    """The trainable variables of ``layers``, each once."""
    seen: dict[int, Any] = {}
    for layer in layers:
        for variable in trained_variables(layer) or ():
            seen.setdefault(id(variable), variable)
    return list(seen.values())


def _call(layer: Any, kw: dict, x: Any) -> Any:
    return layer(x, **kw)


def _hashable(value: Any) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return ("tensor", tuple(value.shape), value.dtype.name)
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)
