"""Reading the device allocator, and running a profile where no tape records it.

Every byte the planners use is read from the device's allocator (the BFC
allocator; on CPU only with ``TF_CPU_ALLOCATOR_USE_BFC=true``): levels and
peaks relative to a mark, around the calls being measured. The profile runs
eagerly in a thread of its own (:func:`in_fresh_thread`), on the caller's
inputs or, while a ``tf.function`` is traced, on synthetic ones of the same
shapes (:func:`concrete_inputs`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import Any, Callable

import keras
import tensorflow as tf

from tf_checkpointing.core._internals import control_flow_util
from tf_checkpointing.core._memory import grow_cpu_pool, statistics_status
from tf_checkpointing.planning._errors import PlanningRuntimeError, PlanningValueError
from tf_checkpointing.planning.measuring._leave_no_trace import planning_thread

__all__: list[str] = []

_BFC_ENV_VAR = "TF_CPU_ALLOCATOR_USE_BFC"


def planning_function(fn: Callable[..., Any], **options: Any) -> Any:
    """``tf.function(fn, autograph=False, **options)`` for a measurement.

    The planner traces a new function per layer, plan and model on purpose;
    TensorFlow would count the traces of closures sharing one code object and
    warn that "5 out of the last 9 calls to <function graph_plain_step.<locals>
    .chain> triggered tf.function retracing", which reads as the user's fault.
    """
    function = tf.function(fn, autograph=False, **options)
    function._omit_frequent_tracing_warning = True  # noqa: SLF001 - its own switch
    return function


class Allocator:
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


def expect_statistics() -> None:
    """Raises at once, with the fix, when planning for a budget could not read the
    allocator of the device a training step will use (the first GPU, else the
    CPU): better when ``apply_checkpointing`` is called than at the first
    training step, inside Keras' ``fit``.

    Raises:
        PlanningRuntimeError: the statistics are off (the API called names
            itself, and the way around measuring it offers)."""
    device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    status = statistics_status(device)
    if status == "available":
        return
    state = os.environ.get(_BFC_ENV_VAR)
    cause = ("TensorFlow had already created its devices when tf_checkpointing was "
             "imported, so the import could not turn them on" if state is None else
             f"{_BFC_ENV_VAR} is {state!r}")
    by_import = ("import tf_checkpointing before running any TensorFlow op (it then "
                 "turns them on), or " if state is None else "")
    raise PlanningRuntimeError(
        f"planning for a memory budget measures each layer with the {device} "
        f"allocator, but its memory statistics are {status} ({cause}). Fix: {by_import}"
        f"set {_BFC_ENV_VAR}=true before TensorFlow starts (`{_BFC_ENV_VAR}=true python "
        "train.py`)", fix=lambda api: f"{_without_measuring(api)}.")


def memory_device(inputs: Any) -> str:
    """The device whose allocator a profile on ``inputs`` reads.

    Raises:
        PlanningRuntimeError: the CPU's memory statistics are off (the message
            names the fix; the API layer its name, see ``planning._errors``)."""
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
        raise PlanningRuntimeError(
            "planning for a memory budget measures each layer with the device "
            f"allocator, but CPU memory statistics are off ({_BFC_ENV_VAR} is "
            f"{os.environ.get(_BFC_ENV_VAR)!r}). Fix: set {_BFC_ENV_VAR}=true before "
            "TensorFlow is imported (first lines of the script, or "
            f"`{_BFC_ENV_VAR}=true python train.py`)",
            fix=lambda api: f"{_without_measuring(api)}.")
    grow_cpu_pool(name)  # readings of cut chunks, not whole regions (see _memory)
    return name


def concrete_inputs(inputs: Any) -> Any:
    """The inputs themselves when eager; synthetic ones of the same shapes when
    they are symbolic (planning while a tf.function is traced).

    Raises:
        PlanningValueError: a symbolic input of unknown shape (the fixes depend
            on the API called, which words the error)."""

    def make(leaf: Any) -> Any:
        symbolic = isinstance(leaf, keras.KerasTensor) or (
            isinstance(leaf, tf.Tensor) and tf.is_symbolic_tensor(leaf))
        if not symbolic:
            return leaf
        shape = tf.TensorShape(leaf.shape)
        if not shape.is_fully_defined():
            raise PlanningValueError(
                "planning for a memory budget needs the full input shape, but "
                f"an input has shape {shape} (received a symbolic tensor, e.g. while "
                "tf.function or Model.fit traces with an unknown batch size, as for a "
                "partial last batch). Fix: ", fix=_unknown_shape_fixes)
        dtype = tf.as_dtype(leaf.dtype)
        if dtype.is_floating:
            return tf.cast(tf.random.stateless_normal(shape, seed=[0, 1]), dtype)
        return tf.zeros(shape, dtype)

    return tf.nest.map_structure(make, inputs)


# The APIs that take ``segments=`` (a fixed schedule, nothing measured); the others
# (apply_checkpointing, plan_model, plan_sequential) have no such argument.
_SEGMENT_APIS = ("checkpoint_sequential", "CheckpointedSequential")


def _without_measuring(api: str) -> str:
    """The way around the allocator that ``api`` offers, if any (a hint that names
    an argument the caller lacks would be a dead end)."""
    if api in _SEGMENT_APIS:
        return ", or pass segments= instead of budget= (fixed segments, nothing measured)"
    if api in ("apply_checkpointing", "plan_model"):
        return (", or choose the layers yourself, which measures nothing: "
                "apply_checkpointing(model, select=[...layer names...])")
    if api == "plan_sequential":
        return (", or use fixed segments, which measure nothing: "
                "checkpoint_sequential(layers, x, segments=k)")
    return ""


def _unknown_shape_fixes(api: str) -> str:
    """Fixes for an unknown input shape that work for ``api`` (each was run on
    ``Model.fit`` with a partial last batch). Calling the model once eagerly first
    is no fix: an eager call without a tape plans nothing, and ``checkpoint_sequential``
    plans per input shape, so an unknown one is planned again. Nor is
    ``keras.Input(batch_size=...)``: ``fit`` still traces with an unknown batch size."""
    if api in ("plan_model", "plan_sequential"):
        # These take the batch to profile as an argument: a real one is the fix.
        return ("pass a concrete batch of the training batch size (a tf.Tensor or NumPy "
                f"array, e.g. x[:32]), not keras.Input(...) or a tensor of a tf.function "
                f"being traced; to plan for a tf.function or Model.fit step, call {api} "
                "outside it with mode='graph'.")
    same_size = ("give every batch the same, known size: dataset.batch(n, "
                 "drop_remainder=True), for Model.fit on arrays a number of samples "
                 "that is a multiple of batch_size, and no None batch dimension in a "
                 "tf.function's input_signature")
    if api == "apply_checkpointing":
        # A plan made ahead is never made again, so any batch size trains with it.
        # (Model.fit on a batched tf.data.Dataset or on arrays tells the batch size
        # itself, see _fit_batches: this is a step of the user's, or data of no size.)
        return ("plan ahead on one batch and apply that plan, which then serves every "
                "batch size: plan = tf_checkpointing.plan_model(model, x[:batch_size], "
                "budget=..., mode='graph') (mode='xla' for jit_compile=True), then "
                f"apply_checkpointing(model, plan=plan); or {same_size}.")
    if api in _SEGMENT_APIS:
        return f"{same_size}; or pass segments= instead of budget=."
    return f"{same_size}."


def unknown_dimensions(shapes: Any) -> str:
    """Where ``shapes`` (one per input) have unknown dimensions, in words.

        >>> from tf_checkpointing.planning.measuring._allocator import unknown_dimensions
        >>> unknown_dimensions([(4, None, 16)])
        'axis 1 of input 0'
    """
    return ", ".join(f"axis {axis} of input {i}" for i, shape in enumerate(shapes)
                     for axis, d in enumerate(shape) if d is None)


def in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs ``fn(*args)`` eagerly, with no gradient tape of the caller recording it.

    Tapes, graphs being traced and ``init_scope`` (which pauses every tape) are
    per thread, so a new thread gives both; the Keras dtype policy and the
    distribution strategy, also per thread, are carried over, and so are the
    context variables (the public function called, which planning's warnings
    name: ``planning._errors.caller``).
    """
    policy = keras.config.dtype_policy()
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    outcome: dict[str, Any] = {}
    context = contextvars.copy_context()

    def target() -> None:
        try:
            planning_thread()  # what it traces is planning's (see _leave_no_trace)
            keras.config.set_dtype_policy(policy)
            scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
            with scope:
                outcome["result"] = context.run(fn, *args)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            outcome["error"] = error

    thread = threading.Thread(target=target, name="tf_checkpointing-profile")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def in_xla_context() -> bool:
    """Whether a ``jit_compile=True`` function is being traced here."""
    graph = tf.compat.v1.get_default_graph()
    return tf.inside_function() and control_flow_util.GraphOrParentsInXlaContext(graph)


def median(values: list[int]) -> int:
    return max(0, sorted(values)[len(values) // 2])


def median_settled(values: list[Any], runs: int) -> bool:
    """Whether the median of ``runs`` readings is known from ``values``, the
    first of them: one reading holds the majority, so more runs cannot move
    the median (of each field, for tuples). Most calls read the same bytes in
    every run; only those the executor orders otherwise from run to run need
    them all.

    Example:
        >>> from tf_checkpointing.planning.measuring._allocator import median_settled
        >>> median_settled([(4, 8), (4, 8), (4, 8)], runs=5)
        True
        >>> median_settled([4, 4, 6], runs=5)
        False
    """
    return bool(values) and max(values.count(v) for v in values) > runs // 2


def sync(value: Any) -> None:
    for leaf in tf.nest.flatten(value):
        if isinstance(leaf, tf.Tensor):
            leaf.numpy()
            return


def nbytes(value: Any) -> int:
    total = 0
    for leaf in tf.nest.flatten(value, expand_composites=True):
        if isinstance(leaf, tf.Tensor) and leaf.shape.num_elements() is not None:
            total += leaf.shape.num_elements() * leaf.dtype.size
    return total
