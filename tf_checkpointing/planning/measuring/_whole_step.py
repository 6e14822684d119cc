"""A whole training step measured: its peak, and its time where the time model needs it.

The planners calibrate their per-layer numbers to the plain step, measured as
one graph (:func:`graph_plain_step`: a ``tf.function``, or an XLA program), and
check the plans they doubt by measuring their steps the same way
(:func:`graph_steps`, ``solving._xla.measure_plan``); an eager step is measured
as eager backprop runs it (:func:`eager_plain_peak`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

import keras
import tensorflow as tf

from tf_checkpointing.core._structure import is_differentiable
from tf_checkpointing.planning._constants import PLAIN_STEPS as _PLAIN_STEPS
from tf_checkpointing.planning._constants import TIMED_STEPS as _TIMED_STEPS
from tf_checkpointing.planning.measuring._allocator import (
    Allocator,
    median,
    median_settled,
    planning_function,
    sync,
)
from tf_checkpointing.planning.measuring._layer_profile import taped
from tf_checkpointing.planning.measuring._requested import requested_peak

__all__ = ["StepReading", "variable_ids"]


class StepReading(NamedTuple):
    """A measured training step: its peak (bytes above the level before it) and
    its time (seconds, the least of a few warm runs; None: not timed)."""

    peak_bytes: int
    seconds: Optional[float] = None


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

    The time (``timed``; else None) is the least of a few warm steps, the
    peak's readings among them (the time model of whole-model plans starts from
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
        peaks, peak_runs = [], []
        for step in steps:
            sync(step(x))  # warm up
            peak, run_seconds = _step_peak(lambda step=step: sync(step(x)), device, jit_compile)
            peaks.append(peak)
            peak_runs.append(run_seconds)
        if not timed:
            return [StepReading(peak) for peak in peaks]
        if len(steps) == 1:
            # One step: its peak's runs are warm runs too, timed; only the rest are run.
            more = interleaved_seconds([lambda: sync(steps[0](x))],
                                       rounds=max(0, _TIMED_STEPS - len(peak_runs[0])))
            return [StepReading(peaks[0], min([*peak_runs[0], *more]))]
        seconds = interleaved_seconds([lambda step=step: sync(step(x)) for step in steps])
        return [StepReading(peak, time) for peak, time in zip(peaks, seconds)]
    finally:
        for variable, value in zip(updated, saved):
            variable.assign(value)


def _training_step(calls, x, jit_compile: bool, applied: bool,
                   trainable: Optional[Sequence[Any]]) -> tuple[Any, list[tf.Variable]]:
    """The step of :func:`graph_plain_step`, traced, and the variables it updates."""
    updated: list[tf.Variable] = []  # filled when traced

    def chain(x: Any) -> list[Any]:
        tape, _, y = taped(lambda x: run_all(calls, x), x, watch=trainable is None)
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


def _step_peak(run: Callable[[], Any], device: str,
               jit_compile: bool) -> tuple[int, list[float]]:
    """The peak of a warm step ``run()``, and the seconds of the runs that read
    it (none under XLA, whose run is traced by the profiler): under XLA the
    bytes its one buffer requests (the chunk it lands in depends on what the
    planner's own measurements left in the pool, see _requested), else the median
    of a few steps' chunks (which updates overlap which backward ops is the
    executor's choice, and moves a step's peak; see
    docs/decisions/0027-graph-profile-readings.md)."""
    allocator = Allocator(device)
    start = allocator.mark()
    if jit_compile:
        requested = requested_peak(run, device)
        if requested is not None:
            return requested, []
        return max(0, allocator.peak_since_mark() - start), []  # that step's chunks
    peaks: list[int] = []
    seconds: list[float] = []
    while len(peaks) < _PLAIN_STEPS and not median_settled(peaks, _PLAIN_STEPS):
        start = allocator.mark()
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
        peaks.append(max(0, allocator.peak_since_mark() - start))
    return median(peaks), seconds


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
        tape, _, y = taped(lambda x: run_all(calls, x), x, watch=trainable is None)
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


def run_all(calls, x):
    for call in calls:
        x = call(x)
    return x
