"""Which tensors of a traced forward its gradient reads.

A tensor that no op of the gradient consumes (other than a shape query, which
constant folding removes) is not held for the backward: it lives only as long
as the forward reads it. The memory model needs this per layer call (see
:mod:`..layer_graph._saved_tensors`); it is read from a graph that holds a forward and,
after it, that forward's gradient: a call's own (``_saved_tensors``), or the
graph the profile measures each call with (``_step_profile``), which then
costs no trace of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import tensorflow as tf

__all__: list[str] = []

# Ops that read only a tensor's shape (folded to constants for static shapes), and
# the zeros and ones a gradient is seeded with where a tensor is not connected (a
# layer that reads only its input's shape) or no output gradient is given: a
# training step's gradient makes neither.
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs",
                        "ZerosLike", "OnesLike"})
_PASS_THROUGH = frozenset({"Identity", "IdentityN"})


class BackwardReads(NamedTuple):
    """The positions, among a call's input leaves and among its output leaves,
    of the tensors its gradient reads; and how many leaves there were."""

    inputs: frozenset
    outputs: frozenset
    input_count: int
    output_count: int


def backward_reads(graph: Any, first_backward_op: int, inputs: Sequence[Any],
                   outputs: Sequence[Any], ignore: Iterable[Any] = ()) -> BackwardReads:
    """What the ops of ``graph`` from the ``first_backward_op``-th on (the
    gradient, traced after the forward) read of ``inputs`` and ``outputs``,
    the forward's leaves; the ops in ``ignore`` (a measurement's own reader of
    the outputs) do not count.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing.planning.measuring._backward_reads import backward_reads
        >>> def forward_and_backward(x):
        ...     with tf.GradientTape() as tape:
        ...         tape.watch(x)
        ...         y = tf.nn.relu(x)           # its gradient reads y, not x
        ...     marks.append(len(tf.compat.v1.get_default_graph().get_operations()))
        ...     seen.extend([x, y])
        ...     return tape.gradient(y, x)
        >>> marks, seen = [], []
        >>> graph = tf.function(forward_and_backward).get_concrete_function(
        ...     tf.TensorSpec([4])).graph
        >>> reads = backward_reads(graph, marks[0], seen[:1], seen[1:])
        >>> sorted(reads.inputs), sorted(reads.outputs)
        ([], [0])
    """
    ignored = {op.name for op in ignore}
    backward = {op.name for op in graph.get_operations()[first_backward_op:]} - ignored
    return BackwardReads(
        inputs=frozenset(p for p, t in enumerate(inputs) if _read(t, backward)),
        outputs=frozenset(p for p, t in enumerate(outputs) if _read(t, backward)),
        input_count=len(inputs), output_count=len(outputs))


def _read(tensor: Any, backward: set) -> bool:
    """Whether ``tensor`` is made by the forward and read by an op of ``backward``."""
    return (isinstance(tensor, tf.Tensor) and tensor.op.name not in backward
            and _read_by(tensor, backward))


def _read_by(tensor: tf.Tensor, backward: set) -> bool:
    """Whether an op of ``backward`` reads ``tensor`` (through forward identities)."""
    pending, seen = [tensor], set()
    while pending:
        t = pending.pop()
        for op in t.consumers():
            if op.name in seen:
                continue
            seen.add(op.name)
            if op.name in backward:
                if op.type not in _SHAPE_OPS:
                    return True
            elif op.type in _PASS_THROUGH:
                pending.extend(op.outputs)
    return False
