"""Reuse the forward's random keep-masks in the replay instead of drawing them again.

Dropout draws a uniform random tensor and compares it with the rate
(``keras.layers.Dropout``, ``MultiHeadAttention(dropout=...)`` and
``tf.nn.experimental.stateless_dropout`` all do ``uniform >= rate``). The
replay would draw the same numbers again (``_state`` makes sure of that), but
random numbers are expensive on CPU: measured on the GPT-2-style benchmark
decoder under ``tf.function``, dropout's draws are 27% of the forward pass.

Inside a graph, :class:`MaskReuse` records the boolean output of each
comparison whose input comes straight from a stateless uniform draw, and makes
the replay use those tensors instead of its own comparisons. The replay's
draws then have no consumer and are pruned. The masks are kept from the
forward to the backward pass: one byte per element, a quarter of the float
activations they gate. The replay's masks equal the forward's by construction.
Eager mode cannot swap an op's outputs; there the draws are replayed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.framework import op_callbacks

__all__: list[str] = []

_COMPARISONS = frozenset(("GreaterEqual", "Greater", "Less", "LessEqual"))


_SCALING = frozenset(("AddV2", "Add", "Mul", "Cast", "Identity"))


def _is_mask_of_a_draw(op_type: str, inputs: Any, outputs: Any) -> bool:
    """A comparison of a uniform draw (scaled to [minval, maxval) by
    ``tf.random.stateless_uniform``: ``draw * (max - min) + min``)."""
    if op_type not in _COMPARISONS or not inputs or not outputs:
        return False
    producer = getattr(inputs[0], "op", None)
    for _ in range(4):
        if producer is None:
            return False
        if producer.type.startswith("StatelessRandomUniform"):
            return True
        if producer.type not in _SCALING or not producer.inputs:
            return False
        producer = producer.inputs[0].op
    return False


class MaskReuse:
    """Records masks during a forward built in a graph, swaps them in during
    its replay (in the same order; from the first mismatch on, the replay
    draws its own, which ``_state`` keeps equal)."""

    def __init__(self) -> None:
        self._masks: list[tf.Tensor] = []
        self._graph: Optional[tf.Graph] = None
        self._next = 0

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        if tf.executing_eagerly():
            yield
            return
        self._graph = tf.compat.v1.get_default_graph()
        with _callback(self._record):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        if not self._masks or tf.executing_eagerly():
            yield
            return
        self._next = 0
        replay_graph = tf.compat.v1.get_default_graph()

        def swap(op_type, inputs, attrs, outputs, op_name=None, graph=None):
            if graph is not replay_graph or not _is_mask_of_a_draw(op_type, inputs, outputs):
                return outputs
            if self._next >= len(self._masks):
                return outputs
            mask = self._masks[self._next]
            if mask.dtype != outputs[0].dtype or not mask.shape.is_compatible_with(
                    outputs[0].shape):
                self._next = len(self._masks)  # out of step: stop swapping
                return outputs
            self._next += 1
            return [mask]

        with _callback(swap):
            yield

    def _record(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is self._graph and _is_mask_of_a_draw(op_type, inputs, outputs):
            self._masks.append(outputs[0])
        return outputs  # unchanged: TensorFlow passes them to the next callback


@contextlib.contextmanager
def _callback(callback: Any) -> Iterator[None]:
    op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(callback)
