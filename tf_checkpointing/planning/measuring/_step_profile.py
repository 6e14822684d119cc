"""What each layer of a chain costs in a ``tf.function`` (or XLA) training step.

A ``tf.function`` step keeps fewer bytes than eager backprop (its backward
graph reads only some intermediates, and frees them as it goes), so each layer
runs its forward and backward as one graph, with the allocator read at a
``py_function`` between the two (:func:`graph_profile`), and the whole chain's
plain step is measured as one graph (:func:`graph_plain_step`), which the
planners calibrate their per-layer numbers to.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

import keras
import tensorflow as tf

from tf_checkpointing.core._structure import is_differentiable
from tf_checkpointing.planning._constants import GRAPH_RUNS as _GRAPH_RUNS
from tf_checkpointing.planning._constants import PLAIN_STEPS as _PLAIN_STEPS
from tf_checkpointing.planning._constants import TIMED_STEPS as _TIMED_STEPS
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
from tf_checkpointing.planning.measuring._requested import requested_peak

__all__ = ["StepReading", "variable_ids"]


class StepReading(NamedTuple):
    """A measured training step: its peak (bytes above the level before it) and
    its time (seconds, the least of a few warm runs; None: not timed)."""

    peak_bytes: int
    seconds: Optional[float] = None

# _GRAPH_RUNS: runs of each layer's graph; the profile keeps the median readings.
# _PLAIN_STEPS: plain steps measured (not under XLA, whose buffer is the same in each).


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
        tape, y = taped(call, x)
        first_backward_op = len(tf.compat.v1.get_default_graph().get_operations())
        leaves = [t for t in tf.nest.flatten(x) if is_differentiable(t)]
        outputs = [t for t in tf.nest.flatten(y) if is_differentiable(t)]
        # Takes the outputs, so they are held at the reading, as in a chain,
        # where each output is the next layer's input.
        one = tf.py_function(read_and_reset, outputs, tf.float32)
        graph = tf.compat.v1.get_default_graph()
        traced[:] = [graph, first_backward_op, tf.nest.flatten(x), tf.nest.flatten(y), one.op]
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


def graph_plain_step(calls, x, device, jit_compile: bool = False,
                     applied: bool = False,
                     trainable: Optional[Sequence[Any]] = None,
                     timed: bool = True) -> StepReading:
    """Peak and time of the chain's plain forward and backward as one ``tf.function``
    (with ``applied``: each weight gradient consumed at once by an SGD update,
    as by an optimizer; their values are put back after). The gradients are of
    the inputs and every variable the tape watched, or, given ``trainable``, of
    those variables only, as ``Model.fit`` asks for them: a graph then keeps
    nothing for the calls of a frozen backbone (whose variables the tape still
    watches).

    Why a real update: an update makes ``learning_rate * grad`` (a temporary of
    the weight's size) and, while the layer's input gradient still reads the
    weight, a copy of the weight (a variable's buffer still read is copied on
    write). A step whose gradients were only summed read below ``Model.fit``'s
    step, and a plan calibrated to it overran its budget (see
    docs/decisions/0028-plain-step-with-an-update.md).

    The time (``timed``; else None) is the least of a few warm steps, taken
    after the peak's readings (the time model of whole-model plans starts from
    it, see docs/decisions/0039-step-time-model.md). Only the steps the time
    model reads are timed: a plan measured for its peak alone is not.

    An XLA step (``jit_compile``) is measured as a training step too: the
    gradient of a loss (half the outputs' sum of squares) and the update. XLA
    schedules the whole step as one program, and both move its buffer: with
    gradients only summed it read below a step with Keras' SGD, with an output
    gradient of ones above it; with both, the same bytes as Keras' SGD step
    (see docs/decisions/0023-xla-plans.md)."""
    (reading,) = graph_steps([calls], x, device, jit_compile, applied, trainable, timed)
    return reading


def graph_steps(chains: Sequence[Any], x: Any, device: str, jit_compile: bool = False,
                applied: bool = False, trainable: Optional[Sequence[Any]] = None,
                timed: bool = True) -> list[StepReading]:
    """:func:`graph_plain_step` of each of ``chains`` (lists of calls), their
    peaks measured one after the other and, ``timed``, their times taken in
    alternation: a run of each in every round, the least of each kept. The time
    model reads the difference of two steps' times (a plan's replays against
    the plain step); timed one after the other, a change in the machine's load
    between them lands in that difference, timed in rounds it slows both."""
    steps, updated = [], []
    for calls in chains:
        step, writes = _training_step(calls, x, jit_compile, applied, trainable)
        steps.append(step)
        updated += [v for v in writes if all(v is not u for u in updated)]
    # Copies: on CPU a variable's .numpy() can share its buffer, and the step's
    # first update would then copy every weight and hold both in the pool.
    saved = [v.numpy().copy() for v in updated]
    try:
        peaks = []
        for step in steps:
            sync(step(x))  # warm up
            peaks.append(_step_peak(lambda step=step: sync(step(x)), device, jit_compile))
        seconds = (interleaved_seconds([lambda step=step: sync(step(x)) for step in steps])
                   if timed else [None] * len(steps))
        return [StepReading(peak, time) for peak, time in zip(peaks, seconds)]
    finally:
        for variable, value in zip(updated, saved):
            variable.assign(value)


def _training_step(calls, x, jit_compile: bool, applied: bool,
                   trainable: Optional[Sequence[Any]]) -> tuple[Any, list[tf.Variable]]:
    """The step of :func:`graph_plain_step`, traced, and the variables it updates."""
    updated: list[tf.Variable] = []  # filled when traced

    def chain(x: Any) -> list[Any]:
        tape, y = taped(lambda x: run_all(calls, x), x, watch=trainable is None)
        sources, grads = _backprop(tape, x, y, trainable, like_a_loss=jit_compile)
        # The outputs' sums, as a loss reads them: with nothing to differentiate
        # (every layer frozen) the forward still runs, and is measured.
        losses = [tf.reduce_sum(t) for t in tf.nest.flatten(y) if is_differentiable(t)]
        if not applied:
            return grads + losses
        consumed = []
        for source, grad in zip(sources, grads):
            if isinstance(source, tf.Variable):
                updated.append(source)
                _sgd_update(source, grad)
            else:
                consumed.append(tf.reduce_sum(grad))
        return consumed + losses

    step = planning_function(chain, jit_compile=jit_compile)
    step.get_concrete_function(x)  # traced: `updated` is known
    return step, updated


def _step_peak(run: Callable[[], Any], device: str, jit_compile: bool) -> int:
    """The peak of a warm step ``run()``: under XLA the bytes its one buffer
    requests (the chunk it lands in depends on what the planner's own
    measurements left in the pool, see _requested), else the median of a few
    steps' chunks (which updates overlap which backward ops is the executor's
    choice, and moves a step's peak; see docs/decisions/0027-graph-profile-readings.md)."""
    allocator = Allocator(device)
    start = allocator.mark()
    if jit_compile:
        requested = requested_peak(run, device)
        if requested is not None:
            return requested
        return max(0, allocator.peak_since_mark() - start)  # that step's chunks
    peaks: list[int] = []
    while len(peaks) < _PLAIN_STEPS and not median_settled(peaks, _PLAIN_STEPS):
        start = allocator.mark()
        run()
        peaks.append(max(0, allocator.peak_since_mark() - start))
    return median(peaks)


def step_seconds(run: Callable[[], Any], runs: int = _TIMED_STEPS) -> float:
    """The least time of ``runs`` warm runs of ``run()`` (each waiting for its
    result): the least is the step's time with the least interference from
    whatever else the machine runs."""
    (best,) = interleaved_seconds([run], runs)
    return best


def interleaved_seconds(runs: Sequence[Callable[[], Any]],
                        rounds: int = _TIMED_STEPS) -> list[float]:
    """The least time of each of ``runs`` (warm, each waiting for its result)
    over ``rounds`` rounds that run each once, in turn."""
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for k, run in enumerate(runs):
            started = time.perf_counter()
            run()
            best[k] = min(best[k], time.perf_counter() - started)
    return best


def eager_plain_peak(calls, x, device, trainable: Optional[Sequence[Any]] = None) -> int:
    """Peak of the chain's forward and backward run eagerly, as an eager training
    step runs it: the tape keeps what each op's gradient needs, and the weight
    gradients are all held until an optimizer would apply them. The median of a
    few steps, after one that builds what the calls build once."""
    def step() -> list[Any]:
        tape, y = taped(lambda x: run_all(calls, x), x, watch=trainable is None)
        return _backprop(tape, x, y, trainable, like_a_loss=True)[1]

    sync(step())  # warm up
    allocator = Allocator(device)
    peaks: list[int] = []
    while len(peaks) < _PLAIN_STEPS and not median_settled(peaks, _PLAIN_STEPS):
        start = allocator.mark()
        grads = step()
        peaks.append(max(0, allocator.peak_since_mark() - start))
        del grads
    return median(peaks)


def _sgd_update(variable: tf.Variable, grad: Any, learning_rate: float = 1e-3) -> None:
    """``variable -= learning_rate * grad``, as Keras' SGD (a sparse gradient
    scattered)."""
    if isinstance(grad, tf.IndexedSlices):
        variable.scatter_sub(tf.IndexedSlices(
            tf.cast(grad.values, variable.dtype) * learning_rate, grad.indices, grad.dense_shape))
    else:
        variable.assign_sub(tf.cast(grad, variable.dtype) * learning_rate)


def _backprop(tape: tf.GradientTape, x: Any, y: Any,
              trainable: Optional[Sequence[Any]] = None,
              like_a_loss: bool = False) -> tuple[list[Any], list[Any]]:
    """The sources (every differentiable input leaf and variable, or the
    ``trainable`` variables only) and their gradients (zeros for those not
    connected), for an output gradient of ones or, ``like_a_loss``, of the
    outputs themselves (the gradient of half their sum of squares).

    XLA compiles a constant output gradient into the backward and schedules the
    step otherwise than for a loss's gradient, which depends on the outputs:
    with ones a plan's step needed a larger buffer than with the outputs, as
    with a mean-square loss and Keras' SGD (see docs/decisions/0023-xla-plans.md)."""
    leaves = [t for t in tf.nest.flatten(x) if is_differentiable(t)]
    outputs = [t for t in tf.nest.flatten(y) if is_differentiable(t)]
    watched = list(tape.watched_variables())
    if trainable is None:
        sources = leaves + watched
    else:  # what the tape watched of them (a mirrored variable's local copy)
        handles = variable_ids(trainable)
        sources = [v for v in watched if id(v) in handles]
    return sources, tape.gradient(outputs, sources,
                                  output_gradients=[t if like_a_loss else tf.ones_like(t)
                                                    for t in outputs],
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)


def variable_ids(variables: Sequence[Any]) -> set[int]:
    """The ids of the TensorFlow variables behind Keras ``variables``: each one's
    own, and under a distribution strategy each replica's (outside a replica a
    mirrored variable cannot be differentiated, but the copy the tape watched can)."""
    out: set[int] = set()
    for variable in variables:
        value = variable.value if isinstance(variable, keras.Variable) else variable
        out.add(id(value))
        out.update(id(v) for v in getattr(value, "values", ()))
    return out


def _identity(x: Any) -> Any:
    return tf.nest.map_structure(lambda t: tf.identity(t) if isinstance(t, tf.Tensor) else t, x)


def run_all(calls, x):
    for call in calls:
        x = call(x)
    return x
