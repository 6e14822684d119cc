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
import os
from collections.abc import Collection, Iterator, Sequence
from typing import Any, Callable, Optional

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import forwardprop_util, record
from tensorflow.python.eager import tape as tape_lib

from tf_checkpointing import _keras_context, _saving, _seeding
from tf_checkpointing._captures import CaptureGuard
from tf_checkpointing._control_flow import CaptureMap
from tf_checkpointing._errors import ReplayMismatchError
from tf_checkpointing._flags import checkpoint_scope, is_recomputing
from tf_checkpointing._state import StateRecorder, replayed_state
from tf_checkpointing._structure import (
    Flattened,
    is_differentiable,  # noqa: F401 (re-exported for planning)
    refuse_chained_outputs,
    refuse_opaque_outputs,
)

__all__: list[str] = []

CHECK_ENV_VAR = "TF_CHECKPOINTING_CHECK"


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
            outputs it picks and reuse them in the replay (``_saving``).
        private_outputs: positions (in flattened order) of outputs only the caller's
            own ops read, never a user's tape, so they may feed other outputs
            without a warning (the regions of a whole-model plan).

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
    check = check or _check_mode_from_environment()
    replay = _Replay(fn, flat, positions, watch_vars, force_seed, check)
    if policy is not None:
        replay.saver = _saving.Saver(policy)
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
    return out.pack(out_leaves)


def _check_mode_from_environment() -> Any:
    """``TF_CHECKPOINTING_CHECK``: ``1``/``true`` checks structure, ``values`` values."""
    setting = os.environ.get(CHECK_ENV_VAR, "").lower()
    if setting == "values":
        return "values"
    return setting in ("1", "true")


class _Replay:
    """What the backward pass needs to replay one call, and nothing more: the
    inputs, the state the forward saw, and the shape of its outputs. It holds no
    activation and no output of the forward (unless ``check="values"``, or a
    save policy's picks: ``saver``)."""

    saver: Any = _saving.NO_SAVER

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
        with self.saver.active(inputs):  # keeps (forward) or reuses (replay) a policy's picks
            return self.fn(*args, **kwargs)

    def _seeded(self) -> Any:
        if self.call_seed is None:
            return contextlib.nullcontext()
        return _seeding.forced_seed(self.call_seed)

    def run_forward(self, inputs: Sequence[tf.Tensor]) -> Any:
        guard = CaptureGuard(self.name, inputs)
        self.consumed = guard.consumed
        # Inside an enclosing checkpoint's replay, this forward is part of a replay.
        with checkpoint_scope(recomputing=is_recomputing()), self.recorder:
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
            self.out_signature = _signature(out)
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
            inputs = _fresh_copies(inputs, output_grads)
            others = _after_gradient(self.leaves, self.positions, output_grads)
            with tf.GradientTape(watch_accessed_variables=False) as tape:
                tape.watch(inputs)
                tape.watch(differentiable_vars)
                out = Flattened(self._call(inputs, others))
            out_leaves = out.leaves
            if self.check:
                self._verify(out, out_leaves)
            targets, target_grads = [], []
            for i, grad in zip(self.out_positions, output_grads):
                if grad is not None:
                    targets.append(out_leaves[i])
                    target_grads.append(grad)
            grads = tape.gradient(
                targets, inputs + differentiable_vars, output_gradients=target_grads
            ) if targets else [None] * (len(inputs) + len(differentiable_vars))
        input_grads = list(grads[: len(inputs)])
        variable_grads = _after_replay(grads[len(inputs):], grads)
        by_variable = {id(v): g for v, g in zip(differentiable_vars, variable_grads)}
        if not variables:
            return input_grads
        return input_grads, [by_variable.get(id(v)) for v in variables]

    def _verify(self, out: Flattened, out_leaves: list[Any]) -> None:
        replayed = _signature(out)
        if replayed != self.out_signature:
            raise ReplayMismatchError(
                f"checkpointable: the replay of `{self.name}` returned {replayed}, but its "
                f"forward returned {self.out_signature}. The function must return the same "
                "structure, shapes and dtypes when it is run again: make what decides its "
                "outputs depend on its arguments only (not on Python's `random`, NumPy's "
                "global generator, counters or other state changed by the forward)."
            )
        if self.out_values is None:
            return
        for k, (before, i) in enumerate(zip(self.out_values, self.out_positions)):
            message = (
                f"checkpointable: the replay of `{self.name}` computed other values than its "
                f"forward (output {k}{{difference}}), so its gradients would be wrong: a "
                "random source or state it reads is not replayed. Python's `random` or "
                "NumPy: draw from keras.random with a keras.random.SeedGenerator or from a "
                "tf.random.Generator instead, or draw outside and pass the numbers in as an "
                "argument. Legacy tf.random ops without a seed (tf.random.uniform, "
                "tf.nn.dropout): call with _force_seed=True or use "
                "checkpointable(..., force_seed=True). Other state: pass it as an argument."
            )
            if tf.executing_eagerly():
                after = out_leaves[i]
                if not bool(tf.reduce_all(_close(after, before))):
                    worst = float(tf.reduce_max(tf.abs(tf.cast(after - before, tf.float64))))
                    raise ReplayMismatchError(
                        message.format(difference=f", largest difference {worst:.3g}"))
                continue
            # In a graph the comparison is an op: the message reaches the user inside
            # TensorFlow's InvalidArgumentError, as close to ours as a graph allows.
            tf.debugging.Assert(
                tf.reduce_all(_close(out_leaves[i], before)), [message.format(difference="")],
                name="checkpointable_check")


def _close(after: tf.Tensor, before: tf.Tensor) -> tf.Tensor:
    after, before = tf.cast(after, tf.float64), tf.cast(before, tf.float64)
    return tf.abs(after - before) <= 1e-6 + 1e-5 * tf.abs(before)


def _signature(out: Flattened) -> Any:
    def describe(leaf: Any) -> Any:
        if isinstance(leaf, tf.Tensor):
            return ("Tensor", tuple(leaf.shape.as_list()) if leaf.shape.rank is not None
                    else None, leaf.dtype.name)
        return type(leaf).__name__

    return tf.nest.map_structure(describe, out.structure), [describe(x) for x in out.leaves]


def _after_replay(variable_grads: Sequence[Any], all_grads: Sequence[Any]) -> list[Any]:
    """Variable gradients that depend, by data, on every gradient the replay
    computed, so an optimizer step cannot update a variable before the replay
    has read it.

    In a graph, a Dense kernel's gradient does not need the kernel's value, so
    only a control edge (automatic control dependencies) orders the replay's read
    of the kernel before the optimizer's in-place update; Grappler's dependency
    optimizer drops that edge, and the replay then sometimes read the updated
    kernel: wrong gradients for every layer below. Every read that matters feeds
    some gradient, so waiting for all of them restores the order. The probe is
    one element per gradient (gradients are alive anyway), not the replay's
    outputs, which would keep activations alive. (Eager runs in order.)"""
    present = [g for g in all_grads if g is not None and g.dtype != tf.variant]
    if tf.executing_eagerly() or not present:
        return list(variable_grads)
    zero = _opaque_zero(present)

    def ordered(grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            values = grad.values + tf.cast(zero, grad.values.dtype)
            return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
        return None if grad is None else grad + tf.cast(zero, grad.dtype)

    return [ordered(grad) for grad in variable_grads]


def _fresh_copies(inputs: list[tf.Tensor], output_grads: Sequence[Any]) -> list[tf.Tensor]:
    """One new tensor per input position (the same tensor passed twice must get
    two separate gradients). Inside a graph they also depend on the incoming
    gradients, so the replay cannot be scheduled before it is needed, nor merged
    with the forward by Grappler or XLA (which would keep every activation).

    On every incoming gradient, not only the first: a region with several
    outputs (a U-Net encoder block returns its skip and its pooled output) gets
    the skip's gradient long before the pooled one, and a replay waiting only
    for the first ran during the backward of every later region, holding its
    activations on top of theirs (U-Net least plan: 29.5 MiB instead of 23)."""
    if tf.executing_eagerly():
        return [tf.identity(x) for x in inputs]
    grads = _incoming(output_grads)
    if not grads:
        return [tf.identity(x) for x in inputs]
    zero = _opaque_zero(grads)
    # A TensorArray's flow (a variant) cannot be added to: it is copied, and the
    # other inputs carry the dependency on the gradient.
    return [tf.identity(x) if x.dtype == tf.variant else x + tf.cast(zero, x.dtype)
            for x in inputs]


def _after_gradient(leaves: Sequence[Any], positions: Sequence[int],
                    output_grads: Sequence[Any]) -> Optional[list[Any]]:
    """The leaves, with the tensors that take no gradient (token ids, masks) made
    to depend on the incoming gradient in a graph, as :func:`_fresh_copies` does
    for the others: else the ops of a replay that read only them (a region whose
    inputs are all integer, as a model's embedding and first block) could run
    as soon as the backward starts, holding their activations while the later
    calls' backward runs (on GPT-2, +35 MiB over the least plan's peak)."""
    grads = _incoming(output_grads)
    if tf.executing_eagerly() or not grads:
        return None
    taken = set(positions)
    # A constant keeps its static value (shapes may be computed from it).
    pending = [i for i, leaf in enumerate(leaves) if i not in taken
               and isinstance(leaf, tf.Tensor) and (leaf.dtype.is_integer or leaf.dtype.is_bool)
               and tf.get_static_value(leaf) is None]
    if not pending:
        return None
    zero = _opaque_zero(grads)
    ordered = list(leaves)
    for i in pending:
        leaf = leaves[i]
        ordered[i] = (tf.logical_or(leaf, tf.cast(zero, tf.bool)) if leaf.dtype.is_bool
                      else leaf + tf.cast(zero, leaf.dtype))
    return ordered


def _incoming(output_grads: Sequence[Any]) -> list[Any]:
    """The gradients a replay waits for: every one present (not a variant's)."""
    return [g for g in output_grads if g is not None and g.dtype != tf.variant]


def _opaque_zero(grads: Sequence[Any]) -> tf.Tensor:
    """A float32 zero that depends by data on one element of each gradient:
    always zero (a bool equals itself), but neither Grappler nor XLA can prove
    it. Complex gradients are probed through their real part, IndexedSlices
    through their values (never densified)."""
    probes = []
    for grad in grads:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        first = tf.reshape(values, [-1])[:1]
        if first.dtype.is_complex:
            first = tf.math.real(first)
        probes.append(tf.cast(first, tf.float32))
    as_bool = tf.cast(tf.reduce_max(tf.concat(probes, 0)), tf.bool)
    return tf.where(tf.equal(as_bool, as_bool), 0.0, float("nan"))


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
