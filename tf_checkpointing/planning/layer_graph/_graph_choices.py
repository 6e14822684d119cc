"""What each save policy keeps and costs, per layer call of a model's graph.

The region planner (:mod:`..solving._regions`) may replay a region under a save policy:
it keeps what the policy picks inside the region as well as the region's
inputs, and its replay skips the kept ops. For that it needs, per call and
policy, the bytes kept and the replay time saved, which are measured the way
the chain planner measures its layers (:func:`..measuring._choices.measure_calls`): each
call as a function of the tensors it reads, its bytes kept from
:func:`~tf_checkpointing.debug.saved_residuals` and its ``tf.function`` (or XLA)
training step timed plain, fully replayed and under each policy, in
interleaved rounds. Calls that compute the same thing (a residual network's
repeated blocks, a transformer's identical blocks) are measured once, a call where
no policy keeps anything (an activation, an add) is traced
once and not timed, and of a large family of calls (one class and
configuration, other widths: a DenseNet's normalizations) a few sizes are
timed for the rest.

A region's time under a policy is then its calls' forward time (the unit of
the region program) times, per call, the measured ratio of the policy's
replay time to the full replay's: what the kept ops' time saves.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from tf_checkpointing.planning._constants import POLICY_FAMILY_SAMPLES as _FAMILY_SAMPLES
from tf_checkpointing.planning._constants import POLICY_MAX_ROUNDS as _MAX_ROUNDS
from tf_checkpointing.planning._constants import POLICY_REPEATS as _REPEATS
from tf_checkpointing.planning.layer_graph._layer_graph import (
    GraphCall,
    LayerGraph,
    argument_pattern,
    last_uses,
    run_call,
    tensor_keys,
)
from tf_checkpointing.planning.measuring._allocator import concrete_inputs, in_fresh_thread
from tf_checkpointing.planning.measuring._choices import PolicyChoices, measure_calls
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.measuring._profile import configuration

__all__: list[str] = []

# _REPEATS: timing rounds per distinct call, more for repeated ones (up to
# _MAX_ROUNDS): fewer than the chain planner's, whose rounds made a large model's
# planning slow (see docs/decisions/0011-policy-timing.md).


def graph_choices(graph: LayerGraph, inputs: Any, policies: tuple[Any, ...],
                  same_as: list[int], *, mode: Mode) -> PolicyChoices:
    """Measures every distinct call of ``graph`` on ``inputs`` under each policy,
    as a ``mode`` step (graph or XLA).
    Runs in a thread of its own (no tape of the caller records it); the state the
    calls change (BatchNorm statistics, dropout seeds) is put back."""
    return in_fresh_thread(_measure, graph, inputs, policies, same_as, Mode(mode))


def policy_arrays(choices: PolicyChoices, kept: np.ndarray,
                  cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[call, policy]`` bytes kept on top of a full replay's and replay seconds,
    from the per-call ``kept`` bytes and forward seconds ``cost`` of the profile."""
    # The bytes listed, not a fraction of the call's kept bytes: a Dense keeps
    # only its input (an argument), so its plain activations are none at all.
    policy_kept = (choices.kept_bytes if choices.kept_bytes is not None
                   else choices.kept_fraction * kept[:, None])
    replay = choices.replay_seconds[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(replay > 0, choices.policy_seconds / replay, 1.0)
    # Not timed (nothing kept) or noise around a free replay: no time saved.
    ratio = np.clip(np.nan_to_num(ratio, nan=1.0), 0.0, 1.0)
    return policy_kept, cost[:, None] * ratio


def _measure(graph: LayerGraph, inputs: Any, policies: tuple[Any, ...], same_as: list[int],
             mode: Mode) -> PolicyChoices:
    state = list(graph.model.non_trainable_variables)
    saved = [v.numpy() for v in state]
    try:
        flat = graph.model_inputs(concrete_inputs(inputs))
        env = dict(zip(graph.input_keys, flat))
        last = dict(zip(tensor_keys(graph), last_uses(graph)))
        arguments: list[Any] = []
        for i, call in enumerate(graph.calls):
            # Only the distinct calls are measured, so only their inputs are kept.
            arguments.append(tuple(env[k] for k in call.in_keys) if same_as[i] == i else None)
            run_call(call, env, {"training": True})
            for key in call.in_keys:
                if last.get(key, -1) <= i:
                    env.pop(key, None)
        env.clear()
        calls = [functools.partial(_run, call) for call in graph.calls]
        variables = [list(getattr(call.layer, "trainable_variables", ()))
                     for call in graph.calls]
        return measure_calls(calls, arguments, variables, same_as, policies, mode=mode,
                             repeats=_REPEATS, time_all=False, max_rounds=_MAX_ROUNDS,
                             families=[_family(call, i) for i, call in enumerate(graph.calls)],
                             family_samples=_FAMILY_SAMPLES)
    finally:
        for variable, value in zip(state, saved):
            variable.assign(value)


def _family(call: GraphCall, i: int) -> str:
    """What ``call`` computes up to its shapes: its layer's class and
    configuration (but the name) and the call's arguments that are not tensors."""
    config = configuration(call.layer)
    if config is None:  # a family of its own
        return repr(("unique", i))
    return repr((type(call.layer), config, argument_pattern(call)))


def _run(call: GraphCall, values: tuple) -> tuple:
    """One call as a function of the tensors it reads, returning what it makes,
    squared: as inside a region, where the next call's backward reads it.

    Alone, a call's replay computes outputs that no gradient reads (a ``Dense``'s
    backward needs only its input and kernel), so the executor prunes the whole
    replay and a policy keeps nothing: measured so, a ``Dense`` kept 0 bytes under
    ``dots_saveable`` and its full replay cost nothing, where in a region (before
    a GELU, say) the replay computes its product again, or the policy keeps it."""
    env = dict(zip(call.in_keys, values))
    run_call(call, env, {"training": True})
    outputs = [env[k] for k in call.out_keys]
    return tuple(tf.square(v) if getattr(v, "dtype", tf.int32).is_floating else v
                 for v in outputs)
