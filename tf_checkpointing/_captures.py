"""Refuse tensors that a checkpointed function closes over and a tape watches.

The gradient of a checkpointed call flows only to its arguments and to the
variables it reads. A tensor it uses from an enclosing scope, computed under
the tape from something trainable (``scale = w * 3`` outside,
``lambda x: x * scale`` inside), would silently get no gradient, so ``w``
would stop training. ``tf.recompute_grad`` has the same hole. We record the
tensors that the forward's ops consume but that were made outside the call;
if a tape is watching one of them, the call fails with an error that says to
pass it as an argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.framework import op_callbacks

__all__: list[str] = []


class CaptureGuard:
    """Op callback over a forward pass; :meth:`check` raises after it."""

    def __init__(self, name: str, arguments: Sequence[tf.Tensor]) -> None:
        self._name = name
        self._known = {id(t) for t in arguments}
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
            for tensor in inputs:
                if self._made_outside(tensor):
                    self._outside[id(tensor)] = tensor
            if outputs:
                self._known.update(id(t) for t in outputs)
        return outputs  # unchanged: TensorFlow passes them to the next callback

    def _made_outside(self, tensor: Any) -> bool:
        if not isinstance(tensor, tf.Tensor) or id(tensor) in self._known:
            return False
        return tensor.dtype.is_floating or tensor.dtype.is_complex

    def check(self) -> None:
        """Raises if a tape watches a tensor the function used from outside."""
        for tensor in self._outside.values():
            if record.should_record_backprop([tensor]):
                raise ValueError(
                    f"checkpointable: `{self._name}` uses a tensor it did not receive as an "
                    f"argument ({_describe(tensor)}), and a GradientTape is watching it. Its "
                    "gradient would be lost, because a checkpointed call passes gradients "
                    "only to its arguments and to the variables it reads. Pass the tensor "
                    "as an argument, e.g. block(x, scale, _checkpoint=True) instead of "
                    "closing over `scale`."
                )


def _describe(tensor: tf.Tensor) -> str:
    name = "" if tf.executing_eagerly() else f"{tensor.name}, "
    return f"{name}shape={tensor.shape}, dtype={tensor.dtype.name}"
