"""The recompute core: run a function keeping only its inputs, replay it in backprop.

Why not ``tf.recompute_grad`` or ``keras.remat`` (which is ``tf.recompute_grad``
on the TensorFlow backend)? Both give silently wrong gradients in common
models: keyword-argument tensors get ``None`` gradients, non-tensor arguments
are turned into tensors (``if training:`` breaks), dropout draws another mask in
the replay, BatchNorm statistics are updated twice, half-precision inputs lose
their gradients. This module keeps their sound parts (a ``tf.custom_gradient``
whose forward runs under ``stop_recording`` so the outer tape keeps no
activation, and a data dependency on the incoming gradient so neither Grappler
nor XLA can merge the replay back into the forward) and fixes the rest:

* only floating tensor leaves of ``(args, kwargs)``, at any depth, become
  inputs of the custom gradient (also inside composite tensors and
  dataclasses, see ``_structure``); everything else (``None``, bools, strings,
  layers, integer tensors, variables) reaches the function untouched;
* the replay runs with the state and seeds the forward saw (``_state``,
  ``_seeding``) and with the Keras call context (``training``) and autocast
  scope of the forward;
* variables read inside get gradients, created-in-replay variables are refused
  with a clear error instead of silently getting no gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_checkpointing.core import _keras_context, _save_policies, _seeding
from tf_checkpointing.core._captures import CaptureGuard
from tf_checkpointing.core._control_flow import CaptureMap
from tf_checkpointing.core._flags import checkpoint_scope, is_recomputing
from tf_checkpointing.core._internals import forwardprop_util, pywrap_tfe, record, tape_lib
from tf_checkpointing.core._losses import put_back, with_added_losses
from tf_checkpointing.core._ordering import (
    after_gradient,
    after_replay,
    filters_after_gradient,
    fresh_copies,
    variable_reads,
)
from tf_checkpointing.core._pool_gradients import max_pool_gradients_from_windows
from tf_checkpointing.core._replay_check import (
    check_mode_from_environment,
    signature,
    verify_replay,
)
from tf_checkpointing.core._state import StateRecorder, replayed_state
from tf_checkpointing.core._structure import (
    Flattened,
    own_gradient,
    refuse_chained_outputs,
    refuse_opaque_outputs,
)
from tf_checkpointing.core._weight_gradients import weight_gradients_first

__all__: list[str] = []

def needs_checkpoint() -> bool:
    """False when no gradient can be taken of the call, so the function is run
    directly: recording is stopped (``tape.stop_recording()``, or the forward of
    an enclosing checkpointed call), or eager execution with no tape. Inside a
    graph the gradient may be asked for later, so the call is wrapped (a cost
    paid once, at trace time)."""
    if pywrap_tfe.TFE_Py_TapeSetIsStopped():
        return False
    return not tf.executing_eagerly() or record.could_possibly_record()


def checkpointed_call(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    *,
    watch_vars: Sequence[tf.Variable] = (),
    force_seed: bool = False,
    check: Any = False,
    policy: Any = None,
    private_outputs: Collection[int] = (),
    state: Sequence[Any] = (),
    frozen: Sequence[Any] = (),
) -> Any:
    """Calls ``fn(*args, **kwargs)`` keeping only its inputs for backprop.

    Args:
        fn: the function to run and replay.
        args, kwargs: its arguments, any nesting of tensors and Python objects.
        watch_vars: variables that must get gradients even if ``fn`` reads them
            in a way TensorFlow does not see (``tf.Variable`` objects).
        force_seed: make legacy stateful random ops replay exactly.
        check: False, True (compare the replay's output structure, shapes and
            dtypes with the forward's) or ``"values"`` (compare values too).
        policy: a save policy (``tf_checkpointing.policies``): also keep the
            outputs it picks and reuse them in the replay (``_save_policies``).
        private_outputs: positions (in flattened order) of outputs only the caller's
            own ops read, never a user's tape, so they may feed other outputs
            without a warning (the regions of a whole-model plan).
        state: variables ``fn`` may read and then write (a layer's non-trainable
            variables and metrics). In eager mode TensorFlow converts a variable
            argument of an op without an op anyone can watch, so a read before a
            write is invisible; these are read first, so that the replay starts
            from the values the forward started from (see ``_state``).
        frozen: variables whose gradient no one asks for though TensorFlow calls
            them trainable (a frozen Keras layer's weights, :func:`frozen_weights`):
            under XLA the replay's backward does not make their gradients run
            (see ``_weight_gradients.weight_gradients_first``). Read in graphs only.

    Returns:
        What ``fn`` returns, with gradients defined by replaying ``fn``.
    """
    flat = Flattened((args, kwargs))
    leaves = flat.leaves
    positions = flat.differentiable
    if forwardprop_util.pack_tangents([leaves[i] for i in positions]).tangents:
        # A ForwardAccumulator watches the inputs: forward-mode autodiff keeps
        # no activations anyway, and would not see through a replay.
        return fn(*args, **kwargs)
    check = check or check_mode_from_environment()
    # Losses the layers add inside become outputs, so that they get gradients
    # (see _losses); they are put back where the layers put them.
    fn, loss_owners = with_added_losses(fn)
    replay = _Replay(fn, flat, positions, watch_vars, force_seed, check)
    replay.state = state
    replay.frozen = frozenset(_handle_id(v) for v in frozen)
    if policy is not None:
        replay.saver = _save_policies.Saver(policy)
    returned: dict[str, Any] = {}

    @tf.custom_gradient
    def forward(*inputs: tf.Tensor):
        out = Flattened(replay.run_forward(inputs))
        refuse_opaque_outputs(replay.name, out.leaves)
        replay.note_outputs(out, inputs)
        consumed, replay.consumed = replay.consumed, None
        refuse_chained_outputs(replay.name, out.leaves,
                               [i for i in replay.out_positions if i not in private_outputs],
                               consumed, strict=bool(replay.check))
        returned["out"] = out
        outputs = tuple(out.leaves[i] for i in replay.out_positions)
        # A graph-mode custom gradient needs at least one tensor to pass through
        # (IdentityN of nothing is an error): a call with no floating input and no
        # floating output gets one unused scalar.
        return outputs or (tf.zeros([]),), replay.gradient

    forward.__name__ = getattr(fn, "__name__", "checkpointed")
    differentiable_outputs = forward(*[leaves[i] for i in positions])
    out = returned.pop("out")
    out_leaves = list(out.leaves)
    for i, tensor in zip(replay.out_positions, differentiable_outputs):
        out_leaves[i] = tensor
    result, losses = out.pack(out_leaves)
    put_back(loss_owners, losses)
    return result


def layer_state(layer: Any) -> list[Any]:
    """The variables a Keras layer's call may read and then write: its
    non-trainable variables (statistics, seed generators) and its metrics'.
    A functional model's op node (``a * b``, ``keras.ops.multiply``) is a Keras
    ``Operation`` that holds none."""
    return [*getattr(layer, "non_trainable_variables", ()),
            *getattr(layer, "metrics_variables", ())]


def frozen_weights(layer: Any) -> list[Any]:
    """A Keras layer's weights that Keras does not train: every weight of a
    frozen layer (``layer.trainable = False``), statistics included. Keras
    marks its own variables untrainable, not the TensorFlow variables holding
    their values, which a tape still watches; the optimizer never asks for
    their gradients."""
    return list(getattr(layer, "non_trainable_weights", ()))


def _handle_id(variable: Any) -> int:
    """One id for a Keras variable and the TensorFlow variable holding its
    value (the one a tape sees): their shared resource handle's. A Keras
    variable's own ``handle`` reads its ``value``, which inside a mixed-precision
    layer's autocast scope is a cast copy with no handle: its TensorFlow
    variable is read instead (Keras' TensorFlow backend keeps it in ``_value``)."""
    variable = getattr(variable, "_value", variable)
    try:
        return id(variable.handle)
    except (AttributeError, ValueError, RuntimeError):  # a distributed variable, off replica
        return id(variable)


def checkpointed(fn: Callable[..., Any], *, policy: Any = None) -> Callable[..., Any]:
    """``fn`` as a callable whose calls are checkpointed (under ``policy``) when a
    gradient can be taken, and run directly otherwise: what
    ``checkpointable(fn, checkpoint=True, policy=policy)`` runs, without the
    decorator's call-time options. The planner measures layers through it.

        >>> import tensorflow as tf
        >>> from tf_checkpointing.core._recompute import checkpointed
        >>> x = tf.ones([2, 3])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = checkpointed(tf.sin)(x)
        >>> bool(tf.reduce_all(tape.gradient(y, x) == tf.cos(x)))
        True
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        if not needs_checkpoint():
            return fn(*args, **kwargs)
        return checkpointed_call(fn, args, kwargs, policy=policy)

    return call


class _Replay:
    """What the backward pass needs to replay one call, and nothing more: the
    inputs, the state the forward saw, and the shape of its outputs. It holds no
    activation and no output of the forward (unless ``check="values"``, or a
    save policy's picks: ``saver``)."""

    saver: Any = _save_policies.NO_SAVER
    state: Sequence[Any] = ()
    frozen: frozenset = frozenset()

    def __init__(self, fn, flat, positions, watch_vars, force_seed, check):
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
        self.flat = flat
        self.leaves = flat.leaves
        self.positions = positions
        self.watch_vars = watch_vars
        self.call_seed = _seeding.draw_call_seed() if force_seed else None
        self.check = check
        self.keras_context = _keras_context.capture()
        self.recorder = StateRecorder()
        self.captures = CaptureMap()
        self.out_positions: list[int] = []
        self.out_signature: Any = None
        self.out_values: Optional[list[tf.Tensor]] = None
        self.consumed: Optional[dict[int, Any]] = None  # forward only

    def _call(self, inputs: Sequence[tf.Tensor], others: Optional[list[Any]] = None) -> Any:
        leaves = list(self.leaves if others is None else others)
        for i, tensor in zip(self.positions, inputs):
            leaves[i] = tensor
        args, kwargs = self.flat.pack(leaves)
        # A replay's kept tensors wait for what the replay's inputs wait for: the
        # incoming gradient. A region of integer inputs alone (token ids) has no
        # differentiable input; its integer leaves made to wait (``after_gradient``)
        # carry the wait instead, or the ops reading only kept tensors and weights
        # would be the forward's ops, held until the backward.
        waiting = inputs if others is None else [*inputs, *(
            leaf for leaf, before in zip(others, self.leaves) if leaf is not before)]
        with self.saver.active(waiting):  # keeps (forward) or reuses (replay) a policy's picks
            return self.fn(*args, **kwargs)

    def _seeded(self) -> Any:
        if self.call_seed is not None:
            return _seeding.forced_seed(self.call_seed)
        return _seeding.legacy_draws_noticed(self.name)

    def run_forward(self, inputs: Sequence[tf.Tensor]) -> Any:
        guard = CaptureGuard(self.name, inputs)
        self.consumed = guard.consumed
        # Inside an enclosing checkpoint's replay, this forward is part of a replay.
        with checkpoint_scope(recomputing=is_recomputing()), self.recorder:
            if tf.executing_eagerly():
                self.recorder.read_first(self.state)
            try:
                with record.stop_recording(), guard, self.captures.recording(), self._seeded():
                    for variable in self.watch_vars:
                        tape_lib.variable_accessed(variable)  # into the custom gradient's list
                    out = self._call(inputs)
                guard.check(self.leaves)  # outside stop_recording: asks whether a tape watches
                return out
            except BaseException:
                if tf.executing_eagerly():
                    self.recorder.restore_before()
                raise

    def note_outputs(self, out: Flattened, inputs: Sequence[tf.Tensor]) -> None:
        # An argument returned as it is stays that very tensor, outside the custom
        # gradient: the outer tape then sees every path from it, as in the plain call
        # (routed through, it would look independent of the outputs computed from it).
        passed_through = {id(x) for x in inputs}
        self.out_positions = [i for i in out.differentiable
                              if id(out.leaves[i]) not in passed_through]
        if self.check:
            self.out_signature = signature(out)
        if self.check == "values":
            self.out_values = [out.leaves[i] for i in self.out_positions]

    def gradient(self, *output_grads: Optional[tf.Tensor], variables=None):
        variables = list(variables or ())
        differentiable_vars = [v for v in variables if v.dtype.is_floating or v.dtype.is_complex]
        inputs = [self.leaves[i] for i in self.positions]
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(checkpoint_scope(recomputing=True))
            scopes.enter_context(self.captures.replaying())
            scopes.enter_context(_keras_context.restored(self.keras_context))
            scopes.enter_context(replayed_state(self.recorder))
            scopes.enter_context(self._seeded())
            scopes.enter_context(_refuse_new_variables(self.name))
            inputs = fresh_copies(inputs, output_grads)
            others = after_gradient(self.leaves, self.positions, output_grads)
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            replay_op = len(graph.get_operations()) if graph is not None else 0
            with filters_after_gradient(output_grads), \
                    tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(inputs)
                tape.watch(differentiable_vars)
                out = Flattened(self._call([own_gradient(t) for t in inputs], others))
            out_leaves = out.leaves
            if self.check:
                verify_replay(self, out, out_leaves)
            targets, target_grads = [], []
            for i, grad in zip(self.out_positions, output_grads):
                if grad is not None:
                    targets.append(out_leaves[i])
                    target_grads.append(grad)
            first_op = len(graph.get_operations()) if graph is not None else 0
            with max_pool_gradients_from_windows():
                grads = tape.gradient(
                    targets, inputs + differentiable_vars, output_gradients=target_grads
                ) if targets else [None] * (len(inputs) + len(differentiable_vars))
            reads = []
            if graph is not None:
                untaken = [g for v, g in zip(differentiable_vars, grads[len(inputs):])
                           if _handle_id(v) in self.frozen]
                weight_gradients_first(graph, first_op, target_grads, untaken)
                if differentiable_vars:
                    reads = variable_reads(graph, (replay_op, first_op),
                                           len(graph.get_operations()))
        input_grads = list(grads[: len(inputs)])
        variable_grads = after_replay(grads[len(inputs):], grads, reads, target_grads)
        by_variable = {id(v): g for v, g in zip(differentiable_vars, variable_grads)}
        if not variables:
            return input_grads
        return input_grads, [by_variable.get(id(v)) for v in variables]

@contextlib.contextmanager
def _refuse_new_variables(name: str) -> Iterator[None]:
    def creator(next_creator, **kwargs):
        raise ValueError(
            f"checkpointable: `{name}` created a new variable "
            f"({kwargs.get('name') or 'unnamed'}) while it was replayed for backprop. A "
            "checkpointed function must not create layers or variables on every call: the "
            "replay would make new ones and their gradients would be lost. Create the "
            "layers once, outside the function (e.g. in __init__), and call them inside."
        )

    with tf.variable_creator_scope(creator):
        yield
