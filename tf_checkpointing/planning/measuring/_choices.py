"""The save policies a chain's layers may run with, and what each one costs.

The schedule solver (:mod:`..solving._rotor`) may run a layer as a checkpointed call of
its own with a save policy (:mod:`tf_checkpointing.policies`): it keeps what the
policy picks and replays the rest. For that it needs, per layer and policy, the
bytes kept (listed by :func:`~tf_checkpointing.debug.saved_residuals`, which agrees
with the allocator) and the replay's time. The time is measured, not modelled:
the layer's training step as a ``tf.function`` (XLA-compiled for
``mode="xla"``), plain, fully replayed and with each policy, timed in
interleaved rounds (median), so that a full replay and a policy are compared in
the same unit and under the same load.

The step's loss is the sum of the squared outputs, so the incoming gradient is
computed from the forward. With ``reduce_sum(y)`` (a constant gradient of ones)
the replay does not wait for the forward and runs beside it on a second core,
so a full replay looked free where a chain pays for it (see
docs/decisions/0011-policy-timing.md).

Layers of the same class, configuration, weight shapes and input are measured
once (a transformer's identical blocks: one measurement, more rounds for less
noise).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tf_checkpointing import policies as save_policies
from tf_checkpointing.core._recompute import checkpointed
from tf_checkpointing.core._residuals import saved_residuals
from tf_checkpointing.core._save_policies import forward_kept_bytes
from tf_checkpointing.planning._constants import POLICY_SMALL_KEPT as _SMALL_KEPT
from tf_checkpointing.planning._errors import PlanningTypeError
from tf_checkpointing.planning.measuring._allocator import planning_function
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.measuring._profile import layer_key
from tf_checkpointing.planning.measuring._whole_step import variable_ids

__all__ = ["PolicyChoices", "expect_policies", "measure_choices"]

AUTO = "auto"
# JAX's two policies that keep matrix products: what "auto" chooses from.
_AUTO_NAMES = ("dots_saveable", "dots_with_no_batch_dims_saveable")


def expect_policies(value: Any) -> tuple[Any, ...]:
    """``policies=`` as a tuple of candidate policies (empty: none), or a clear error.

    Accepted: None (full replays only), ``"auto"`` (``dots_saveable`` and
    ``dots_with_no_batch_dims_saveable``), or a list of policies, in which
    ``"auto"`` stands for those two. ``nothing_saveable`` (a full replay) and
    ``everything_saveable`` (plain) are always choices, so they are dropped.

    Raises:
        PlanningTypeError: for anything else (the API called names itself).
    """
    if value is None:
        return ()
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, (list, tuple)):
        raise PlanningTypeError(_message(value, f"of type {type(value).__name__} (one "
                                         "policy: put it in a list, policies=[p], or pass "
                                         "policy=p for every segment)"))
    chosen: list[Any] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str) and entry == AUTO:
            chosen.extend(getattr(save_policies, name) for name in _AUTO_NAMES)
        elif callable(entry) and not isinstance(entry, (type, str, tf.Tensor)):
            chosen.append(entry)
        else:
            where = "" if entries is not value else f" (entry {i})"
            raise PlanningTypeError(_message(value, f"{entry!r} of type "
                                             f"{type(entry).__name__}{where}"))
    unique: list[Any] = []
    for policy in chosen:
        if (policy not in unique and policy is not save_policies.nothing_saveable
                and policy is not save_policies.everything_saveable):
            unique.append(policy)
    return tuple(unique)


def _message(value: Any, received: str) -> str:
    return (
        "argument `policies` must be None, 'auto', or a list of save policies "
        "(such as tf_checkpointing.policies.dots_saveable, or 'auto' for dots_saveable "
        f"and dots_with_no_batch_dims_saveable); received {value!r}: {received}. Pass "
        "e.g. policies='auto' or policies=['auto', tf_checkpointing.policies."
        "save_only_these_names('mlp_out')]."
    )


@dataclasses.dataclass(frozen=True)
class PolicyChoices:
    """Per layer of a chain: what each policy keeps and costs.

    Attributes:
        policies: the candidate policies (columns).
        kept_fraction: ``[layer, policy]``, the bytes the policy keeps beyond a
            full replay's, as a fraction of what the plain layer keeps.
        policy_seconds: ``[layer, policy]``, the step time it adds to plain's.
        replay_seconds: ``[layer]``, the step time a full replay adds to plain's.
        kept_bytes: ``[layer, policy]``, the bytes the policy keeps beyond a full
            replay's (as :func:`~tf_checkpointing.debug.saved_residuals` lists them; for
            the model planner, where they are at most ``POLICY_SMALL_KEPT`` of the
            call's inputs, the forward's upper bound).
    """

    policies: tuple[Any, ...]
    kept_fraction: np.ndarray
    policy_seconds: np.ndarray
    replay_seconds: np.ndarray
    kept_bytes: Optional[np.ndarray] = None


def measure_choices(layers: Sequence[Any], routed: Sequence[dict], inputs: Any,
                    policies: tuple[Any, ...], *, mode: Mode = Mode.GRAPH,
                    repeats: int = 7) -> PolicyChoices:
    """Measures every layer (once per distinct layer) with every policy, each as
    a ``mode`` step (graph or XLA); the state the layers change (dropout seeds,
    BatchNorm statistics) is put back."""
    state = [v for layer in layers for v in getattr(layer, "variables", ())]
    before = [v.numpy() for v in state]
    try:
        xs = [inputs]
        for layer, kw in zip(layers[:-1], routed):
            xs.append(layer(xs[-1], **kw))
        keys = [_signature(layer, x) for layer, x in zip(layers, xs)]
        first: dict[Any, int] = {}
        same_as = [first.setdefault(key, i) for i, key in enumerate(keys)]
        calls = [functools.partial(_call_layer, layer, kw) for layer, kw in zip(layers, routed)]
        variables = [list(getattr(layer, "trainable_variables", ())) for layer in layers]
        return measure_calls(calls, xs, variables, same_as, policies, mode=Mode(mode),
                             repeats=repeats)
    finally:
        for variable, value in zip(state, before):
            variable.assign(value)


def measure_calls(calls: Sequence[Callable[[Any], Any]], inputs: Sequence[Any],
                  variables: Sequence[list], same_as: Sequence[int],
                  policies: tuple[Any, ...], *, mode: Mode = Mode.GRAPH, repeats: int = 7,
                  time_all: bool = True, max_rounds: Optional[int] = None,
                  families: Optional[Sequence[Any]] = None,
                  family_samples: int = 0) -> PolicyChoices:
    """What each policy keeps and costs, per call: ``calls[i](inputs[i])`` runs
    call ``i`` (reading ``variables[i]``); ``same_as[i] = j`` says call ``i``
    computes what call ``j`` does (it gets ``j``'s readings). Without
    ``time_all``, a call where no policy keeps anything a full replay does not
    is not timed (its policies are full replays: ``policy_seconds`` is
    ``replay_seconds``, both NaN) and the plain call's bytes are not listed
    (``kept_fraction`` is then of nothing: zero). ``max_rounds`` caps the timing
    rounds of a call. The caller puts back the state the calls change.

    ``families[i]`` names what call ``i`` computes up to its shapes (a
    DenseNet's BatchNormalizations, one per width). Without ``time_all``, a
    family with more than ``family_samples`` calls to time has that many timed
    (with ``max_rounds``), spread over their input sizes; each other member
    gets, per policy, the median ratio of policy to full-replay time of the
    three timed members nearest its input size, and its family's median replay
    time (the ratio is what the model planner reads): a few-millisecond step's
    ratio varies more between neighbours than along the family
    (docs/decisions/0011-policy-timing.md)."""
    listed = {i: _kept_by_policies(calls[i], inputs[i], policies, time_all)
              for i, j in enumerate(same_as) if j == i}
    to_time = [i for i, got in listed.items() if got is not None and (time_all or got[2].any())]
    sampled, sampled_down = set(to_time), set()
    if families is not None and family_samples > 0 and not time_all:
        sampled = _samples(to_time, families, inputs, family_samples)
        sampled_down = {families[i] for i in to_time if i not in sampled}
    measured: dict[int, tuple[np.ndarray, np.ndarray, float, np.ndarray]] = {}
    for i in listed:
        if i not in to_time:
            measured[i] = _nothing(len(policies))
        elif i in sampled:
            # A measurement that stands for several calls (or for untimed members
            # of its family) gets more rounds: its noise would count once per call.
            rounds = repeats * min(list(same_as).count(i), 4)
            if sampled_down and families[i] in sampled_down:
                rounds = repeats * 4
            rounds = rounds if max_rounds is None else min(rounds, max_rounds)
            measured[i] = _timed(calls[i], inputs[i], list(variables[i]), policies, mode,
                                 rounds, time_all, listed[i])
    for i in to_time:
        if i not in sampled:
            measured[i] = _from_family(i, listed[i], measured, sampled, families, inputs)
    rows = [measured[j] for j in same_as]
    return PolicyChoices(policies, np.array([r[0] for r in rows]).reshape(len(rows), -1),
                         np.array([r[1] for r in rows]).reshape(len(rows), -1),
                         np.array([r[2] for r in rows], float),
                         np.array([r[3] for r in rows], float).reshape(len(rows), -1))


def _nothing(count: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    zeros = np.zeros(count)
    return zeros, np.full(count, np.nan), float("nan"), zeros


def _kept_by_policies(fn: Callable[[Any], Any], x: Any, policies: tuple[Any, ...],
                      time_all: bool) -> Optional[tuple[np.ndarray, list[int], np.ndarray]]:
    """The kept fraction, the bytes each policy keeps and those beyond a full
    replay's; None when no policy keeps anything (checked only without ``time_all``)."""
    def kept(call: Callable[[Any], Any]) -> int:
        return sum(r.bytes for r in saved_residuals(call, x) if r.kind == "activation")

    zeros = np.zeros(len(policies))
    if not time_all:
        # Most calls of a model (activations, adds) have nothing a policy keeps,
        # and a normalization keeps only its moments under reductions_saveable:
        # one forward trace for all the policies tells, and bounds the bytes.
        bound = forward_kept_bytes(policies, fn, x)
        if all(b == 0 for b in bound):  # None: a kept tensor of unknown size
            return None
        if None not in bound and max(bound) <= _SMALL_KEPT * _input_bytes(x):
            return zeros, bound, np.array(bound, float)
    # The model planner uses the bytes themselves: no trace of the plain call.
    plain = kept(fn) if time_all else 0
    replay = kept(checkpointed(fn))
    kept_by = [kept(checkpointed(fn, policy=p)) for p in policies]
    extra_bytes = np.array([max(k - replay, 0) for k in kept_by], float)
    fraction = np.minimum(extra_bytes / max(plain, 1), 1.0) if time_all else zeros
    return fraction, kept_by, extra_bytes


def _timed(fn: Callable[[Any], Any], x: Any, variables: list[Any],
           policies: tuple[Any, ...], mode: Mode, repeats: int, time_all: bool,
           listed: tuple[np.ndarray, list[int], np.ndarray],
           ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    fraction, kept_by, extra_bytes = listed
    steps: dict[Any, Callable[[Any], Any]] = {"plain": fn, "replay": checkpointed(fn)}
    if time_all:
        steps.update({k: checkpointed(fn, policy=p) for k, p in enumerate(policies)})
        extra = step_extra_seconds(steps, x, variables, mode, repeats)
        return (fraction, np.array([extra[k] for k in range(len(policies))]),
                extra["replay"], extra_bytes)
    # Only the policies that keep something, and one of those keeping the same
    # bytes (the same tensors, as a rule: both "auto" policies on a Dense), are
    # timed; the others are full replays.
    timed = {kept_by[k]: k for k in reversed(range(len(policies))) if extra_bytes[k] > 0}
    steps.update({k: checkpointed(fn, policy=policies[k]) for k in timed.values()})
    extra = step_extra_seconds(steps, x, variables, mode, repeats)
    seconds = np.array([extra[timed[kept_by[k]]] if extra_bytes[k] > 0 else extra["replay"]
                        for k in range(len(policies))])
    return fraction, seconds, extra["replay"], extra_bytes


def _input_bytes(x: Any) -> float:
    return float(sum(np.prod(t.shape) * t.dtype.size for t in tf.nest.flatten(x)
                     if hasattr(t, "dtype")))


def _samples(to_time: list[int], families: Sequence[Any], inputs: Sequence[Any],
             count: int) -> set[int]:
    """The calls to time: all of a small family, ``count`` of a larger one,
    spread evenly from its smallest input to its largest."""
    members: dict[Any, list[int]] = {}
    for i in to_time:
        members.setdefault(families[i], []).append(i)
    chosen: set[int] = set()
    for group in members.values():
        by_size = sorted(group, key=lambda i: _input_bytes(inputs[i]))
        picks = np.linspace(0, len(by_size) - 1, min(count, len(by_size))).round()
        chosen.update(by_size[int(k)] for k in picks)
    return chosen


def _from_family(i: int, listed: tuple[np.ndarray, list[int], np.ndarray],
                 measured: dict[int, tuple], sampled: set[int], families: Sequence[Any],
                 inputs: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """An untimed member's readings, from the timed members of its family."""
    fraction, _, extra_bytes = listed
    size = np.log(max(_input_bytes(inputs[i]), 1.0))
    timed = sorted((k for k in sampled if families[k] == families[i]),
                   key=lambda k: abs(np.log(max(_input_bytes(inputs[k]), 1.0)) - size))
    replay = float(np.median([measured[k][2] for k in timed]))
    seconds = np.full(len(extra_bytes), replay)
    for p in np.flatnonzero(extra_bytes > 0):
        ratios = [measured[k][1][p] / measured[k][2] for k in timed
                  if measured[k][3][p] > 0 and measured[k][2] > 0][:3]
        # No timed neighbour kept with this policy, or their replays were free:
        # a full replay's time, as where the policy keeps nothing.
        seconds[p] = replay * float(np.median(ratios)) if ratios else replay
    return fraction, seconds, replay, extra_bytes


def _call_layer(layer: Any, kw: dict, x: Any) -> Any:
    return layer(x, **kw)


def step_extra_seconds(calls: dict[Any, Callable[[Any], Any]], x: Any, variables: list[Any],
                   mode: Mode, repeats: int, reference: Any = "plain") -> dict[Any, float]:
    """Per call, the median over rounds of its step time minus the plain step's
    (``calls[reference]``) in
    the same round (each round runs every call once, in a rotating order): a
    difference taken within a round cancels most of a shared machine's drift."""
    wanted = variable_ids(variables)

    def step_of(call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def step(x: Any) -> Any:
            sources = [t for t in tf.nest.flatten(x) if t.dtype.is_floating]
            with tf.GradientTape() as tape:
                tape.watch(sources)
                outputs = [tf.cast(y, tf.float32) for y in tf.nest.flatten(call(x))
                           if y.dtype.is_floating]
                # A gradient computed from the output: the replay has to wait for
                # the forward, as in a chain (see the module docstring).
                loss = tf.add_n([tf.reduce_sum(tf.square(y)) for y in outputs])
            # What the tape watched of them: under a distribution strategy a
            # mirrored variable cannot be differentiated outside a replica, the
            # copy its read went through can.
            watched = [v for v in tape.watched_variables() if id(v) in wanted]
            return tape.gradient(loss, sources + watched)

        return planning_function(step, jit_compile=(mode is Mode.XLA) or None)

    steps = {name: step_of(call) for name, call in calls.items()}
    for step in steps.values():
        _sync(step(x))
    names = list(steps)
    extra: dict[Any, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        shift = round_ % len(names)  # no call always runs first
        seconds = {}
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            _sync(steps[name](x))
            seconds[name] = time.perf_counter() - started
        for name in names:
            extra[name].append(seconds[name] - seconds[reference])
    return {name: max(statistics.median(values), 0.0) for name, values in extra.items()}


def _signature(layer: Any, x: Any) -> Any:
    """Layers with equal signatures are measured once: the same class and
    configuration (but the name), weight shapes and input shapes."""
    shapes = tuple((tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(x)
                   if hasattr(t, "dtype"))
    return layer_key(layer), shapes


def _sync(values: Any) -> None:
    for value in tf.nest.flatten(values):
        if value is not None:
            np.asarray(value)
