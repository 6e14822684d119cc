"""Measure the peak memory of a function: the number that shows what checkpointing saves.

Users of `tf.recompute_grad` and `keras.remat` keep asking how to see the memory a
training step needs at all (TF #36981, #57205, #38766). TensorFlow has the numbers,
in the allocator of each device, behind two experimental calls:
`tf.config.experimental.reset_memory_stats(device)` and
`tf.config.experimental.get_memory_info(device)`. This module wraps them into one
call that runs a function and returns the peak bytes it allocated above the level
the device was at when it started.

On CPU the numbers are only complete with TensorFlow's BFC allocator, which is
chosen once, when TensorFlow starts, from the environment variable
`TF_CPU_ALLOCATOR_USE_BFC`. Without it, TensorFlow either refuses CPU statistics
("Allocator stats not available", TF 2.21 before any large allocation) or tracks
large allocations only (a 160 KB tensor is not counted, a 256 KiB one is): a peak
that is silently too low. So `measure` checks, once per device, that a 64 KiB
allocation is counted, and raises a `RuntimeError` that says how to enable the
allocator when it is not. Set it before the first `import tensorflow`:

    import os
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"   # before importing TensorFlow
    import tensorflow as tf

or from the shell: `TF_CPU_ALLOCATOR_USE_BFC=true python train.py`.

Example:
    >>> import tensorflow as tf            # TF_CPU_ALLOCATOR_USE_BFC=true set before this
    >>> from tf_checkpointing.debug import measure
    >>> def step():
    ...     x = tf.random.uniform([1024, 1024])      # 4 MiB
    ...     return tf.reduce_sum(x * 2.0)            # and 4 MiB more for x * 2
    >>> measure(step).peak_bytes >= 8 * 2**20    # both tensors alive at once
    True

Measurements nest: a `measure` inside another one resets the device's statistics,
but the enclosing measurement still reports the highest level it saw. They are not
thread-safe: two threads measuring the same device see each other's allocations.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, Generic, Optional, TypeVar

import tensorflow as tf

__all__ = ["MemoryStats", "default_memory_device", "grow_cpu_pool", "measure", "peak_memory",
           "statistics_status"]

T = TypeVar("T")

BFC_ENV_VAR = "TF_CPU_ALLOCATOR_USE_BFC"
_ENV_VAR = BFC_ENV_VAR
_HOW_TO_ENABLE = (
    f"set {_ENV_VAR}=true in the environment before TensorFlow is imported: either "
    f'`os.environ["{_ENV_VAR}"] = "true"` as the first lines of your script (before '
    f"`import tensorflow`), or from the shell `{_ENV_VAR}=true python train.py`"
)

# For each measurement in progress: [device, highest absolute peak seen before a nested
# measurement reset the device's statistics].
_open_measurements: list[list[Any]] = []
# Devices whose allocator was found to count small allocations (probed once each).
_complete_stats_devices: set[str] = set()
_PROBE_BYTES = 64 * 1024  # below what TF 2.21's default CPU allocator counts
# The CPU pool is grown once by this much (address space only: never written).
_POOL_BYTES = 4 * 2**30
_grown_devices: set[str] = set()


@dataclasses.dataclass(frozen=True)
class MemoryStats(Generic[T]):
    """What `measure` saw while a function ran.

    Attributes:
        peak_bytes: highest allocator level during the call, minus `start_bytes`.
        start_bytes: bytes already allocated on the device when the call started
            (weights, inputs, anything alive).
        device: the device that was measured, e.g. "CPU:0".
        result: what the function returned.
    """

    peak_bytes: int
    start_bytes: int
    device: str
    result: T

    @property
    def peak_mib(self) -> float:
        """`peak_bytes` in MiB."""
        return self.peak_bytes / 2**20


def default_memory_device() -> str:
    """Returns the device `measure` uses by default: the first GPU if any, else "CPU:0".

    Example:
        >>> from tf_checkpointing.core._memory import default_memory_device
        >>> default_memory_device() in ("GPU:0", "CPU:0")
        True
    """
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def measure(fn: Callable[..., T], *args: Any, device: Optional[str] = None,
            **kwargs: Any) -> MemoryStats[T]:
    """Runs `fn(*args, **kwargs)` and returns its peak memory together with its result.

    Args:
        fn: the function to run, e.g. one training step.
        *args: positional arguments for `fn`.
        device: the device whose allocator is read, e.g. "GPU:0" or "CPU:0".
            Default: the first GPU if there is one, else "CPU:0".
        **kwargs: keyword arguments for `fn`.

    Returns:
        A `MemoryStats` with `peak_bytes`, `start_bytes`, `device` and `result`.

    Raises:
        ValueError: `device` does not name exactly one device of this process.
        RuntimeError: the device's allocator keeps no statistics, or on CPU only
            partial ones (TensorFlow was started without
            `TF_CPU_ALLOCATOR_USE_BFC=true`); the message says how to enable them.

    Example:
        >>> import tensorflow as tf            # TF_CPU_ALLOCATOR_USE_BFC=true set before this
        >>> from tf_checkpointing.debug import measure
        >>> stats = measure(lambda n: tf.reduce_sum(tf.random.uniform([n, 1024])), 1024)
        >>> stats.peak_bytes >= 4 * 2**20, float(stats.result) > 0.0
        (True, True)
    """
    device = default_memory_device() if device is None else device
    if not isinstance(device, str):
        raise TypeError(
            f"Invalid value received for argument `device`: expected a device string "
            f'such as "GPU:0" or "CPU:0", received {device!r} of type '
            f"{type(device).__name__}. Pass the device as a string.")
    _require_complete_stats(device)
    grow_cpu_pool(device)
    before = _memory_info(device)
    for entry in _open_measurements:   # keep the enclosing measurements' peaks
        if entry[0] == device:
            entry[1] = max(entry[1], before["peak"])
    tf.config.experimental.reset_memory_stats(device)
    start = _memory_info(device)["current"]
    entry = [device, 0]
    _open_measurements.append(entry)
    try:
        result = fn(*args, **kwargs)
    finally:
        _open_measurements.remove(entry)
    after = _memory_info(device)
    peak = max(after["peak"], entry[1])
    if peak == 0 and after["current"] == 0 and not _stats_are_live(device):
        raise RuntimeError(_unavailable_message(device, "it reports 0 bytes in use"))
    return MemoryStats(peak_bytes=max(0, peak - start), start_bytes=start, device=device,
                       result=result)


def peak_memory(fn: Callable[..., Any], *args: Any, device: Optional[str] = None,
                **kwargs: Any) -> int:
    """Deprecated: use ``tf_checkpointing.debug.measure(fn, ...).peak_bytes``.

    Returns ``measure(fn, *args, device=device, **kwargs).peak_bytes``, the peak
    bytes allocated above the starting level while ``fn`` runs (see `measure` for
    the arguments), with a ``DeprecationWarning``. It will be removed in
    tf_checkpointing 0.3.

    Example (what to write instead):
        >>> import tensorflow as tf
        >>> from tf_checkpointing.debug import measure
        >>> measure(lambda: tf.reduce_sum(tf.zeros([1024, 1024]) + 1.0)).peak_bytes >= 4 * 2**20
        True
    """
    warnings.warn(
        "`peak_memory(fn)` is deprecated and will be removed in tf_checkpointing 0.3: use "
        "`tf_checkpointing.debug.measure(fn).peak_bytes`, which returns the same number.",
        DeprecationWarning, stacklevel=2)
    return measure(fn, *args, device=device, **kwargs).peak_bytes


def _memory_info(device: str) -> dict[str, int]:
    try:
        info = tf.config.experimental.get_memory_info(device)
    except ValueError as error:
        text = str(error)
        if any(words in text.lower() for words in ("not tracked", "statistics", "stats")):
            raise RuntimeError(_unavailable_message(device, text)) from error
        devices = [d.name.replace("/device:", "") for d in tf.config.list_logical_devices()]
        raise ValueError(
            f"Invalid value received for argument `device`: expected the name of one "
            f"device of this process, such as {', '.join(map(repr, devices))}; received "
            f"{device!r} (TensorFlow said: {text}). Pass one of the names listed, or "
            f"leave `device=None` for the first GPU, else CPU:0.") from error
    return {"current": int(info["current"]), "peak": int(info["peak"])}


def _stats_are_live(device: str) -> bool:
    """Whether the allocator counts at all: allocates a 1 MiB probe and looks."""
    with tf.device(device):
        probe = tf.random.uniform([256, 1024])
    live = _memory_info(device)["current"] > 0
    del probe
    return live


def _unavailable_message(device: str, reason: str) -> str:
    message = (f"Memory statistics are not available for device {device!r} "
               f"(TensorFlow: {reason}).")
    if "CPU" in device.upper():
        state = os.environ.get(_ENV_VAR)
        message += (
            f" TensorFlow only tracks CPU memory with its BFC allocator, which is chosen "
            f"when TensorFlow starts. To enable it, {_HOW_TO_ENABLE}.")
        if state is not None:
            message += (f" ({_ENV_VAR}={state!r} is set in this process now, but it "
                        f"must be 'true' before TensorFlow is imported.)")
    return message


def statistics_status(device: str) -> str:
    """Whether `measure` can read `device`, in words (for bug reports).

    Example:
        >>> from tf_checkpointing.core._memory import statistics_status
        >>> statistics_status("CPU:0")   # TF_CPU_ALLOCATOR_USE_BFC=true set before TF
        'available'
    """
    try:
        _memory_info(device)
        problem = _missing_small_allocations(device)
    except RuntimeError as error:
        problem = str(error.__cause__ or error)
    return "available" if problem is None else f"not available: {problem}"


def _require_complete_stats(device: str) -> None:
    """Raises a RuntimeError unless `device`'s allocator counts a 64 KiB allocation."""
    problem = _missing_small_allocations(device)
    if problem is not None:
        raise RuntimeError(_unavailable_message(device, problem))


def _missing_small_allocations(device: str) -> Optional[str]:
    """Why CPU peaks would be too low, or None. TensorFlow's default CPU allocator
    counts large allocations only, so a peak read from it is too low without any
    sign; the BFC allocator counts all. Probed once per device."""
    if device in _complete_stats_devices or "CPU" not in device.upper():
        return None
    before = _memory_info(device)["current"]
    with tf.device(device):
        probe = tf.random.uniform([_PROBE_BYTES // 4])
    counted = _memory_info(device)["current"] - before
    del probe
    if counted < _PROBE_BYTES:
        return (f"a {_PROBE_BYTES // 1024} KiB allocation was counted as {counted} bytes, "
                "so small allocations would be missing from its peaks")
    _complete_stats_devices.add(device)
    return None


def grow_cpu_pool(device: str = "CPU:0") -> None:
    """Grows the CPU BFC allocator's pool, once per process, by one 4 GiB region,
    so that a large request is cut from it instead of taking a whole region.

    Why: the BFC allocator counts the chunk it hands out, and hands out a free
    chunk whole when it is less than twice the request and what would be left
    over is below a fixed limit (``FindChunkPtr`` in TensorFlow's
    ``bfc_allocator.cc``). On CPU its pool grows by regions of doubling size,
    so a request that opens a new region is counted as the whole region: an
    XLA step, which allocates all its temporaries as one buffer, then "peaks"
    at a power of two (see docs/decisions/0026-cpu-pool.md). On a GPU the pool is
    one large region from the start and the requests are cut from it; this
    makes the CPU pool alike. The region is allocated uninitialised, so no page of it
    is touched; it stays reserved for the process (the BFC allocator never
    frees a region). Regions allocated before still serve the requests they fit.

    Example:
        >>> from tf_checkpointing.core._memory import grow_cpu_pool
        >>> grow_cpu_pool("CPU:0")   # once; later calls do nothing
    """
    if device in _grown_devices or "CPU" not in device.upper():
        return
    _grown_devices.add(device)
    with tf.init_scope(), tf.device(device):  # eager even while a function is traced
        try:
            # float32: the element count must fit the op's int32 shape.
            region = tf.raw_ops.Empty(shape=[_POOL_BYTES // 4], dtype=tf.float32, init=False)
        except (tf.errors.ResourceExhaustedError, tf.errors.InternalError):
            return  # no address space for it: peaks keep the region steps
    del region
