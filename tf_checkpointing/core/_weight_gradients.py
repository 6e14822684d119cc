"""Each weight gradient of a replay's backward made before the input gradient that
shares its incoming gradient.

A layer's backward reads its input (for the weight gradient) and its output
gradient, and makes the input gradient. Left to the executor, the two kernels
run in either order, and when the input gradient comes first, the input, the
output gradient and the input gradient are alive at once: a replay's peak moved
from step to step by the size of such a layer's tensors
(docs/decisions/0002-replay-ordering.md). :func:`weight_gradients_first` orders
them, with control edges in a graph and data edges under XLA, which ignores
control edges. The rest of a replay's ordering is in :mod:`._ordering`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_checkpointing.core._internals import control_flow_util
from tf_checkpointing.core._ordering import opaque_zero

__all__ = ["weight_gradients_first"]

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
# Backward ops that read only shapes (a convolution's gradient asks for its
# operands' shapes): not a gradient, and they depend on nothing of the backward.
_SHAPES = frozenset({"Shape", "ShapeN", "Size", "Rank", "Const"})


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
    waited = read + tf.cast(opaque_zero([op.outputs[0]]), gradient.dtype)
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
