"""Where the checkpoints go: the schedule with least recomputation within a memory budget.

Splitting a chain of ``N`` equal layers into ``sqrt(N)`` checkpointed segments
(Chen et al. 2016) is the right answer for one memory level only, and for equal
layers only. Real chains are not equal (a stem keeps 4x the bytes of a head,
attention keeps more than a feed-forward), and a budget may sit anywhere
between "store nothing but one input" and "store everything". This module
measures the real layers once (:mod:`._profile`, and with save policies
:mod:`._choices`), models the step (:mod:`._chain_model`) and solves for the
schedule exactly (:mod:`._rotor`): which layers run plainly, which run as
checkpointed segments (nested inside each other at tight budgets), and, given
``policies``, which layers keep what a save policy picks and replay the rest.
Plans and profiles are cached per chain, input shapes, keywords and mode.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import numpy as np
import tensorflow as tf

from tf_checkpointing._seeding import random_state_kept
from tf_checkpointing.planning._allocator import concrete_inputs, in_fresh_thread, in_xla_context
from tf_checkpointing.planning._calling import route_keywords, validate_layers
from tf_checkpointing.planning._chain_model import predict_peak as predict_peak
from tf_checkpointing.planning._choices import PolicyChoices, expect_policies, measure_choices
from tf_checkpointing.planning._frozen import (
    chain_without_backward,
    frozen_prefix,
    trained_variables,
)
from tf_checkpointing.planning._layer_profile import ChainProfile
from tf_checkpointing.planning._plan import SequentialPlan
from tf_checkpointing.planning._profile import layer_key, profile_chain
from tf_checkpointing.planning._rotor import _inner as _inner  # for the tests
from tf_checkpointing.planning._rotor import solve
from tf_checkpointing.planning._xla import XlaAnchor, measure_xla_step

__all__ = ["plan_sequential"]

_API = "plan_sequential"
_CACHE_SIZE = 16
# (layer ids, input shapes and dtypes, keywords, mode) -> (layers, profile,
# {policies: choices}, {(budget, policies): plan})
_profiles: collections.OrderedDict = collections.OrderedDict()


_MODES = ("auto", "eager", "graph", "xla")


def plan_sequential(layers: Any, inputs: Any, *, budget: Union[float, str],
                    mode: str = "auto", policies: Any = None,
                    **kwargs: Any) -> SequentialPlan:
    """Plans the checkpoints of a chain of layers for a memory budget.

    Profiles the chain once on ``inputs`` (each layer's forward and backward,
    measured with the device allocator; the state the layers change is put
    back), then finds the schedule, nested checkpoints included, that
    recomputes the least while its peak stays within ``budget``. A budget at
    or above the plain step's peak recomputes nothing.

    With ``policies``, a layer may also run as a checkpointed call of its own
    that keeps what a save policy picks (the matrix products, say) and replays
    the rest: less memory than plain, less time than a full replay. The plan
    then takes, per layer, the cheapest of plain, a full replay (alone or in a
    segment) and each policy: the same choice as ``torch.compile``'s
    ``activation_memory_budget`` makes per op, with the layer as the unit and
    JAX's policies as the options. Each layer's ``tf.function`` training step
    is timed plain, fully replayed and with each policy (in interleaved rounds;
    identical layers once), so planning takes longer; in eager mode a policy
    keeps nothing (see ``docs/save-policies.md``), so ``policies`` is unused
    there.

    Args:
        layers: the chain: Keras layers or callables, each fed the previous output.
        inputs: the chain's input, a tensor or a nested structure of tensors, at
            the batch size training uses (the plan is for these shapes).
        budget: bytes the training step may allocate on top of what is allocated
            before it (weights, inputs): activations, stored checkpoints,
            gradients; or ``"min"``: the schedule with the least peak (least
            recomputation among those), as ``plan_model`` takes it.
        mode: how the training step runs, which decides what backprop keeps:
            ``"eager"``; ``"graph"`` for a ``tf.function`` (``Model.fit``
            included), whose graph keeps fewer intermediates, so the same budget
            leaves more layers un-checkpointed; ``"auto"`` (the default):
            ``"graph"`` when called while a ``tf.function`` is being traced,
            else ``"eager"``; ``"xla"`` for a ``jit_compile=True`` step (also
            chosen by ``"auto"`` while one is traced): a graph profile whose
            peaks are mapped onto the measured XLA steps of the plain chain and of
            its least-memory plan (XLA keeps buffers checkpointing does not shrink).
        policies: the save policies a layer may keep its activations with:
            None (the default: plain or full replays only); ``"auto"``:
            ``policies.dots_saveable`` and
            ``policies.dots_with_no_batch_dims_saveable``; or a list of
            policies, in which ``"auto"`` stands for those two
            (``["auto", policies.save_only_these_names("mlp_out")]``).
        **kwargs: keywords for the layers, e.g. ``training=True``; each layer gets
            those its call accepts, as in :func:`checkpoint_sequential`.

    Returns:
        A :class:`SequentialPlan`; pass its ``budget`` to
        :func:`checkpoint_sequential` or read ``segments``, ``predicted_peak_bytes``
        and ``extra_forward_layers``; ``str(plan)`` shows each segment and its policy.

    Raises:
        ValueError: the budget is below the least memory any schedule needs (the
            message gives it), or not a positive number.
        TypeError: ``policies`` is not None, ``"auto"`` or a list of policies.

    Example (on CPU, with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow
    is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing import plan_sequential
        >>> layers = [keras.layers.Dense(64, activation="relu") for _ in range(16)]
        >>> x = tf.random.normal([1024, 64])
        >>> plan = plan_sequential(layers, x, budget=4 * 2**20)
        >>> plan.predicted_peak_bytes <= 4 * 2**20 < plan.plain_peak_bytes
        True
        >>> plan.segments[0][0], plan.segments[-1][1], plan.extra_forward_layers > 0
        (0, 16, True)
        >>> mixed = plan_sequential(layers, x, budget=4 * 2**20, mode="graph",
        ...                         policies="auto")
        >>> mixed.predicted_peak_bytes <= 4 * 2**20
        True
        >>> print(mixed)  # doctest: +ELLIPSIS
        SequentialPlan: 16 layers, budget 4.00 MiB -> ...
    """
    layers = validate_layers(layers, _API)
    budget = _expect_budget(budget, _API)
    candidates = expect_policies(policies, _API)
    if mode not in _MODES:
        raise ValueError(
            f"{_API}: argument `mode` must be one of {', '.join(map(repr, _MODES))}; "
            f"received mode={mode!r}. Pass mode='graph' when the training step is a "
            "tf.function (or Model.fit), mode='xla' when it is compiled with "
            "jit_compile=True, mode='eager' when it runs eagerly."
        )
    return cached_plan(layers, inputs, budget, kwargs, route_keywords(layers, kwargs, _API),
                       api=_API, mode=mode, policies=candidates)


def cached_plan(layers: list[Any], inputs: Any, budget: Union[int, str], kwargs: dict[str, Any],
                routed: list[dict], *, api: str, mode: str = "auto",
                policies: tuple[Any, ...] = (), input_grad: bool = True) -> SequentialPlan:
    """The plan for ``budget``, profiling the chain only the first time it is
    seen with these input shapes, keywords and mode (the last 16 chains are
    kept). ``mode="auto"`` plans for a graph while a ``tf.function`` is traced.
    ``policies`` (validated) are measured once per chain too, for graphs only.
    Measuring runs the layers; the random state they draw from is put back (see
    ``random_state_kept``), only then: ``checkpoint_sequential(budget=)`` asks
    for its plan on every call. Unless ``input_grad`` (a tape differentiates
    ``inputs``), the leading layers without trainable weights are planned as a
    compiled step runs them: outside backprop (see :func:`frozen_prefix`)."""
    compiled = mode in ("graph", "xla") or (mode == "auto" and tf.inside_function())
    xla = mode == "xla" or (mode == "auto" and in_xla_context())
    signature = tuple((tuple(leaf.shape), leaf.dtype.name) if hasattr(leaf, "dtype")
                      else _hashable(leaf) for leaf in tf.nest.flatten(inputs))
    frozen = frozen_prefix(layers, input_grad=input_grad,
                           mode="eager" if not compiled else "graph")
    key = (tuple(id(layer) for layer in layers), signature,
           tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())), compiled, xla, frozen)
    entry = _profiles.get(key)
    if entry is None:
        calls = [functools.partial(_call, layer, kw) for layer, kw in zip(layers, routed)]
        names = [getattr(layer, "name", None) or getattr(layer, "__name__", None)
                 or type(layer).__name__ for layer in layers]
        # The plain step differentiates what a compiled step would: the trainable
        # variables, not the input (and so nothing of a frozen prefix).
        trainable = None if not frozen else _variables(layers[frozen:])
        # Identical layers on equal shapes (a transformer's blocks) share one
        # graph profile: the decoder of the benchmarks plans in 1/3 of the time.
        with random_state_kept():
            profile = profile_chain(calls, inputs, names=names, api=api, compiled=compiled,
                                    xla=xla, layer_keys=[layer_key(layer, kw) for layer, kw
                                                         in zip(layers, routed)],
                                    trainable=trainable)
            profile = chain_without_backward(profile, frozen)
            if xla:
                profile = _anchored(profile, layers, inputs, kwargs, routed, api, trainable)
        # The layers are kept alive with the entry, so their ids stay theirs.
        entry = _profiles[key] = (list(layers), profile, {}, {})
        if len(_profiles) > _CACHE_SIZE:
            _profiles.popitem(last=False)
    _profiles.move_to_end(key)
    if not compiled:  # eager: a policy keeps nothing, so it is no choice
        policies = ()
    choices: dict[tuple, PolicyChoices] = entry[2]
    if policies and policies not in choices:
        with random_state_kept():
            choices[policies] = in_fresh_thread(lambda: measure_choices(
                layers, routed, concrete_inputs(inputs, api), policies, xla=xla))
    plans: dict[tuple, SequentialPlan] = entry[3]
    if (budget, policies) not in plans:
        plans[budget, policies] = solve(entry[1], budget, api=api,
                                        choices=choices.get(policies))
    return plans[budget, policies]


def _anchored(profile: ChainProfile, layers: list[Any], inputs: Any, kwargs: dict[str, Any],
              routed: list[dict], api: str,
              trainable: Optional[list[Any]] = None) -> ChainProfile:
    """The XLA profile with its least plan compiled and measured (see ``_xla``)."""
    from tf_checkpointing._sequential import run_plan  # noqa: PLC0415 (imports this module)

    least = solve(profile, "min", api=api)
    # Variables, not weights: a Dropout's SeedGenerator state is only among the
    # former, and the measured step advanced it (another mask in every later step).
    state = [v for layer in layers for v in getattr(layer, "non_trainable_variables", ())]
    least_bytes = measure_xla_step(lambda x: run_plan(layers, least, x, kwargs, routed),
                                   inputs, api, state, trainable=trainable)
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


_MODEL_APIS = ("apply_checkpointing", "plan_model")
_LEAST_BYTES = 1024  # a smaller budget is a unit slip (MiB, GiB), not bytes
_LEAST = ', or budget="min" for the least memory'
# What else each API that validates a budget here accepts: only the chain APIs
# take segments=, and apply_checkpointing takes select= instead of a budget.
_BUDGET_ALTERNATIVES = {
    "checkpoint_sequential": ', budget="min", or no budget (segments=k, fixed segments)',
    "CheckpointedSequential": ', budget="min", or no budget (segments=k, fixed segments)',
    "apply_checkpointing": ', budget="min", or no budget (select=[...layer names...] to '
                           'choose the layers yourself)',
}


def _expect_budget(budget: Any, api: str) -> Union[int, str]:
    """Bytes as an int, or "min" (the least-memory schedule), as plan_model takes."""
    if isinstance(budget, str) and budget == "min":
        return budget
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer,
                                                          np.floating)):
        raise TypeError(
            f"{api}: argument `budget` must be a number of bytes or \"min\"; received "
            f"{budget!r} of type {type(budget).__name__}. Pass e.g. budget=512 * 2**20 for "
            "512 MiB, or budget=\"min\" for the least memory."
        )
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(
            f"{api}: argument `budget` must be a positive, finite number of bytes; "
            f"received budget={budget!r}. Pass e.g. budget=512 * 2**20 for 512 MiB"
            f"{_BUDGET_ALTERNATIVES.get(api, _LEAST)}."
        )
    if budget < 1:
        # A fraction of plain (budget=0.5) would be truncated to 0 bytes and
        # fail only inside the first training step, naming budget=0.
        planner = "plan_model(model, x" if api in _MODEL_APIS else "plan_sequential(layers, x"
        raise ValueError(
            f"{api}: argument `budget` is a number of bytes, not a fraction of the "
            f"plain step's peak; received budget={budget!r}. For a fraction of plain, "
            f"read plain's peak from a plan: plan = {planner}, budget='min'); then "
            f"budget=int({budget!r} * plan.plain_peak_bytes)."
        )
    if budget < _LEAST_BYTES:
        # No training step fits in a few bytes: budget=2.5 meant MiB or GiB, and
        # would fail only inside the first training step.
        raise ValueError(
            f"{api}: argument `budget` is a number of bytes; received budget={budget!r}, "
            f"less than {_LEAST_BYTES} bytes, which no training step fits in. Pass "
            f"e.g. budget={budget!r} * 2**20 for {budget!r} MiB, or "
            f"budget={budget!r} * 2**30 for GiB{_BUDGET_ALTERNATIVES.get(api, _LEAST)}."
        )
    return int(budget)
