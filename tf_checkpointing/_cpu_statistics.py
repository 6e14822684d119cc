"""CPU memory statistics, arranged when the package is imported.

Planning for a memory budget reads the device allocator. On CPU TensorFlow only
keeps statistics with its BFC allocator, which it chooses from
``TF_CPU_ALLOCATOR_USE_BFC`` when it creates its devices: at the first op, not
at ``import tensorflow``. So importing this package turns it on, unless the
variable is set (``false`` is respected) or TensorFlow already made its devices
(then it is too late, and ``apply_checkpointing(model, budget=...)`` says so at
once: :func:`tf_checkpointing.planning.measuring._allocator.expect_statistics`). GPU
allocators keep statistics anyway; on a GPU machine this only changes which
allocator serves host memory.

This module imports nothing of TensorFlow: it runs before the package loads it.
"""

from __future__ import annotations

import os
import sys

__all__ = ["arrange"]

BFC_ENV_VAR = "TF_CPU_ALLOCATOR_USE_BFC"


def _devices_made() -> bool:
    """Whether TensorFlow (if imported at all) has created its devices."""
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context
    except ImportError:  # pragma: no cover - a TensorFlow without that module
        return True
    return context.context()._context_handle is not None  # noqa: SLF001


def arrange() -> bool:
    """Sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` if it is unset and still takes
    effect; returns whether it did."""
    if BFC_ENV_VAR in os.environ or _devices_made():
        return False
    os.environ[BFC_ENV_VAR] = "true"
    return True
