"""Data dependencies that order a replay inside a graph.

In eager mode operations run in program order. In a graph (``tf.function``,
XLA) only data and control edges order them, and Grappler and XLA may drop
control edges, merge identical subgraphs or schedule an op as early as its
inputs allow. A replay scheduled early (or merged back into the forward) holds
every activation checkpointing was meant to free; a replay scheduled after the
optimizer's update reads updated weights. The functions here add data edges
that cannot be optimized away: an always-zero value computed from one element
of each incoming gradient (:func:`opaque_zero`), and, for the variable
gradients, of each value the replay read from a variable (:func:`after_replay`).
Under XLA, a replay's reads of convolution filters wait for the gradient too
(:func:`filters_after_gradient`), and each weight gradient is made before the
input gradient that shares its incoming gradient by data, not by a control edge,
which XLA ignores (:func:`._weight_gradients.weight_gradients_first`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import tensorflow as tf

from tf_checkpointing.core._internals import control_flow_util, op_callbacks

__all__ = ["after_gradient", "after_replay", "filters_after_gradient", "fresh_copies",
           "opaque_zero", "variable_reads"]

_raw = tf.raw_ops

# Ops that only read a variable's value.
_PURE_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})


def after_replay(variable_grads: Sequence[Any], all_grads: Sequence[Any],
                 reads: Sequence[Any] = (), incoming: Sequence[Any] = ()) -> list[Any]:
    """Variable gradients that depend, by data, on every read of a variable the
    replay made (``reads``, see :func:`variable_reads`, and the ``incoming``
    gradients; with no read found, on every gradient the replay computed), so an
    optimizer step cannot update a variable before the replay has read it.

    In a graph, a Dense kernel's gradient does not need the kernel's value, so
    only a control edge (automatic control dependencies) orders the replay's read
    of the kernel before the optimizer's in-place update; Grappler's dependency
    optimizer drops that edge, and the replay then sometimes read the updated
    kernel: wrong gradients for every layer below. (A value read is the
    variable's buffer at the read: an update of a buffer still referenced
    copies it first.) The probe is one element per read, not the replay's
    outputs, which would keep activations alive. Not every gradient the replay
    computed: the outer backward asks for some only (not a model input's, not a
    frozen layer's kernel's, whose variables TensorFlow still calls trainable),
    and waiting for the rest would run their backward, keeping what they read (a
    region over a frozen backbone and a trainable block peaked at 2x the plain
    step). (Eager runs in order.)"""
    present = [g for g in all_grads if g is not None and g.dtype != tf.variant]
    if tf.executing_eagerly() or not present:
        return list(variable_grads)
    arriving = _incoming(incoming)
    if reads and arriving:
        zero = opaque_zero(_elements(reads, opaque_zero(arriving)) or arriving)
    else:
        zero = opaque_zero(present)

    def ordered(grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            values = _plus_zero(grad.values, zero)
            return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
        return None if grad is None else _plus_zero(grad, zero)

    return [ordered(grad) for grad in variable_grads]


def _elements(values: Sequence[tf.Tensor], zero: tf.Tensor) -> list[tf.Tensor]:
    """One element of each of ``values`` (empty ones left out), gathered at an
    index computed from ``zero``: taken in the backward, not in the forward
    (where a function's gradient would keep it). A slice whose start is that
    index let XLA merge the replay into the forward; a gather does not."""
    index = tf.cast(zero, tf.int32)[None]
    flat, axis = tf.constant([-1]), tf.constant(0)
    # Raw ops, with constants shared: a replay can read hundreds of values, and
    # the public functions' dispatch made these probes a large part of tracing a
    # checkpointed step.
    return [_raw.GatherV2(params=_raw.Reshape(tensor=value, shape=flat),
                           indices=index, axis=axis)
            for value in values if value.shape.num_elements() != 0]


def variable_reads(graph: Any, forward: tuple[int, int], backward_end: int) -> list[tf.Tensor]:
    """What a replay read from resources: in its forward (``graph``'s operations
    ``forward[0]:forward[1]``), every value an op with a resource input made (a
    variable's ``ReadVariableOp``, an embedding's ``ResourceGather``, a loop or
    function call reading its kernels); in its backward (to ``backward_end``),
    the reads themselves (a custom gradient may read a variable), not the ops
    that read, which the outer backward may not need."""
    operations = graph.get_operations()
    values: list[tf.Tensor] = []
    for k in range(forward[0], backward_end):
        op = operations[k]
        if k >= forward[1] and op.type not in _PURE_READS:
            continue
        if any(t.dtype == tf.resource for t in op.inputs):
            values.extend(t for t in op.outputs if t.dtype.is_floating or t.dtype.is_integer
                          or t.dtype.is_bool or t.dtype.is_complex)
    return values


def fresh_copies(inputs: list[tf.Tensor], output_grads: Sequence[Any]) -> list[tf.Tensor]:
    """One new tensor per input position (the same tensor passed twice must get
    two separate gradients). Inside a graph they also depend on the incoming
    gradients, so the replay cannot be scheduled before it is needed, nor merged
    with the forward by Grappler or XLA (which would keep every activation).

    On every incoming gradient, not only the first: a region with several
    outputs (an encoder block returns its skip and its pooled output) gets the
    skip's gradient long before the pooled one, and a replay waiting only for
    the first ran during the backward of every later region, holding its
    activations on top of theirs (see docs/decisions/0002-replay-ordering.md)."""
    if tf.executing_eagerly():
        return [tf.identity(x) for x in inputs]
    grads = _incoming(output_grads)
    if not grads:
        return [tf.identity(x) for x in inputs]
    zero = opaque_zero(grads)
    # A TensorArray's flow (a variant) cannot be added to: it is copied, and the
    # other inputs carry the dependency on the gradient.
    return [tf.identity(x) if x.dtype == tf.variant else _plus_zero(x, zero)
            for x in inputs]


def after_gradient(leaves: Sequence[Any], positions: Sequence[int],
                    output_grads: Sequence[Any]) -> Optional[list[Any]]:
    """The leaves, with the tensors that take no gradient (token ids, masks) made
    to depend on the incoming gradient in a graph, as :func:`fresh_copies` does
    for the others: else the ops of a replay that read only them (a region whose
    inputs are all integer, as a model's embedding and first block) could run
    as soon as the backward starts, holding their activations while the later
    calls' backward runs (see docs/decisions/0002-replay-ordering.md)."""
    grads = _incoming(output_grads)
    if tf.executing_eagerly() or not grads:
        return None
    taken = set(positions)
    # A constant keeps its static value, and a vector (a ragged tensor's row
    # splits, a shape) stays what XLA can fold to one: shapes may be computed
    # from it, which XLA needs as compile-time constants.
    pending = [i for i, leaf in enumerate(leaves) if i not in taken
               and isinstance(leaf, tf.Tensor) and (leaf.dtype.is_integer or leaf.dtype.is_bool)
               and (leaf.shape.rank is None or leaf.shape.rank > 1)
               and tf.get_static_value(leaf) is None]
    if not pending:
        return None
    zero = opaque_zero(grads)
    ordered = list(leaves)
    for i in pending:
        leaf = leaves[i]
        ordered[i] = (tf.logical_or(leaf, tf.cast(zero, tf.bool)) if leaf.dtype.is_bool
                      else leaf + tf.cast(zero, leaf.dtype))
    return ordered


@contextlib.contextmanager
def filters_after_gradient(output_grads: Sequence[Any]) -> Iterator[None]:
    """Under XLA, while the body builds a replay, each read of a variable of rank
    3 or more (a convolution's filter) is made to depend by data on the incoming
    gradients: ``read + opaque zero``, the same value.

    XLA computes a convolution's input gradient with the filter reversed and
    transposed, a copy of the filter's size, and schedules that copy as soon as
    its operand exists: a filter read from a variable exists at the start of the
    step, so every replayed convolution's turned filter was made during the
    forward and held until the backward. Made from a read that waits for the
    gradient, the turning is fused into the addition and made when the replay
    runs. A matrix product's backward reads its weight as it is (dot dimension
    numbers), so a waiting Dense kernel would only add a copy: reads of rank 2 or
    less are left alone. Only reads built in the replay's own graph, not in a
    loop body or branch (functions of their own). In eager mode and in graphs
    XLA does not compile, filters are not copied and nothing is done. (See
    docs/decisions/0004-filters-that-wait.md.)"""
    grads = _incoming(output_grads)
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if not grads or graph is None or not control_flow_util.GraphOrParentsInXlaContext(graph):
        yield
        return
    zero = opaque_zero(grads)
    replay_graph = graph

    def waiting(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if (op_type != "ReadVariableOp" or graph is not replay_graph or len(outputs) != 1
                or not outputs[0].dtype.is_floating or (outputs[0].shape.rank or 0) < 3):
            return outputs  # not None: that would drop an earlier callback's replacement
        return [outputs[0] + tf.cast(zero, outputs[0].dtype)]

    op_callbacks.add_op_callback(waiting)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(waiting)


def _incoming(output_grads: Sequence[Any]) -> list[Any]:
    """The gradients a replay waits for: every one present (not a variant's)."""
    return [g for g in output_grads if g is not None and g.dtype != tf.variant]


def _plus_zero(x: tf.Tensor, zero: tf.Tensor) -> tf.Tensor:
    """``x + zero`` (the same value, made after ``zero``) as one raw op: added to
    every input and weight gradient of a replay (see _elements)."""
    return _raw.AddV2(x=x, y=zero if x.dtype == tf.float32 else tf.cast(zero, x.dtype))


def opaque_zero(grads: Sequence[Any]) -> tf.Tensor:
    """A float32 zero that depends by data on one element of each gradient:
    always zero (a bool equals itself), but neither Grappler nor XLA can prove
    it. Complex gradients are probed through their real part, IndexedSlices
    through their values (never densified)."""
    flat, begin, end, stride = (tf.constant(v) for v in ([-1], [0], [1], [1]))
    probes = []
    for grad in grads:  # raw ops, constants shared (see _elements)
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        if values.shape.rank == 1 and values.shape[0] == 1:
            first = values  # one element already (from _elements)
        else:
            first = _raw.StridedSlice(input=_raw.Reshape(tensor=values, shape=flat),
                                      begin=begin, end=end, strides=stride)
        if first.dtype.is_complex:
            first = tf.math.real(first)
        if first.dtype != tf.float32:
            first = _raw.Cast(x=first, DstT=tf.float32)
        probes.append(first)
    as_bool = tf.cast(tf.reduce_max(tf.concat(probes, 0)), tf.bool)
    return tf.where(tf.equal(as_bool, as_bool), 0.0, float("nan"))
