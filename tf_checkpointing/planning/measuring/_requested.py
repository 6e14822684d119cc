"""The peak of a step's tensors (bytes requested), as opposed to the allocator's chunks.

``tf.config.experimental.get_memory_info`` reports the BFC allocator's bytes in
use: whole chunks. The allocator splits a free chunk only when it is at least
twice the request, so a tensor can occupy a chunk nearly twice its size, and
how much the chunks exceed the tensors depends on which chunks earlier frees
left: the pool a planner leaves behind has its profile's tensors freed in every
size (see docs/decisions/0025-requested-bytes.md).
The allocator's own events (the TensorFlow profiler records each allocation
and deallocation with the bytes requested) give the peak of the requested
bytes over a step, which does not depend on the pool: the XLA planner
measures its steps with it (in a new process an XLA step's one buffer is cut
from the pool at its size, see ``_memory.grow_cpu_pool``, so the two agree
there), and the benchmarks report it beside the chunks.

    >>> import tensorflow as tf
    >>> from tf_checkpointing.planning.measuring._requested import requested_peak
    >>> f = tf.function(lambda a: tf.reduce_sum(a * 2.0 + 1.0))
    >>> a = tf.ones([256, 256])
    >>> _ = f(a)
    >>> requested_peak(lambda: f(a).numpy()) >= 256 * 256 * 4   # needs the BFC allocator
    True
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_checkpointing.core._internals import xplane_pb2

__all__: list[str] = []


def requested_peak(run: Callable[[], Any], device: str = "CPU:0") -> Optional[int]:
    """Bytes: the largest sum of bytes requested from ``device``'s BFC allocator
    and alive during ``run()``, above what was allocated before it (from the
    allocator's traced events); None where no event could be read (another
    profiler session is running, or the allocator records none). ``run`` runs
    once either way.

    Args:
        run: the function to measure; its result is discarded.
        device: the device whose allocator is read, e.g. ``"CPU:0"``, ``"GPU:0"``.
    """
    if xplane_pb2 is None:  # a TensorFlow that moved it: the caller reads the chunks
        run()
        return None
    logdir = tempfile.mkdtemp(prefix="tf_checkpointing_requested_")
    try:
        try:
            # The default options record the allocator's events; options passed
            # from Python log a warning per field in TF 2.21 ("expects an i value").
            tf.profiler.experimental.start(logdir)
        except (tf.errors.AlreadyExistsError, tf.errors.UnavailableError):
            run()  # the user's own profiler session is running: leave it alone
            return None
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return None
        space = xplane_pb2.XSpace()
        with open(paths[0], "rb") as file:
            space.ParseFromString(file.read())
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    events = list(_allocator_events(space, _allocator_name_test(device)))
    if not events:
        return None
    level = peak = 0
    for _, change in sorted(events):
        level += change
        peak = max(peak, level)
    return peak


def _allocator_name_test(device: str) -> Callable[[str], bool]:
    """Whether an allocator's name is ``device``'s BFC allocator: on CPU
    ``bfc_cpu_allocator_for_gpu`` (its name with or without a GPU), on GPU k
    ``GPU_k_bfc``."""
    spec = tf.DeviceSpec.from_string(device if "/" in device else f"/device:{device}")
    if (spec.device_type or "").upper() == "GPU":
        return lambda name: name == f"GPU_{spec.device_index or 0}_bfc"
    return lambda name: "bfc" in name and "cpu" in name.lower()


def _allocator_events(space: Any, wanted: Callable[[str], bool]) -> Iterator[tuple[int, int]]:
    """``(time in ns, +requested or -requested bytes)`` of each allocation and
    deallocation of the allocators ``wanted`` names."""
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stats = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = names.get(event.metadata_id, "")
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                values = {stats.get(s.metadata_id): s for s in event.stats}
                allocator = values.get("allocator_name")
                if allocator is None:
                    continue
                name = (stats.get(allocator.ref_value, "") if allocator.HasField("ref_value")
                        else allocator.str_value)
                if not wanted(name):
                    continue
                field = values.get("requested_bytes")
                requested = 0 if field is None else field.int64_value or field.uint64_value
                sign = 1 if kind == "MemoryAllocation" else -1
                yield line.timestamp_ns + event.offset_ps // 1000, sign * requested
