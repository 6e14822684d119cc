"""Which tensors of each layer call its backward reads: inputs, and its own outputs.

A tensor that no backward reads lives only as long as the forward reads it:
an encoder's skip, read by ``MaxPooling2D`` inside an encoder region and then
only by the decoder's ``Concatenate`` (whose gradient slices the incoming
gradient and needs only the shapes), is free once the concatenation ran. The
memory model (:mod:`._regions`) needs to know this to tell such a skip from one
a later region keeps as its input until its backward: plans it could not tell
apart differ in their peaks (see docs/design.md#memory-model).

A call's own output can be read by its backward too (``relu``'s gradient reads
its output): such an output is held until that backward even when no later
backward reads it (a decoder stage's last ``relu``, read next only by
``UpSampling2D``), so :func:`saved_tensors` says which.

The answer is read from the call's gradient graph, traced (never run) once per
distinct call: a tensor is read by the backward if an op of the gradient (other
than a shape query, which constant folding removes) consumes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_checkpointing.core._structure import is_differentiable
from tf_checkpointing.planning._graph import GraphCall, LayerGraph, run_call

__all__: list[str] = []

# Ops that read only a tensor's shape (folded to constants for static shapes).
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs"})
_PASS_THROUGH = frozenset({"Identity", "IdentityN"})


def saved_tensors(graph: LayerGraph,
                  same_as: Sequence[int]) -> list[tuple[frozenset, frozenset]]:
    """For each call, the keys among its ``in_keys`` and among its ``out_keys``
    that its backward reads.

    ``same_as[i]`` is the first call computing the same thing as call ``i``
    (same layer configuration and argument shapes), whose answer it shares.

    Example:
        >>> import keras
        >>> from tf_checkpointing.planning._graph import read_graph
        >>> from tf_checkpointing.planning._saved_tensors import saved_tensors
        >>> a, b = keras.Input((4,)), keras.Input((4,))
        >>> h = keras.layers.Dense(4)(keras.layers.Concatenate()([a, b]))
        >>> graph = read_graph(keras.Model([a, b], h), "example")
        >>> [len(inputs) for inputs, _ in saved_tensors(graph, [0, 1])]  # concat: none; dense: x
        [0, 1]
        >>> relu = keras.layers.ReLU()(a)
        >>> graph = read_graph(keras.Model(a, relu), "example")
        >>> [len(outputs) for _, outputs in saved_tensors(graph, [0])]  # relu's grad reads y
        [1]
    """
    out: list[tuple[frozenset, frozenset]] = []
    for i, call in enumerate(graph.calls):
        j = same_as[i]
        if j != i:
            first = graph.calls[j]
            inputs = frozenset(call.in_keys[first.in_keys.index(k)] for k in out[j][0])
            outputs = frozenset(call.out_keys[first.out_keys.index(k)] for k in out[j][1])
            out.append((inputs, outputs))
            continue
        try:
            out.append(_saved(call))
        except Exception:  # noqa: BLE001 - unknown: assume the backward reads everything
            out.append((frozenset(call.in_keys), frozenset(call.out_keys)))
    return out


def _saved(call: GraphCall) -> tuple[frozenset, frozenset]:
    """The keys of ``call.in_keys`` and of ``call.out_keys`` that an op of its
    gradient graph consumes."""
    by_key = dict(zip(call.arg_keys, call.arguments.keras_tensors))
    keys = call.in_keys
    specs = [tf.TensorSpec(by_key[k].shape, by_key[k].dtype) for k in keys]
    first_backward_op: list[int] = []
    made: dict[Any, Any] = {}

    def forward_and_backward(*values: tf.Tensor) -> list[Any]:
        env = dict(zip(keys, values))
        watched = [v for v in values if is_differentiable(v)]
        with tf.GradientTape() as tape:
            tape.watch(watched)
            run_call(call, env, {"training": True})
        made.update((k, env[k]) for k in call.out_keys)
        outputs = [env[k] for k in call.out_keys if is_differentiable(env[k])]
        first_backward_op.append(len(tf.compat.v1.get_default_graph().get_operations()))
        return tape.gradient(outputs, watched + list(tape.watched_variables()),
                             unconnected_gradients=tf.UnconnectedGradients.ZERO)

    func = tf.function(forward_and_backward, autograph=False).get_concrete_function(*specs)
    operations = func.graph.get_operations()
    backward = {op.name for op in operations[first_backward_op[0]:]}
    inputs = {key for key, placeholder in zip(keys, func.graph.inputs[:len(keys)])
              if _read_by(placeholder, backward)}
    # An output is the model's input passed through (an Identity of a placeholder)
    # only in degenerate layers; a tensor made in the forward is read by the backward
    # if a gradient op consumes it.
    outputs = {key for key, value in made.items()
               if isinstance(value, tf.Tensor) and value.op.name not in backward
               and _read_by(value, backward)}
    return frozenset(inputs), frozenset(outputs)


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
