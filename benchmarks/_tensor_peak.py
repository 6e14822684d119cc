"""The peak of a step's tensors, as opposed to the allocator's chunks.

``tf.config.experimental.get_memory_info`` reports the BFC allocator's bytes in
use: whole chunks. The allocator splits a free chunk only when it is at least
twice the request, so a 9 MiB tensor can occupy a 16 MiB chunk, and how much
the chunks exceed the tensors depends on which chunks the step's earlier frees
left (measured on the benchmark models in fresh processes: 0-34% above the
tensors, by plan; see docs/whole-model.md). The planners model tensors. To
tell their error from the allocator's, this module reads the allocator's own
events (the TensorFlow profiler records each allocation and deallocation with
the bytes requested) and returns the peak of the requested bytes over a step,
which moves much less from step to step than the chunks' peak (but does move
with the executor's order: docs/measuring-memory.md).

    >>> import tensorflow as tf
    >>> f = tf.function(lambda a: tf.reduce_sum(a * 2.0 + 1.0))
    >>> a = tf.ones([256, 256])
    >>> _ = f(a)
    >>> tensor_peak(lambda: f(a).numpy()) >= 256 * 256 * 4   # needs the BFC allocator
    True
"""

from __future__ import annotations

import glob
import os
import tempfile
from typing import Any, Callable

__all__ = ["tensor_peak"]


def tensor_peak(run: Callable[[], Any]) -> int:
    """Bytes: the largest sum of requested bytes alive during ``run()``, above
    what was allocated before it (from the allocator's traced events)."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    logdir = tempfile.mkdtemp(prefix="tensor_peak_")
    tf.profiler.experimental.start(
        logdir, options=tf.profiler.experimental.ProfilerOptions(host_tracer_level=3))
    try:
        run()
    finally:
        tf.profiler.experimental.stop()
    path = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    events = []
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
                name = None if allocator is None else (
                    stats.get(allocator.ref_value, "") if allocator.HasField("ref_value")
                    else allocator.str_value)
                if name is not None and "bfc" not in name:
                    continue  # the allocator get_memory_info reads (TF_CPU_ALLOCATOR_USE_BFC)
                field = values.get("requested_bytes")
                requested = 0 if field is None else field.int64_value or field.uint64_value
                sign = 1 if kind == "MemoryAllocation" else -1
                events.append((line.timestamp_ns + event.offset_ps // 1000, sign * requested))
    level = peak = 0
    for _, change in sorted(events):
        level += change
        peak = max(peak, level)
    return peak
