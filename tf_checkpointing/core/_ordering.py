"""Data dependencies that order a replay inside a graph.

In eager mode operations run in program order. In a graph (``tf.function``,
XLA) only data and control edges order them, and Grappler and XLA may drop
control edges, merge identical subgraphs or schedule an op as early as its
inputs allow. A replay scheduled early (or merged back into the forward) holds
every activation checkpointing was meant to free; a replay scheduled after the
optimizer's update reads updated weights. The functions here add data edges
that cannot be optimized away: an always-zero value computed from one element
of each incoming gradient (:func:`_opaque_zero`), and, for the variable
gradients, of each value the replay read from a variable (:func:`after_replay`).
Under XLA, a replay's reads of convolution filters wait for the gradient too
(:func:`filters_after_gradient`), and each weight gradient is made before the
input gradient that shares its incoming gradient by data, not by a control edge,
which XLA ignores (:func:`weight_gradients_first`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import tensorflow as tf

from tf_checkpointing.core._internals import control_flow_util, op_callbacks

__all__ = ["after_gradient", "after_replay", "filters_after_gradient", "fresh_copies",
           "variable_reads", "weight_gradients_first"]

_raw = tf.raw_ops

# Backward kernels that read a forward activation and the incoming gradient (the
# weight gradient of a convolution, either product of a matrix multiplication),
# and those that read the incoming gradient and a weight (the input gradient).
_READS_ACTIVATION = frozenset({
    "Conv2DBackpropFilter", "Conv2DBackpropFilterV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNativeBackpropFilter", "MatMul", "BatchMatMulV2", "BatchMatMulV3"})
_MAKES_INPUT_GRADIENT = frozenset({
    "Conv2DBackpropInput", "Conv2DBackpropInputV2", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNativeBackpropInput", "MatMul", "BatchMatMulV2", "BatchMatMulV3"})
# A bias's gradient: a reduction of the incoming gradient alone. XLA (TensorFlow
# 2.16's) ran those of a chain's last layers at the end of the step, each holding
# its layer's incoming gradient until then. TensorFlow 2.21's XLA does not, and
# there the wait raised a chain's peak by one incoming gradient: made first only
# before 2.21 (docs/decisions/0036-bias-gradients-under-xla.md).
_REDUCES_GRADIENT = frozenset({"BiasAddGrad"})
_REDUCTIONS_FIRST = tuple(int(part) for part in tf.__version__.split(".")[:2]) < (2, 21)
# Where a tensor comes from a variable (its buffer is the variable's: nothing to free).
_VARIABLE_READS = frozenset({"ReadVariableOp", "Const", "VarHandleOp", "Placeholder"})
# Ops that only read a variable's value.
_PURE_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})
# Backward ops that read only shapes (a convolution's gradient asks for its
# operands' shapes): not a gradient, and they depend on nothing of the backward.
_SHAPES = frozenset({"Shape", "ShapeN", "Size", "Rank", "Const"})


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
        zero = _opaque_zero(_elements(reads, _opaque_zero(arriving)) or arriving)
    else:
        zero = _opaque_zero(present)

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
    zero = _opaque_zero(grads)
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
    zero = _opaque_zero(grads)
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
    zero = _opaque_zero(grads)
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


def _opaque_zero(grads: Sequence[Any]) -> tf.Tensor:
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


def weight_gradients_first(graph: Any, first_op: int, incoming: Any = (),
                           untaken: Sequence[Any] = ()) -> int:
    """Orders each weight gradient of a replay's backward before the input
    gradient made from the same incoming gradient; returns how many edges it added.

    ``graph`` is the ``FuncGraph`` being traced and ``first_op`` the number of
    its operations before the backward was built. A layer's backward reads its
    input ``x`` (for the weight gradient) and its output gradient ``dy``, and
    makes the input gradient ``dx``. The executor runs the two kernels in any
    order; when ``dx`` comes first, ``x``, ``dy`` and ``dx`` are alive at once.
    When the weight gradient runs first and was the last reader of ``x``, ``x``
    is freed before ``dx`` is made. Left to the executor, the replay's peak
    moved from step to step by the size of such a layer's tensors (a
    convolution reading a concatenation, whose gradient the concatenation's
    gradient then slices into copies; see docs/decisions/0002-replay-ordering.md).

    ``incoming`` are the replay's output gradients, made before the backward: a
    gradient too (the region's last convolution reads one, and a region ending
    in it kept its input beside the input gradient until this counted them).

    Only pairs where this cannot create a cycle are ordered: the first kernel
    reads nothing made by the backward but the shared gradient, and the
    activation it reads is not a variable's value (freeing it frees nothing).
    The edges are control edges between two kernels that Grappler keeps (it
    removes only edges implied by data, or on no-op nodes). XLA ignores control
    edges: under XLA the input gradient reads the shared gradient plus an opaque
    zero computed from the weight gradient (a data edge), except where the
    weight gradient feeds one of ``untaken``, the gradients the outer backward
    may never ask for (a frozen Keras layer's weights, which TensorFlow still
    calls trainable): a data edge would make that unused kernel run. Under XLA a
    bias's gradient, which reads the shared gradient alone, is made first too
    before TensorFlow 2.21, whose XLA ran it at the end of the step, holding the
    gradient (2.21's does not, and there the wait costs memory). Eager
    execution runs in program order, so there is nothing to do there.
    """
    operations = graph.get_operations()[first_op:]
    made = {op.name for op in operations}
    gradients = {t.ref() for t in incoming if isinstance(t, tf.Tensor) and t.graph is graph}
    readers: dict[Any, list[Any]] = {}
    for op in operations:
        for tensor in op.inputs:
            if tensor.op.name in made or tensor.op.type not in _VARIABLE_READS:
                readers.setdefault(tensor.ref(), []).append(op)
    by_data = control_flow_util.GraphOrParentsInXlaContext(graph)
    optional = _first_readers_of_activations(untaken, made) if by_data else set()
    rewired: dict = {}
    added = 0
    for op in operations:
        reduces = by_data and _REDUCTIONS_FIRST and op.type in _REDUCES_GRADIENT
        if op.type not in _READS_ACTIVATION and not reduces:
            continue
        inner = [t for t in op.inputs if (t.op.name in made or t.ref() in gradients)
                 and not _shape_of_forward(t, made)]
        outer = [t for t in op.inputs if t.op.name not in made and t.ref() not in gradients
                 and t.op.type not in _VARIABLE_READS and _nbytes(t) > 0]
        if len(inner) != 1 or not (outer or reduces):
            continue  # reads no activation, or more than the one incoming gradient
        gradient = inner[0]
        for other in dict.fromkeys(readers.get(gradient.ref(), ())):
            if (other is op or other.type not in _MAKES_INPUT_GRADIENT
                    or any(t.ref() == x.ref() for t in other.inputs for x in outer)
                    or op in other.control_inputs or _depends_on(op, other, made)):
                continue  # the same activation, already ordered, or a cycle (attention's
                # two products both read an activation: the first one met goes first)
            if by_data and op.name not in optional:
                _wait_by_data(other, gradient, op, made, rewired)
            else:
                other._add_control_input(op)  # noqa: SLF001 - no public API orders two ops
            added += 1
    return added


def _wait_by_data(other: Any, gradient: Any, op: Any, made: set, rewired: dict) -> None:
    """Rewires ``other``'s reads of ``gradient`` to ``gradient + opaque zero of
    op's output``: the same value, made after ``op`` (and after the ops it was
    made to wait for before: ``rewired``). The new ops join ``made``, so that
    later cycle checks walk through them."""
    key = (other.name, gradient.ref())
    read = rewired.get(key, gradient)
    waited = read + tf.cast(_opaque_zero([op.outputs[0]]), gradient.dtype)
    rewired[key] = waited
    pending = [waited.op]
    while pending:
        current = pending.pop()
        made.add(current.name)
        pending.extend(t.op for t in current.inputs
                       if t.op.name not in made and t.op is not gradient.op)
    for k, tensor in enumerate(other.inputs):
        if tensor.ref() == read.ref():
            other._update_input(k, waited)  # noqa: SLF001 - no public API rewires an input


def _first_readers_of_activations(gradients: Sequence[Any], made: set) -> set:
    """Names of the kernels reading an activation that each of ``gradients``
    depends on, first met walking back from it through the backward."""
    found: set = set()
    pending = [g.op for g in gradients if isinstance(g, tf.Tensor) and g.op.name in made]
    seen = {op.name for op in pending}
    while pending:
        current = pending.pop()
        if current.type in _READS_ACTIVATION or current.type in _REDUCES_GRADIENT:
            found.add(current.name)
            continue
        for tensor in current.inputs:
            if tensor.op.name in made and tensor.op.name not in seen:
                seen.add(tensor.op.name)
                pending.append(tensor.op)
    return found


def _depends_on(op: Any, other: Any, made: set) -> bool:
    """Whether ``op`` depends on ``other`` (by data or control) within the backward."""
    pending, seen = [op], set()
    while pending:
        current = pending.pop()
        for before in [t.op for t in current.inputs] + list(current.control_inputs):
            if before is other:
                return True
            if before.name in made and before.name not in seen:
                seen.add(before.name)
                pending.append(before)
    return False


def _shape_of_forward(tensor: Any, made: set) -> bool:
    """Whether ``tensor`` is a shape (or constant) computed from tensors outside the backward."""
    return tensor.op.type in _SHAPES and all(t.op.name not in made for t in tensor.op.inputs)


def _nbytes(tensor: Any) -> int:
    shape = tensor.shape
    if shape.rank is None or not shape.is_fully_defined():
        return 1  # unknown: may be large
    return int(shape.num_elements() or 0) * tensor.dtype.size
