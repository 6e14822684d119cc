"""Refuse tensors that a checkpointed function closes over and a tape watches.

The gradient of a checkpointed call flows only to its arguments and to the
variables it reads. A tensor it uses from an enclosing scope, computed under
the tape from something trainable (``scale = w * 3`` outside,
``lambda x: x * scale`` inside), would silently get no gradient, so ``w``
would stop training. ``tf.recompute_grad`` has the same hole. We record the
tensors that the forward's ops consume but that were made outside the call;
if a tape is watching one of them, the call fails with an error that says to
pass it as an argument.

Inside the body of a ``tf.while_loop`` / ``tf.scan`` / ``tf.map_fn`` or a
``tf.cond`` branch under ``tf.function``, the tensor the call uses is the
body's own placeholder, which no tape watches: we follow it back through the
body to what it was captured from in the enclosing graph (and so on outwards),
and ask the tape there. A tensor that comes from a loop variable of the
enclosing loop cannot be followed (the loop is not built yet), so it is refused
whenever a tape is recording: the error says to pass it as an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf

from tf_checkpointing.core._internals import control_flow_v2_func_graphs as _cf_graphs
from tf_checkpointing.core._internals import func_graph, op_callbacks, record
from tf_checkpointing.core._structure import Consumed, is_differentiable, may_carry_gradient

__all__: list[str] = []


class CaptureGuard:
    """Op callback over a forward pass; :meth:`check` raises after it."""

    def __init__(self, name: str, arguments: Sequence[tf.Tensor]) -> None:
        self._name = name
        # Every tensor an op of the call consumed (by id, with a weak reference
        # that tells a reused id apart and keeps no activation alive), and where
        # it flows, for refuse_chained_outputs.
        self.consumed = Consumed()
        self._arguments = {id(t) for t in arguments}
        self._known = set(self._arguments)
        self._outside: dict[int, tf.Tensor] = {}
        self._graph: Optional[tf.Graph] = None

    def __enter__(self) -> CaptureGuard:
        self._graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        op_callbacks.add_op_callback(self._on_op)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        op_callbacks.remove_op_callback(self._on_op)

    def _on_op(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is self._graph:
            # Only ops with an output a gradient can flow through can carry a
            # gradient path to another output (not tf.shape, argmax, asserts,
            # casts to int ...); whether a path reaches one is asked later.
            if outputs and any(may_carry_gradient(t) for t in outputs):
                self.consumed.record(inputs, outputs)
            for tensor in inputs:
                if self._made_outside(tensor):
                    self._outside[id(tensor)] = tensor
            # A placeholder made during the call is a capture of an outside
            # tensor by a function or control-flow body graph: still outside.
            if outputs and op_type != "Placeholder":
                self._known.update(id(t) for t in outputs)
        return outputs  # unchanged: TensorFlow passes them to the next callback

    def _made_outside(self, tensor: Any) -> bool:
        return id(tensor) not in self._known and is_differentiable(tensor)

    def check(self, argument_leaves: Sequence[Any] = ()) -> None:
        """Raises if a tape watches a tensor the function used from outside.
        ``argument_leaves`` (all leaves of the call's arguments) only serve the
        error message: an argument the call cannot see into is named."""
        for tensor in self._outside.values():
            if _needs_gradient(tensor, self._arguments):
                raise ValueError(
                    f"checkpointable: `{self._name}` uses a tensor it did not receive as an "
                    f"argument ({_describe(tensor)}), and a GradientTape is watching it (or, "
                    "in a loop body, a loop variable it comes from). Its "
                    "gradient would be lost, because a checkpointed call passes gradients "
                    "only to its arguments and to the variables it reads. Pass the tensor "
                    "as an argument, e.g. block(x, scale, _checkpoint=True) instead of "
                    f"closing over `scale`.{_opaque_hint(argument_leaves)}"
                )


def _opaque_hint(leaves: Sequence[Any]) -> str:
    """Names the arguments that hold tensors the call cannot see (an eager
    ``tf.TensorArray``, an object keeping tensors in its attributes)."""
    kinds = sorted({leaf.__class__.__name__ for leaf in leaves if _hides_tensors(leaf)})
    if not kinds:
        return ""
    return (f" It may come from an argument of type {', '.join(kinds)}, whose tensors the "
            "call cannot see: pass the tensors themselves (e.g. ta.stack() for a "
            "TensorArray), or a tuple, dict, dataclass or tf.experimental.ExtensionType.")


def _hides_tensors(leaf: Any) -> bool:
    if isinstance(leaf, tf.TensorArray):
        return True
    attributes = getattr(leaf, "__dict__", None)
    return isinstance(attributes, dict) and not isinstance(leaf, tf.Variable) and any(
        isinstance(value, tf.Tensor) for value in attributes.values())


def _describe(tensor: tf.Tensor) -> str:
    name = "" if tf.executing_eagerly() else f"{tensor.name}, "
    return f"{name}shape={tensor.shape}, dtype={tensor.dtype.name}"


_CONTROL_FLOW_GRAPHS = (_cf_graphs.CondBranchFuncGraph, _cf_graphs.WhileBodyFuncGraph,
                        _cf_graphs.WhileCondFuncGraph)
_MAX_VISITED = 10000  # a trace-time walk through one loop body: bounded, never slow


def _needs_gradient(tensor: tf.Tensor, arguments: set[int]) -> bool:
    """Whether a tape watches ``tensor``, or, inside control-flow bodies, what it
    was computed from in the body or captured from in the enclosing graphs
    (an argument of the call captured into the body is not outside)."""
    stack, seen = [tensor], set[int]()
    while stack and len(seen) < _MAX_VISITED:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if record.should_record_backprop([t]):
            return True
        graph = getattr(t, "graph", None)
        if not isinstance(graph, _CONTROL_FLOW_GRAPHS):
            continue  # eager, or an ordinary graph: the tape has answered
        if t.op.type == "Placeholder":
            external = _captured_from(graph, t)
            if external is not None:
                if id(external) not in arguments:
                    stack.append(external)
            elif _may_carry_gradient(t) and record.could_possibly_record():
                return True  # a loop variable: its origin is not known yet
            continue
        stack.extend(t.op.inputs)
    return False


def _captured_from(graph: func_graph.FuncGraph, placeholder: tf.Tensor) -> Optional[tf.Tensor]:
    for external, internal in graph.captures:
        if internal is placeholder:
            return external
    return None


def _may_carry_gradient(tensor: tf.Tensor) -> bool:
    dtype = tensor.dtype
    return dtype.is_floating or dtype.is_complex or dtype == tf.variant
