"""``python -m tf_checkpointing``: what to paste into a bug report.

Prints the versions of tf_checkpointing, TensorFlow, Keras and Python, the
devices TensorFlow sees, and whether each device's allocator keeps the memory
statistics that `measure` and budget planning read (and how to turn them on
where it does not).

Example:
    >>> from tf_checkpointing.__main__ import report
    >>> "tf_checkpointing" in report()
    True
"""

from __future__ import annotations

import os
import platform
import sys


def report() -> str:
    """The environment report as text, one ``name: value`` per line."""
    import keras
    import tensorflow as tf

    from tf_checkpointing import __version__
    from tf_checkpointing._quiet import start_up_noise_hidden
    from tf_checkpointing.core import _memory

    lines = [
        f"tf_checkpointing: {__version__}",
        f"tensorflow: {tf.__version__} (CUDA build: {tf.test.is_built_with_cuda()})",
        f"keras: {keras.__version__} (backend: {keras.backend.backend()})",
        f"python: {sys.version.split()[0]} ({platform.platform()})",
        f"{_memory.BFC_ENV_VAR}: {os.environ.get(_memory.BFC_ENV_VAR, '(unset)')}",
    ]
    with start_up_noise_hidden():  # creating the devices logs (cuInit, CPU features)
        devices = tf.config.list_logical_devices()
    lines.append(f"devices: {', '.join(d.name for d in devices) or '(none)'}")
    for device in devices:
        name = device.name.replace("/device:", "")
        if device.device_type not in ("CPU", "GPU"):
            continue
        status = _memory.statistics_status(name)
        lines.append(f"memory statistics on {name}: {status}")
        if status != "available" and device.device_type == "CPU":
            lines.append(f"  to turn them on: {_how_to_enable_cpu_statistics()}")
    return "\n".join(lines)


def _how_to_enable_cpu_statistics() -> str:
    """What to change, given what ``TF_CPU_ALLOCATOR_USE_BFC`` is in this process."""
    from tf_checkpointing.core._memory import BFC_ENV_VAR as VAR

    value = os.environ.get(VAR)
    if value is not None and value.strip().lower() != "true":
        return (f"{VAR} is {value!r} here; set it to true before TensorFlow starts "
                f"(`{VAR}=true python train.py`)")
    if value is not None:
        return (f"{VAR}=true came after TensorFlow created its devices; set it before "
                f"(`{VAR}=true python train.py`), or import tf_checkpointing before "
                "TensorFlow runs its first op (it sets the variable then)")
    return (f"start TensorFlow with {VAR}=true (`{VAR}=true python train.py`), or import "
            "tf_checkpointing before TensorFlow runs its first op (it sets the variable then)")


def main() -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
