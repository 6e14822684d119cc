"""How each layer of a chain is called, and what each one costs in memory and time.

The planner (:mod:`tf_checkpointing.planning._chain`) needs, per layer, numbers that no
formula gives for arbitrary Keras layers: how many bytes the tape keeps for its
backward (a ``Dense`` keeps its input, a ``relu`` its output, a ``Dropout`` its
mask, a ``LayerNormalization`` its statistics), how much its forward and its
backward allocate on top of that, and how long its forward takes. So we measure
them on the real layers: :func:`profile_chain` runs the chain once untaped and
once the way plain backprop runs it (every layer under the tape, then the
backward layer by layer, in reverse), reading the device allocator between
layers. A ``tf.function`` step keeps fewer bytes than eager backprop (its
backward graph reads only some intermediates, and frees them as it goes), so
for one (``compiled``) each layer runs its forward and backward as one graph,
with the allocator read at a ``py_function`` between the two, and the whole
chain's plain step is measured as one graph. The state the profile runs change
(dropout seeds, BatchNorm statistics) is put back afterwards, and it runs in a
thread of its own, so no tape of the caller records it.

The profile and the checkpointed run call the layers alike: each layer gets the
call-time keywords its signature accepts (:func:`route_keywords`: ``training=``
reaches ``Dropout`` but not ``LayerNormalization`` or ``tf.nn.relu``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tf_checkpointing._recompute import is_differentiable
from tf_checkpointing._state import StateRecorder
from tf_checkpointing.planning._graph import chain_break

__all__: list[str] = []

_BFC_ENV_VAR = "TF_CPU_ALLOCATOR_USE_BFC"
_GRAPH_RUNS = 5  # runs of each layer's graph; the profile keeps the median readings


def validate_layers(layers: Any, api: str) -> list[Any]:
    """The chain as a list, or a TypeError/ValueError that says what to pass."""
    if isinstance(layers, keras.Sequential):
        layers = list(layers.layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        try:
            layers = list(layers)
        except TypeError:
            raise TypeError(
                f"{api}: argument `layers` must be a list of callables (Keras layers or "
                f"functions); received {layers!r} of type {type(layers).__name__}. Pass "
                "the chain as a list, e.g. [keras.layers.Dense(64), tf.nn.relu]."
            ) from None
    layers = list(layers)
    if not layers:
        raise ValueError(
            f"{api}: argument `layers` must contain at least one layer; received an "
            "empty list. Pass the chain to run, e.g. [keras.layers.Dense(64) for _ in "
            "range(8)]."
        )
    reason = chain_break(layers)
    if reason is not None:
        raise ValueError(
            f"{api}: argument `layers` must form a chain (each layer fed the previous "
            f"one's output), but these layers come from a model graph that is not a "
            f"chain: {reason}. Checkpoint the whole model instead, with regions chosen "
            "for a memory budget: apply_checkpointing(model, budget=...) (bytes, or "
            "'min'), or plan_model(model, inputs, budget=...) to see the plan first."
        )
    for i, layer in enumerate(layers):
        if not callable(layer) or isinstance(layer, type):
            hint = " (a class: instantiate it)" if isinstance(layer, type) else ""
            raise TypeError(
                f"{api}: argument `layers` must contain only callables (Keras layer "
                f"instances or functions); received {layer!r} of type "
                f"{type(layer).__name__} at index {i}{hint}. Pass e.g. "
                "keras.layers.Dense(64) or tf.nn.relu."
            )
    return layers


def accepted_keywords(layer: Any) -> Optional[frozenset[str]]:
    """The keyword arguments ``layer`` takes: a set of names, or None for any
    (``**kwargs``). A Keras layer is asked about its ``call``."""
    target = layer
    wrapped = getattr(layer, "__wrapped__", None)  # checkpointable(layer) proxies
    if isinstance(wrapped, keras.layers.Layer):
        target = wrapped
    if isinstance(target, keras.layers.Layer):
        target = target.call
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def route_keywords(layers: Sequence[Any], kwargs: dict[str, Any], api: str, *,
                   strict: bool = True) -> list[dict]:
    """For each layer, the part of ``kwargs`` its signature accepts; with
    ``strict``, a keyword that no layer accepts is an error (likely a typo)."""
    if not kwargs:
        return [{} for _ in layers]
    accepted = [accepted_keywords(layer) for layer in layers]
    routed = [dict(kwargs) if names is None else
              {k: v for k, v in kwargs.items() if k in names} for names in accepted]
    unused = [k for k in kwargs if not any(k in r for r in routed)]
    if unused and strict:
        raise TypeError(
            f"{api}: keyword argument(s) {', '.join(map(repr, unused))} are accepted by "
            f"none of the {len(layers)} layers; received {unused[0]}="
            f"{kwargs[unused[0]]!r}. Check the spelling, or pass only keywords that some "
            "layer's call takes (e.g. training=True)."
        )
    return routed


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
    """

    name: str
    kept_bytes: int
    forward_peak_bytes: int
    untaped_peak_bytes: int
    backward_peak_bytes: int
    weight_grad_bytes: int
    seconds: float


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
        compiled: measured for a training step that is a ``tf.function``: each
            layer's forward and backward profiled as one graph.
        xla: measured for a ``jit_compile=True`` step: ``plain_peak_bytes`` is
            the XLA-compiled plain step's (XLA assigns buffers its own way: on
            ResNet50 its plain step peaks 1.1-1.2x the graph's, and the per-layer
            graphs, read with a ``py_function`` XLA cannot compile, are scaled to it).
    """

    layers: tuple[LayerProfile, ...]
    boundary_bytes: tuple[int, ...]
    boundary_grad_bytes: tuple[int, ...]
    plain_peak_bytes: int
    device: str
    compiled: bool = False
    xla: bool = False


class _Allocator:
    """Reads one device's allocator: levels relative to the last ``mark``."""

    def __init__(self, device: str) -> None:
        self.device = device

    def current(self) -> int:
        return int(tf.config.experimental.get_memory_info(self.device)["current"])

    def mark(self) -> int:
        """Resets the peak to now; returns the current level."""
        tf.config.experimental.reset_memory_stats(self.device)
        return self.current()

    def peak_since_mark(self) -> int:
        return int(tf.config.experimental.get_memory_info(self.device)["peak"])


def profile_chain(calls: Sequence[Callable[[Any], Any]], inputs: Any, *,
                  names: Sequence[str], api: str, compiled: bool = False,
                  same_as: Optional[Sequence[int]] = None, xla: bool = False,
                  applied: bool = False) -> ChainProfile:
    """Runs the chain ``calls`` on ``inputs`` and measures each layer.

    ``calls[i](x)`` runs layer ``i`` (with its keywords bound). Runs eagerly in
    a thread of its own, so the caller's tape records none of it; called while
    a ``tf.function`` is traced, it runs on synthetic inputs of the traced
    shapes (which must then be fully known).

    With ``compiled``, the profile is of a training step that is a
    ``tf.function``: each layer's forward and backward run as one graph, read
    between the two (a graph keeps only the intermediates its backward reads,
    and frees them as the backward goes), and ``plain_peak_bytes`` is the
    whole chain's, measured as one graph. ``same_as[i] = j < i`` says call
    ``i`` is the same computation as call ``j`` (same layer configuration on
    the same shapes: ResNet50 repeats its blocks): its graph is not traced and
    measured again, it gets ``j``'s readings. With ``applied``, the compiled
    plain step consumes each weight gradient as soon as it is made, as an
    optimizer inside the step does (``Model.fit``: the executor runs each
    variable's update when its gradient is ready, and frees the gradient), so
    the weight gradients are not all held at the end.
    """
    return _in_fresh_thread(_profile, calls, inputs, names, api, compiled, same_as, xla,
                            applied)


def in_xla_context() -> bool:
    """Whether a ``jit_compile=True`` function is being traced here."""
    graph = tf.compat.v1.get_default_graph()
    return tf.inside_function() and control_flow_util.GraphOrParentsInXlaContext(graph)


def _profile(calls, inputs, names, api, compiled, same_as=None, xla=False,
             applied=False) -> ChainProfile:
    x = _concrete_inputs(inputs, api)
    device = _memory_device(x, api)
    recorder = StateRecorder()
    with recorder:  # records, eagerly, the state the layers write, to put it back
        try:
            for call in calls:  # build the layers (and trace inner tf.functions)
                x = call(x)
            x = _concrete_inputs(inputs, api)
            if compiled:
                profile = _graph_profile(calls, x, device, names,
                                         same_as or list(range(len(calls))), applied)
                if xla:
                    profile = dataclasses.replace(profile, xla=True, plain_peak_bytes=(
                        _graph_plain_peak(calls, x, device, True, applied)))
                return profile
            untaped, seconds, sizes = _untaped_pass(calls, x, device)
            return _taped_pass(calls, x, device, names, untaped, seconds, sizes)
        finally:
            recorder.restore_before()


def _backprop(tape: tf.GradientTape, x: Any, y: Any) -> list[Any]:
    """The gradients of every differentiable input leaf and variable for an
    output gradient of ones (zeros for those not connected)."""
    leaves = [t for t in tf.nest.flatten(x) if is_differentiable(t)]
    outputs = [t for t in tf.nest.flatten(y) if is_differentiable(t)]
    return tape.gradient(outputs, leaves + list(tape.watched_variables()),
                         output_gradients=[tf.ones_like(t) for t in outputs],
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)


def _taped(call: Callable[[Any], Any], x: Any) -> tuple[tf.GradientTape, Any]:
    with tf.GradientTape() as tape:
        tape.watch([t for t in tf.nest.flatten(x) if is_differentiable(t)])
        y = call(x)
    return tape, y


def _graph_profile(calls, x, device, names, same_as, applied=False) -> ChainProfile:
    """The profile of a ``tf.function`` training step (see :func:`profile_chain`)."""
    graphs = [tf.function(call, autograph=False) if same_as[i] == i else call
              for i, call in enumerate(calls)]
    y = x
    for graph in graphs:  # trace them before any reading
        y = graph(y)
    untaped, seconds, sizes = _untaped_pass(graphs, x, device)
    plain_peak = _graph_plain_peak(calls, x, device, False, applied)
    layers: list[Any] = []
    grad_sizes: list[Any] = []
    y_grad_bytes = 0
    for i, call in enumerate(calls):
        j = same_as[i]
        if j != i:  # the same computation as an earlier call: its readings
            layers.append(dataclasses.replace(layers[j], name=names[i]))
            y = call(x)
            x_grad_bytes = _nbytes([t for t in tf.nest.flatten(x) if is_differentiable(t)])
            y_grad_bytes = _nbytes([t for t in tf.nest.flatten(y) if is_differentiable(t)])
            grad_sizes.append(x_grad_bytes)
            x = y
            continue
        layer, x_grad_bytes, y_grad_bytes = _graph_layer(call, x, device, names[i])
        layers.append(dataclasses.replace(layer, untaped_peak_bytes=untaped[i],
                                          seconds=seconds[i]))
        grad_sizes.append(x_grad_bytes)
        x = graphs[i](x)
    grad_sizes.append(y_grad_bytes)
    return ChainProfile(layers=tuple(layers), boundary_bytes=tuple(sizes),
                        boundary_grad_bytes=tuple(grad_sizes), plain_peak_bytes=plain_peak,
                        device=device, compiled=True)


def _graph_layer(call, x, device, name) -> tuple[LayerProfile, int, int]:
    """One layer's forward and backward as one graph, with the allocator read
    at the point between them (a ``py_function`` that the output gradient
    waits on): what is held there is what the graph keeps for the backward.

    The executor runs independent ops in any order, so what is held varies
    from run to run (by up to 15% for a transformer block on 2 cores); the
    profile keeps the median of a few runs.
    """
    allocator = _Allocator(device)
    readings: list[tuple[int, int]] = []

    def read_and_reset(*outputs: tf.Tensor) -> tf.Tensor:
        readings.append((allocator.current(), allocator.peak_since_mark()))
        allocator.mark()
        return tf.constant(1.0)

    def step(x: Any) -> tuple[list[Any], list[Any]]:
        tape, y = _taped(call, x)
        leaves = [t for t in tf.nest.flatten(x) if is_differentiable(t)]
        outputs = [t for t in tf.nest.flatten(y) if is_differentiable(t)]
        # Takes the outputs, so they are held at the reading, as in a chain,
        # where each output is the next layer's input.
        one = tf.py_function(read_and_reset, outputs, tf.float32)
        variables = list(tape.watched_variables())
        grads = tape.gradient(outputs, leaves + variables,
                              output_gradients=[tf.fill(tf.shape(t), tf.cast(one, t.dtype))
                                                for t in outputs],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return grads[:len(leaves)], grads[len(leaves):]

    graph = tf.function(step, autograph=False)
    _sync(graph(x))  # trace and warm up
    outputs = [t for t in tf.nest.flatten(call(x)) if is_differentiable(t)]
    kept, forward, total = [], [], []
    for _ in range(_GRAPH_RUNS):  # the executor's order, so what is held, varies
        readings.clear()
        before = allocator.mark()
        x_grads, weight_grads = graph(x)
        _sync(x_grads + weight_grads)
        (between, forward_peak), = readings
        kept.append(between - before)
        forward.append(forward_peak - before)
        total.append(max(forward_peak, allocator.peak_since_mark()) - before)
    layer = LayerProfile(
        name=name, kept_bytes=_median(kept), forward_peak_bytes=_median(forward),
        untaped_peak_bytes=0,
        # The output gradient, allocated after the reading, is the model's own term.
        backward_peak_bytes=max(0, _median(total) - _median(kept) - _nbytes(outputs)),
        weight_grad_bytes=_nbytes(weight_grads), seconds=0.0)
    return layer, _nbytes(x_grads), _nbytes(outputs)


def _graph_plain_peak(calls, x, device, jit_compile: bool = False,
                      applied: bool = False) -> int:
    """Peak of the chain's plain forward and backward as one ``tf.function``
    (with ``applied``: each gradient consumed at once, as by an optimizer)."""

    def chain(x: Any) -> list[Any]:
        tape, y = _taped(lambda x: _run_all(calls, x), x)
        grads = _backprop(tape, x, y)
        return [tf.reduce_sum(g) for g in grads] if applied else grads

    step = tf.function(chain, autograph=False, jit_compile=jit_compile)
    _sync(step(x))  # trace and warm up
    allocator = _Allocator(device)
    start = allocator.mark()
    _sync(step(x))
    return max(0, allocator.peak_since_mark() - start)


def _run_all(calls, x):
    for call in calls:
        x = call(x)
    return x


def in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn(*args)`` eagerly in a thread of its own (see :func:`_in_fresh_thread`)."""
    return _in_fresh_thread(fn, *args)


def _in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn`` eagerly, with no gradient tape of the caller recording it.

    Tapes, graphs being traced and ``init_scope`` (which pauses every tape) are
    per thread, so a new thread gives both; the Keras dtype policy and the
    distribution strategy, also per thread, are carried over.
    """
    policy = keras.config.dtype_policy()
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            keras.config.set_dtype_policy(policy)
            scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
            with scope:
                outcome["result"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            outcome["error"] = error

    thread = threading.Thread(target=target, name="tf_checkpointing-profile")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _untaped_pass(calls, x, device):
    allocator = _Allocator(device)
    peaks, seconds, sizes = [], [], [_nbytes(x)]
    for call in calls:
        before = allocator.mark()
        started = time.perf_counter()
        y = call(x)
        _sync(y)
        elapsed = time.perf_counter() - started
        peaks.append(max(0, allocator.peak_since_mark() - before))
        started = time.perf_counter()
        _sync(call(x))  # a second, warm run for the time
        seconds.append(min(elapsed, time.perf_counter() - started))
        sizes.append(_nbytes(y))
        x = y
    return peaks, seconds, sizes


def _taped_pass(calls, x, device, names, untaped, seconds, sizes) -> ChainProfile:
    allocator = _Allocator(device)
    start = allocator.mark()
    forward: list[Any] = []  # per layer: (tape, input leaves, output leaves, variables)
    kept, fwd_peaks, highest = [], [], start
    for call in calls:
        before = allocator.mark()
        with tf.GradientTape() as tape:
            tape.watch([t for t in tf.nest.flatten(x) if is_differentiable(t)])
            y = call(x)
        peak = allocator.peak_since_mark()
        highest = max(highest, peak)
        fwd_peaks.append(max(0, peak - before))
        kept.append(max(0, allocator.current() - before))
        forward.append((tape, [t for t in tf.nest.flatten(x) if is_differentiable(t)],
                        [t for t in tf.nest.flatten(y) if is_differentiable(t)],
                        tape.watched_variables()))
        x = y
    grad_sizes = [_nbytes(leaves) for _, leaves, _, _ in forward]
    grad_sizes.append(_nbytes(forward[-1][2]))
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
        weight_bytes.append(_nbytes(grads[len(out_grads):]))
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


def _median(values: list[int]) -> int:
    return max(0, sorted(values)[len(values) // 2])


def _sync(value: Any) -> None:
    for leaf in tf.nest.flatten(value):
        if isinstance(leaf, tf.Tensor):
            leaf.numpy()
            return


def _nbytes(value: Any) -> int:
    total = 0
    for leaf in tf.nest.flatten(value, expand_composites=True):
        if isinstance(leaf, tf.Tensor) and leaf.shape.num_elements() is not None:
            total += leaf.shape.num_elements() * leaf.dtype.size
    return total


def _concrete_inputs(inputs: Any, api: str) -> Any:
    """The inputs themselves when eager; synthetic ones of the same shapes when
    they are symbolic (planning while a tf.function is traced)."""

    def make(leaf: Any) -> Any:
        symbolic = isinstance(leaf, keras.KerasTensor) or (
            isinstance(leaf, tf.Tensor) and tf.is_symbolic_tensor(leaf))
        if not symbolic:
            return leaf
        shape = tf.TensorShape(leaf.shape)
        if not shape.is_fully_defined():
            raise ValueError(
                f"{api}: planning for a memory budget needs the full input shape, but "
                f"an input has shape {shape} (received a symbolic tensor, e.g. while "
                "tf.function or Model.fit traces with an unknown batch size). Fix: call "
                "it once eagerly on a real batch before training (the plan is then "
                "reused), give the batch size (keras.Input(shape=..., batch_size=32)), "
                "or pass segments= instead of budget=."
            )
        dtype = tf.as_dtype(leaf.dtype)
        if dtype.is_floating:
            return tf.cast(tf.random.stateless_normal(shape, seed=[0, 1]), dtype)
        return tf.zeros(shape, dtype)

    return tf.nest.map_structure(make, inputs)


def _memory_device(inputs: Any, api: str) -> str:
    device = next((str(leaf.device) for leaf in tf.nest.flatten(inputs)
                   if isinstance(leaf, tf.Tensor) and leaf.device), "")
    if "GPU" in device.upper():
        name = "GPU:" + device.rsplit(":", 1)[-1]
    elif device:
        name = "CPU:0"
    else:
        name = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    if name.startswith("CPU") and os.environ.get(_BFC_ENV_VAR, "").lower() not in (
            "1", "true"):
        raise RuntimeError(
            f"{api}: planning for a memory budget measures each layer with the device "
            f"allocator, but CPU memory statistics are off ({_BFC_ENV_VAR} is "
            f"{os.environ.get(_BFC_ENV_VAR)!r}). Fix: set {_BFC_ENV_VAR}=true before "
            "TensorFlow is imported (first lines of the script, or "
            f"`{_BFC_ENV_VAR}=true python train.py`), or pass segments= instead of budget=."
        )
    return name
