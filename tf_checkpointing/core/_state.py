"""Replay of variable and random-generator state.

A checkpointed function may change state while it runs: Keras ``Dropout`` and
every ``keras.random`` op with a ``SeedGenerator`` advance the generator's seed
variable, ``tf.random.Generator`` advances its counter, ``BatchNormalization``
assigns its moving statistics, a counter may ``assign_add``. A naive replay runs
those writes a second time (BatchNorm statistics updated twice) and reads state
the forward already advanced (another dropout mask, so silently wrong
gradients). This is the defect behind most wrong gradients in
``tf.recompute_grad`` / ``keras.remat``.

:class:`StateRecorder` watches every op the forward runs (an op callback, so it
sees ops in eager mode and ops built while tracing ``tf.function`` / XLA) and
records, for each resource variable the forward writes, the value it had when
the forward first touched it. :func:`replayed_state` then brackets the replay:
it puts those values back, lets the replay run, and afterwards restores the
values the variables had just before the replay. The net effect: state is
updated exactly once, by the forward, and the replay sees what the forward saw.
It works on the variable handles, so it covers Keras variables, ``tf.Variable``
and ``tf.random.Generator`` alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import keras
import tensorflow as tf

from tf_checkpointing.core._internals import gen_resource_variable_ops, op_callbacks
from tf_checkpointing.core._save_policies import unmatched

__all__: list[str] = []

# Ops that write a resource variable, and where to find the dtype of its value.
_WRITES_WITH_VALUE_AT = {
    "AssignVariableOp": 1,
    "AssignAddVariableOp": 1,
    "AssignSubVariableOp": 1,
    "ResourceStridedSliceAssign": 4,
}
_RNG_STATE_WRITES = ("RngReadAndSkip", "RngSkip")


@dataclasses.dataclass
class _TouchedVariable:
    handle: Any
    dtype: tf.DType
    value_before: Optional[tf.Tensor]  # None: the forward wrote it before reading it
    written: bool = False
    # The value the replay starts from: the one before the forward, or, for a
    # variable the forward set before reading it, the value it set first. A
    # variable created inside the forward is set once, by its initializer, which
    # the replay does not run again: Keras' global SeedGenerator, created by the
    # first unseeded keras.random draw, would otherwise be replayed from the
    # state the forward's draw advanced (another StochasticDepth mask: wrong
    # gradients).
    first_value: Optional[tf.Tensor] = None

    @property
    def replay_from(self) -> Optional[tf.Tensor]:
        return self.value_before if self.value_before is not None else self.first_value


class StateRecorder:
    """Records what a forward pass reads first and writes, per variable handle.

    Use it as a context manager around the forward; afterwards ``written``
    lists the variables to bracket in the replay.
    """

    def __init__(self) -> None:
        self._touched: dict[Any, _TouchedVariable] = {}
        self._graph: Optional[tf.Graph] = None

    def __enter__(self) -> StateRecorder:
        self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        op_callbacks.add_op_callback(self._on_op)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        op_callbacks.remove_op_callback(self._on_op)
        # Keep only what the replay needs: the variables the forward wrote.
        self._touched = {k: t for k, t in self._touched.items() if t.written}

    @property
    def written(self) -> list[_TouchedVariable]:
        return [t for t in self._touched.values() if t.written]

    def _on_op(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        # TensorFlow hands each callback the outputs the previous one returned,
        # so a callback that changes nothing must return them as they are.
        if graph is self._graph and outputs is not None and inputs:
            self._record(op_type, inputs, outputs)
        return outputs

    def _record(self, op_type, inputs, outputs):
        if getattr(inputs[0], "dtype", None) != tf.resource:
            return
        key = inputs[0].ref()
        touched = self._touched.get(key)
        if op_type == "ReadVariableOp":
            if touched is None:
                self._touched[key] = _TouchedVariable(inputs[0], outputs[0].dtype, outputs[0])
            return
        dtype, value_before = _write_signature(op_type, inputs, outputs)
        if dtype is None:
            return  # not a variable write (lookup tables, iterators, ...)
        if touched is None:
            touched = self._touched[key] = _TouchedVariable(inputs[0], dtype, value_before)
            if value_before is None and op_type == "AssignVariableOp":
                touched.first_value = inputs[1]
        touched.written = True

    def read_first(self, variables: Sequence[Any]) -> None:
        """Reads ``variables`` (Keras or TensorFlow ones) now, as the forward's
        first reads: an eager op reads a variable argument without an op this
        recorder sees, so a variable read and then assigned would look written
        before it was read, and be replayed from its new value."""
        for variable in variables:
            if isinstance(variable, keras.Variable):  # its tf.Variable (not a scope's value)
                variable = variable._value  # noqa: SLF001
            self._record("ReadVariableOp", [variable.handle], [variable.read_value()])

    def restore_before(self) -> None:
        """Puts back the pre-forward value of every written variable (used when
        the forward raises, so that a failed call leaves no trace)."""
        for touched in self.written:
            if touched.value_before is not None:
                _assign(touched, touched.value_before)


def _write_signature(op_type, inputs, outputs):
    """(dtype of the variable, its value before this op if derivable) for an op
    that writes a variable, else (None, None)."""
    if op_type in _RNG_STATE_WRITES:
        # RngReadAndSkip returns the state it found: exactly the value before.
        before = outputs[0] if op_type == "RngReadAndSkip" else None
        return tf.int64, before
    if op_type in _WRITES_WITH_VALUE_AT:
        value = inputs[_WRITES_WITH_VALUE_AT[op_type]]
        before = None
        if op_type in ("AssignAddVariableOp", "AssignSubVariableOp"):
            # The variable was not read before this op: read it back now and undo
            # the delta (exact for the integer counters this is used for).
            after = gen_resource_variable_ops.read_variable_op(inputs[0], value.dtype)
            before = after - value if op_type == "AssignAddVariableOp" else after + value
        return value.dtype, before
    if op_type.startswith("ResourceScatter"):
        return inputs[2].dtype, None
    if op_type.startswith("Stateful"):
        return tf.int64, None
    return None, None


def _assign(touched: _TouchedVariable, value: tf.Tensor) -> None:
    gen_resource_variable_ops.assign_variable_op(touched.handle, value)


def _read(touched: _TouchedVariable) -> tf.Tensor:
    return gen_resource_variable_ops.read_variable_op(touched.handle, touched.dtype)


@contextlib.contextmanager
def replayed_state(recorder: StateRecorder) -> Iterator[None]:
    """Runs the body (the replay) on the state the forward saw, then puts the
    current state back, whether the body returns or raises."""
    written = recorder.written
    if not written:
        yield
        return
    current = [_read(t) for t in written]
    for touched in written:
        if touched.replay_from is not None:
            _assign(touched, touched.replay_from)
    try:
        yield
    finally:
        for touched, value in zip(written, current):
            _assign(touched, value)


class WritesKeptOut(keras.StatelessScope):
    """A replay's scope in which Keras variables are read but not written, and a
    value read after a write is, for the gradient, what plain TensorFlow reads.

    In plain TensorFlow a variable read after ``assign`` is a ``ReadVariableOp``:
    its value is the one assigned, but no gradient flows through it to what
    computed that value (a running mean assigned from the batch, then
    subtracted from it); a trainable variable's gradient flows to the variable.
    A plain ``keras.StatelessScope`` hands the assigned tensor itself to later
    reads, a gradient path plain does not have. Here the read is the assigned
    value with its gradient stopped, and for a trainable variable the gradient
    of the read goes to the variable (as a ``ReadVariableOp``'s does).

    Example:
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing.core._state import WritesKeptOut
        >>> v = keras.Variable(0.0, trainable=False)
        >>> x = tf.constant(2.0)
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     with WritesKeptOut():
        ...         _ = v.assign(3.0 * x)
        ...         y = x * v
        >>> float(y), float(tape.gradient(y, x)), float(v.numpy())  # d(x * v)/dx = v
        (12.0, 6.0, 0.0)
    """

    def __init__(self) -> None:
        # Losses are collected: the replay returns its own (see _losses).
        super().__init__(initialize_variables=False, collect_losses=True)

    def add_update(self, update: tuple[Any, Any]) -> None:
        variable, value = update
        # The forward assigned with an op no save policy sees: these ops are
        # not matched against it (else a policy's replay stops reusing what it
        # kept at the first BatchNormalization, and recomputes the rest).
        with unmatched():
            value = tf.stop_gradient(value)
            if variable.trainable:
                # A read of the variable itself (the tf.Variable under the Keras
                # one), which the tape records: worth 0 in value, its gradient
                # reaches the variable.
                read = tf.convert_to_tensor(variable._value)  # noqa: SLF001
                value = value + (read - tf.stop_gradient(read))
        super().add_update((variable, value))
