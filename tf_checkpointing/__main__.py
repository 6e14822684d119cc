"""``python -m tf_checkpointing``: what to paste into a bug report.

Prints the versions of tf_checkpointing, TensorFlow, Keras and Python, the
devices TensorFlow sees, and whether each device's allocator keeps the memory
statistics that `measure` reads.

Example:
    >>> from tf_checkpointing.__main__ import report
    >>> "tf_checkpointing" in report()
    True
"""

from __future__ import annotations

import os
import platform
import sys

# Quiet TensorFlow's C++ start-up logs unless the user chose a level.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def report() -> str:
    """The environment report as text, one ``name: value`` per line."""
    import keras
    import tensorflow as tf

    from tf_checkpointing._version import __version__
    from tf_checkpointing.core import _memory

    lines = [
        f"tf_checkpointing: {__version__}",
        f"tensorflow: {tf.__version__} (CUDA build: {tf.test.is_built_with_cuda()})",
        f"keras: {keras.__version__} (backend: {keras.backend.backend()})",
        f"python: {sys.version.split()[0]} ({platform.platform()})",
        f"{_memory.BFC_ENV_VAR}: {os.environ.get(_memory.BFC_ENV_VAR, '(unset)')}",
    ]
    devices = tf.config.list_logical_devices()
    lines.append(f"devices: {', '.join(d.name for d in devices) or '(none)'}")
    for device in devices:
        name = device.name.replace("/device:", "")
        if device.device_type not in ("CPU", "GPU"):
            continue
        lines.append(f"memory statistics on {name}: {_memory.statistics_status(name)}")
    return "\n".join(lines)


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
