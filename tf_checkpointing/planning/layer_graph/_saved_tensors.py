"""Which tensors of each layer call its backward reads: inputs, and its own outputs.

A tensor that no backward reads lives only as long as the forward reads it:
an encoder's skip, read by ``MaxPooling2D`` inside an encoder region and then
only by the decoder's ``Concatenate`` (whose gradient slices the incoming
gradient and needs only the shapes), is free once the concatenation ran. The
memory model (:mod:`..solving._regions`) needs to know this to tell such a skip from one
a later region keeps as its input until its backward: plans it could not tell
apart differ in their peaks (see docs/decisions/0018-memory-model.md).

A call's own output can be read by its backward too (``relu``'s gradient reads
its output): such an output is held until that backward even when no later
backward reads it (a decoder stage's last ``relu``, read next only by
``UpSampling2D``), so :func:`saved_tensors` says which.

The answer is read from the call's gradient graph (:mod:`..measuring._backward_reads`):
from the graph the profile measured the call with, where it was given, else
from one traced (never run) for it, once per distinct call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf

from tf_checkpointing.core._structure import is_differentiable
from tf_checkpointing.planning.layer_graph._layer_graph import GraphCall, LayerGraph, run_call
from tf_checkpointing.planning.measuring._backward_reads import backward_reads

__all__: list[str] = []

Saved = tuple[frozenset, frozenset]  # (input keys, output keys) the backward reads


def saved_tensors(graph: LayerGraph, same_as: Sequence[int],
                  known: Optional[Sequence[Optional[Saved]]] = None) -> list[Saved]:
    """For each call, the keys among its ``in_keys`` and among its ``out_keys``
    that its backward reads.

    ``same_as[i]`` is the first call computing the same thing as call ``i``
    (same layer configuration and argument shapes), whose answer it shares.
    ``known[i]``, where not None, is call ``i``'s answer already read (from the
    profile's graph of the call): it is not traced again.

    Example:
        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> from tf_checkpointing.planning.layer_graph._saved_tensors import saved_tensors
        >>> a, b = keras.Input((4,)), keras.Input((4,))
        >>> h = keras.layers.Dense(4)(keras.layers.Concatenate()([a, b]))
        >>> graph = read_graph(keras.Model([a, b], h))
        >>> [len(inputs) for inputs, _ in saved_tensors(graph, [0, 1])]  # concat: none; dense: x
        [0, 1]
        >>> relu = keras.layers.ReLU()(a)
        >>> graph = read_graph(keras.Model(a, relu))
        >>> [len(outputs) for _, outputs in saved_tensors(graph, [0])]  # relu's grad reads y
        [1]
    """
    out: list[Saved] = []
    for i, call in enumerate(graph.calls):
        j = same_as[i]
        if j != i:
            first = graph.calls[j]
            inputs = frozenset(call.in_keys[first.in_keys.index(k)] for k in out[j][0])
            outputs = frozenset(call.out_keys[first.out_keys.index(k)] for k in out[j][1])
            out.append((inputs, outputs))
        elif known is not None and known[i] is not None:
            out.append(known[i])
        else:
            try:
                out.append(_saved(call))
            except Exception:  # noqa: BLE001 - unknown: assume the backward reads everything
                out.append((frozenset(call.in_keys), frozenset(call.out_keys)))
    return out


def keys_read(call: GraphCall, before: Sequence[Any], after: Sequence[Any],
              reads: Any) -> Optional[Saved]:
    """``call``'s answer from the :class:`~..measuring._backward_reads.BackwardReads` of a
    graph run on the states ``before`` and ``after`` it (the keys alive there,
    in order); None where that graph cannot tell (an output of the call that
    the state after it does not hold, or leaves that are not the keys)."""
    if (reads is None or reads.input_count != len(before)
            or reads.output_count != len(after) or not set(call.out_keys) <= set(after)):
        return None
    in_keys, out_keys = set(call.in_keys), set(call.out_keys)
    return (frozenset(k for p, k in enumerate(before) if p in reads.inputs and k in in_keys),
            frozenset(k for p, k in enumerate(after) if p in reads.outputs and k in out_keys))


def _saved(call: GraphCall) -> Saved:
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
    made_keys = list(made)
    reads = backward_reads(func.graph, first_backward_op[0], func.graph.inputs[:len(keys)],
                           [made[k] for k in made_keys])
    return (frozenset(keys[p] for p in reads.inputs),
            frozenset(made_keys[p] for p in reads.outputs))
