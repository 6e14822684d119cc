"""Replays inside ``tf.while_loop`` / ``tf.scan`` / ``tf.cond`` bodies.

A checkpointed call in the body of a loop or a branch, inside ``tf.function``,
is replayed while TensorFlow builds the gradient of that body: in a special
gradient graph that may use a tensor from outside only through the body's
forward graph (TensorFlow's own gradients only touch the forward op's inputs
and outputs, so they never notice). The replay runs the user's function again,
and that function reads variables and closed-over tensors straight from
outside: from eager (a variable's handle, a large constant) or from an
enclosing graph. ``while_v2`` then fails with "... is in list of
internal_captures but not in internal_capture_to_output" and ``cond_v2`` with
an ``AssertionError`` (TF #55304: why ``tf.recompute_grad`` fails in
``tf.scan``, and why a Keras RNN with a checkpointed cell fails in ``fit``).

:class:`CaptureMap` mends it the way TensorFlow's gradients work: it records,
while the forward runs in a graph, what each outside tensor was captured as
(every op input from outside goes through ``FuncGraph.capture``), and makes the
replay capture those forward-graph tensors instead, so that the loop or branch
gradient wires them as its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_checkpointing.core._internals import func_graph

__all__: list[str] = []

_Hook = Callable[[Callable[..., Any], Any, Optional[str], Any], Any]


class CaptureMap:
    """What the forward's graph captured, for the replay to capture the same.

    ``recording()`` brackets the forward, ``replaying()`` the replay; both do
    nothing in eager mode and when the replay is not built in the gradient
    graph of the forward's own loop body or branch.
    """

    def __init__(self) -> None:
        self._graph: Optional[func_graph.FuncGraph] = None
        self._captured: dict[int, tuple[Any, Any]] = {}  # id(outside) -> (outside, inside)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        graph = tf.compat.v1.get_default_graph()
        if not isinstance(graph, func_graph.FuncGraph):
            yield
            return
        self._graph = graph

        def record(capture, tensor, name, shape):
            inside = capture(tensor, name, shape)
            if inside is not tensor:
                self._captured[id(tensor)] = (tensor, inside)
            return inside

        with _hooked_capture(graph, record):
            yield

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        graph = tf.compat.v1.get_default_graph()
        if self._graph is None or getattr(graph, "_forward_graph", None) is not self._graph:
            yield
            return

        def redirect(capture, tensor, name, shape):
            seen = self._captured.get(id(tensor))
            if seen is None or seen[0] is not tensor:
                return capture(tensor, name, shape)
            inside = capture(seen[1], name)  # the control-flow gradient's own path
            inside._record_tape(tensor)  # noqa: SLF001 (gradients still reach `tensor`)
            return inside

        with _hooked_capture(graph, redirect):
            yield


@contextlib.contextmanager
def _hooked_capture(graph: func_graph.FuncGraph, hook: _Hook) -> Iterator[None]:
    """Routes ``graph.capture`` through ``hook(capture, tensor, name, shape)``
    for the body; hooks nest (a checkpoint inside a checkpoint)."""
    capture = graph.capture
    nested = getattr(capture, "__func__", None) is not type(graph).capture
    graph.capture = lambda tensor, name=None, shape=None: hook(capture, tensor, name, shape)
    try:
        yield
    finally:
        if nested:
            graph.capture = capture
        else:
            del graph.capture
