"""What each layer of a chain costs in memory and time, measured eagerly.

The planner (:mod:`tf_checkpointing.planning.solving._chain`) needs, per layer, numbers that no
formula gives for arbitrary Keras layers: how many bytes the tape keeps for its
backward (a ``Dense`` keeps its input, a ``relu`` its output, a ``Dropout`` its
mask, a ``LayerNormalization`` its statistics), how much its forward and its
backward allocate on top of that, and how long its forward takes. So we measure
them on the real layers: :func:`untaped_pass` runs the chain once untaped and
:func:`taped_pass` once the way plain eager backprop runs it (every layer under
the tape, then the backward layer by layer, in reverse), reading the device
allocator between layers. (A ``tf.function`` step is profiled by
:mod:`._step_profile`.)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_checkpointing.core._structure import is_differentiable, own_gradient
from tf_checkpointing.planning._constants import TIMED_RUNS as _TIMED_RUNS
from tf_checkpointing.planning.measuring import _progress
from tf_checkpointing.planning.measuring._allocator import Allocator, nbytes, sync
from tf_checkpointing.planning.measuring._modes import Mode

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """What one layer of the chain costs, measured on the real layer.

    Attributes:
        name: the layer's name (or its function's).
        kept_bytes: bytes still allocated after a taped forward, on top of its
            input: what the tape keeps for the backward, plus the output.
        forward_peak_bytes: peak of its taped forward above the level before it.
        untaped_peak_bytes: the same without a tape (a checkpointed forward).
        backward_peak_bytes: peak of its backward above the level before it.
        weight_grad_bytes: bytes of the gradients of the variables it reads.
        seconds: time of one (eager) forward.
        backward_alone_bytes: (``tf.function`` profiles) the backward's own peak,
            read after the forward, above what the forward kept and the output
            gradient: negative when the backward frees kept bytes (its output)
            before it allocates. None: not measured.
        backward_reads: (``tf.function`` profiles) which of its input and
            output leaves its backward reads, from the graph it was measured
            with (a :class:`~tf_checkpointing.planning.measuring._backward_reads.BackwardReads`).
            None: not read.
    """

    name: str
    kept_bytes: int
    forward_peak_bytes: int
    untaped_peak_bytes: int
    backward_peak_bytes: int
    weight_grad_bytes: int
    seconds: float
    backward_alone_bytes: Optional[int] = None
    backward_reads: Any = None


@dataclasses.dataclass(frozen=True)
class ChainProfile:
    """Per-layer profile of a chain of ``n`` layers.

    Attributes:
        layers: ``n`` :class:`LayerProfile`, in order.
        boundary_bytes: ``n + 1`` sizes: the chain's input, each layer's output.
        boundary_grad_bytes: the same, floating leaves only (their gradients).
        plain_peak_bytes: measured peak of the plain (un-checkpointed) step above
            the level before it (with ``compiled``: of the whole chain's forward
            and backward as one ``tf.function``).
        device: the device whose allocator was read.
        mode: the kind of step measured (a :class:`Mode`). Compiled
            (``tf.function``, :attr:`compiled`): each layer's forward and
            backward profiled as one graph. XLA (:attr:`xla`, ``jit_compile=True``):
            ``plain_peak_bytes`` is
            the XLA-compiled plain step's (XLA assigns buffers its own way, its
            plain step peaking above the graph's, see docs/decisions/0023-xla-plans.md; the
            per-layer graphs, read with a ``py_function`` XLA cannot compile, are
            scaled to it).
        xla_anchor: for ``xla``, the least-memory plan's XLA step measured too
            (an :class:`~tf_checkpointing.planning.solving._xla.XlaAnchor`): the
            planner maps its peaks onto the two measured XLA steps.
        frozen_prefix: how many leading layers no gradient reaches (see
            :func:`~tf_checkpointing.planning.layer_graph._frozen.chain_without_backward`):
            they run plainly in every plan.
        plain_step_seconds: the time of the plain step measured for
            ``plain_peak_bytes`` (compiled profiles; None: not timed).
    """

    layers: tuple[LayerProfile, ...]
    boundary_bytes: tuple[int, ...]
    boundary_grad_bytes: tuple[int, ...]
    plain_peak_bytes: int
    device: str
    mode: Mode = Mode.EAGER
    xla_anchor: Any = None
    frozen_prefix: int = 0
    plain_step_seconds: Optional[float] = None

    @property
    def compiled(self) -> bool:
        """Measured for a ``tf.function`` step (with or without XLA)."""
        return self.mode.compiled

    @property
    def xla(self) -> bool:
        """Measured for a ``jit_compile=True`` step."""
        return self.mode is Mode.XLA


def taped(call: Callable[[Any], Any], x: Any,
          watch: bool = True) -> tuple[tf.GradientTape, Any, Any]:
    """``call(x)`` under a tape that watches ``x`` (with ``watch``) and the
    trainable variables the call reads: the tape, what the call read, and
    what it returned.

    With ``watch``, the call reads each differentiable leaf through
    :func:`~tf_checkpointing.core._structure.own_gradient`, so that no measured
    graph outlives planning, holding its constants in the allocator's pool.
    """
    with tf.GradientTape() as tape:
        if watch:
            tape.watch([t for t in tf.nest.flatten(x) if is_differentiable(t)])
            x = tf.nest.map_structure(own_gradient, x)
        y = call(x)
    return tape, x, y


def untaped_pass(calls, x, device, call_overhead: float = 0.0,
                 same_as: Optional[Sequence[int]] = None):
    """Each call's untaped peak and time, and the chain's boundary sizes.

    A call's time is the least of a few warm runs, waiting for one element of
    its output (copying the whole output to the host would time the copy),
    less ``call_overhead``: what launching a call costs by itself, which a
    replay inside a ``tf.function`` does not pay per layer. A call with
    ``same_as[i] = j < i`` computes what call ``j`` does: it runs once, for its
    output, and gets ``j``'s peak and time.
    """
    allocator = Allocator(device)
    peaks, seconds, sizes = [], [], [nbytes(x)]
    for k, call in enumerate(calls):
        _progress.step("timing layer calls", k + 1, len(calls))
        j = k if same_as is None else same_as[k]
        before = allocator.mark()
        y = call(x)
        sync(y)
        if j == k:
            peaks.append(max(0, allocator.peak_since_mark() - before))
            seconds.append(max(0.0, forward_seconds(call, x) - call_overhead))
        else:
            peaks.append(peaks[j])
            seconds.append(seconds[j])
        sizes.append(nbytes(y))
        x = y
    return peaks, seconds, sizes


def forward_seconds(call: Callable[[Any], Any], x: Any) -> float:
    """The least time of a few warm runs of ``call(x)`` (the first has run)."""
    best = float("inf")
    for _ in range(_TIMED_RUNS):
        started = time.perf_counter()
        _wait_for(call(x))
        best = min(best, time.perf_counter() - started)
    return best


def _wait_for(value: Any) -> None:
    """Waits until ``value``'s first tensor is computed, copying one element."""
    for leaf in tf.nest.flatten(value):
        if isinstance(leaf, tf.Tensor):
            tf.reshape(leaf, [-1])[:1].numpy()
            return


def taped_pass(calls, x, device, names, untaped, seconds, sizes) -> ChainProfile:
    allocator = Allocator(device)
    start = allocator.mark()
    forward: list[Any] = []  # per layer: (tape, input leaves, output leaves, variables)
    kept, fwd_peaks, highest = [], [], start
    for k, call in enumerate(calls):
        _progress.step("measuring layer calls", k + 1, len(calls))
        before = allocator.mark()
        tape, _, y = taped(call, x)
        peak = allocator.peak_since_mark()
        highest = max(highest, peak)
        fwd_peaks.append(max(0, peak - before))
        kept.append(max(0, allocator.current() - before))
        forward.append((tape, [t for t in tf.nest.flatten(x) if is_differentiable(t)],
                        [t for t in tf.nest.flatten(y) if is_differentiable(t)],
                        tape.watched_variables()))
        x = y
    grad_sizes = [nbytes(leaves) for _, leaves, _, _ in forward]
    grad_sizes.append(nbytes(forward[-1][2]))
    del x, y
    out_grads = [tf.ones_like(t) for t in forward[-1][2]]
    weight_grads, bwd_peaks, weight_bytes = [], [], []
    for i in reversed(range(len(calls))):
        tape, x_leaves, y_leaves, variables = forward[i]
        forward[i] = None  # the tape is freed after its backward, as in backprop
        before = allocator.mark()
        grads = tape.gradient(y_leaves, x_leaves + list(variables), output_gradients=out_grads,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        peak = allocator.peak_since_mark()
        highest = max(highest, peak)
        bwd_peaks.append(max(0, peak - before))
        del tape, x_leaves, y_leaves
        out_grads = grads[: len(grads) - len(variables)]
        weight_grads.extend(grads[len(out_grads):])  # kept to the end, as backprop does
        weight_bytes.append(nbytes(grads[len(out_grads):]))
    bwd_peaks.reverse()
    weight_bytes.reverse()
    layers = tuple(
        LayerProfile(name=names[i], kept_bytes=kept[i], forward_peak_bytes=fwd_peaks[i],
                     untaped_peak_bytes=untaped[i], backward_peak_bytes=bwd_peaks[i],
                     weight_grad_bytes=weight_bytes[i], seconds=seconds[i])
        for i in range(len(calls)))
    return ChainProfile(layers=layers, boundary_bytes=tuple(sizes),
                        boundary_grad_bytes=tuple(grad_sizes), plain_peak_bytes=highest - start,
                        device=device)
