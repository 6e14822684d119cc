"""What each layer of a chain costs in a ``tf.function`` (or XLA) training step.

A ``tf.function`` step keeps fewer bytes than eager backprop (its backward
graph reads only some intermediates, and frees them as it goes), so each layer
runs its forward and backward as one graph, with the allocator read at a
``py_function`` between the two (:func:`graph_profile`), and the whole chain's
plain step is measured as one graph (``_whole_step.graph_plain_step``), which the
planners calibrate their per-layer numbers to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import tensorflow as tf

from tf_checkpointing.core._structure import is_differentiable
from tf_checkpointing.planning._constants import GRAPH_RUNS as _GRAPH_RUNS
from tf_checkpointing.planning.measuring import _progress
from tf_checkpointing.planning.measuring._allocator import (
    Allocator,
    median,
    median_settled,
    nbytes,
    planning_function,
    sync,
)
from tf_checkpointing.planning.measuring._backward_reads import BackwardReads, backward_reads
from tf_checkpointing.planning.measuring._layer_profile import (
    ChainProfile,
    LayerProfile,
    forward_seconds,
    taped,
    untaped_pass,
)
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.measuring._whole_step import graph_plain_step

__all__: list[str] = []


def graph_profile(calls, x, device, names, same_as, mode: Mode, applied=False,
                  trainable=None) -> ChainProfile:
    """The profile of a ``tf.function`` training step (``mode``: graph), or of
    one compiled by XLA (``mode``: xla), whose plain step is then measured compiled (and the
    ``tf.function`` one, which no XLA plan reads, not at all; see
    :func:`profile_chain`)."""
    graphs = [planning_function(call) if same_as[i] == i else call
              for i, call in enumerate(calls)]
    y = x
    for k, graph in enumerate(graphs):  # trace them before any reading
        y = graph(y)
        _progress.step("tracing layer calls", k + 1, len(graphs))
    # A replay runs inside the step's graph: it does not pay the launch of a
    # function per layer, which timing each layer's graph alone includes.
    identity = planning_function(_identity)
    sync(identity(x))  # traced
    launch = forward_seconds(identity, x)
    untaped, seconds, sizes = untaped_pass(graphs, x, device, call_overhead=launch,
                                           same_as=same_as)
    inputs = x
    layers: list[Any] = []
    grad_sizes: list[Any] = []
    y_grad_bytes = 0
    for i, call in enumerate(calls):
        _progress.step("measuring layer calls", i + 1, len(calls))
        j = same_as[i]
        if j != i:  # the same computation as an earlier call: its readings
            layers.append(dataclasses.replace(layers[j], name=names[i]))
            y = call(x)
            x_grad_bytes = nbytes([t for t in tf.nest.flatten(x) if is_differentiable(t)])
            y_grad_bytes = nbytes([t for t in tf.nest.flatten(y) if is_differentiable(t)])
            grad_sizes.append(x_grad_bytes)
            x = y
            continue
        y = graphs[i](x)
        layer, x_grad_bytes, y_grad_bytes = _graph_layer(call, x, y, device, names[i])
        layers.append(dataclasses.replace(layer, untaped_peak_bytes=untaped[i],
                                          seconds=seconds[i]))
        grad_sizes.append(x_grad_bytes)
        x = y
    grad_sizes.append(y_grad_bytes)
    # Last: its updates, and putting the weights back, change the pool the
    # per-call readings are taken in, which moved the readings after it from
    # run to run (see docs/decisions/0027-graph-profile-readings.md).
    xla = mode is Mode.XLA
    _progress.stage("compiling and measuring the plain XLA step" if xla
                    else "measuring the plain step")
    plain = graph_plain_step(calls, inputs, device, xla, applied, trainable)
    return ChainProfile(layers=tuple(layers), boundary_bytes=tuple(sizes),
                        boundary_grad_bytes=tuple(grad_sizes), plain_peak_bytes=plain.peak_bytes,
                        device=device, mode=mode, plain_step_seconds=plain.seconds)


def _graph_layer(call, x, y, device, name) -> tuple[LayerProfile, int, int]:
    """One layer's forward and backward as one graph, with the allocator read
    at the point between them (a ``py_function`` that the output gradient
    waits on): what is held there is what the graph keeps for the backward.
    ``y`` is ``call(x)``, held during the readings as a chain holds it.

    The executor runs independent ops in any order, so what is held varies
    from run to run (see docs/decisions/0027-graph-profile-readings.md); the profile
    keeps the median of a few runs.
    """
    allocator = Allocator(device)
    readings: list[tuple[int, int]] = []
    traced: list[Any] = []  # the graph, its first backward op, the leaves, the reader

    def read_and_reset(*outputs: tf.Tensor) -> tf.Tensor:
        readings.append((allocator.current(), allocator.peak_since_mark()))
        allocator.mark()
        return tf.constant(1.0)

    def step(x: Any) -> tuple[list[Any], list[Any]]:
        tape, read, y = taped(call, x)
        first_backward_op = len(tf.compat.v1.get_default_graph().get_operations())
        leaves = [t for t in tf.nest.flatten(x) if is_differentiable(t)]
        outputs = [t for t in tf.nest.flatten(y) if is_differentiable(t)]
        # Takes the outputs, so they are held at the reading, as in a chain,
        # where each output is the next layer's input.
        one = tf.py_function(read_and_reset, outputs, tf.float32)
        graph = tf.compat.v1.get_default_graph()
        traced[:] = [graph, first_backward_op, tf.nest.flatten(read), tf.nest.flatten(y), one.op]
        variables = list(tape.watched_variables())
        grads = tape.gradient(outputs, leaves + variables,
                              output_gradients=[tf.fill(tf.shape(t), tf.cast(one, t.dtype))
                                                for t in outputs],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return grads[:len(leaves)], grads[len(leaves):]

    graph = planning_function(step)
    sync(graph(x))  # trace and warm up
    outputs = [t for t in tf.nest.flatten(y) if is_differentiable(t)]
    kept, forward, total, after = [], [], [], []
    # The executor's order, so what is held, varies: up to _GRAPH_RUNS runs.
    while len(kept) < _GRAPH_RUNS and not median_settled(list(zip(kept, forward, after)),
                                                          _GRAPH_RUNS):
        readings.clear()
        before = allocator.mark()
        x_grads, weight_grads = graph(x)
        sync(x_grads + weight_grads)
        (between, forward_peak), = readings
        kept.append(between - before)
        forward.append(forward_peak - before)
        after.append(allocator.peak_since_mark() - before)
        total.append(max(forward_peak - before, after[-1]))
    # The output gradient, allocated after the reading, is the model's own term.
    above_kept = median(after) - median(kept) - nbytes(outputs)
    layer = LayerProfile(
        name=name, kept_bytes=median(kept), forward_peak_bytes=median(forward),
        untaped_peak_bytes=0,
        backward_peak_bytes=max(0, median(total) - median(kept) - nbytes(outputs)),
        weight_grad_bytes=nbytes(weight_grads), seconds=0.0,
        # The outputs held at the reading may be freed before the backward
        # allocates (a BatchNorm's: its backward reads its input, not its
        # output), which the replay model needs to know (see _regions).
        backward_alone_bytes=above_kept, backward_reads=_reads(traced))
    return layer, nbytes(x_grads), nbytes(outputs)


def _reads(traced: list[Any]) -> Optional[BackwardReads]:
    """What the backward of the measured graph reads of the call's leaves (the
    ``py_function`` that reads the allocator is the measurement's, not the
    backward's); None where it cannot be read."""
    try:
        graph, first_backward_op, inputs, outputs, reader = traced
        return backward_reads(graph, first_backward_op, inputs, outputs, ignore=[reader])
    except Exception:  # noqa: BLE001 - the saved tensors are then traced on their own
        return None


def _identity(x: Any) -> Any:
    return tf.nest.map_structure(lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, x)
