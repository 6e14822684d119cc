"""Gradient checkpointing for TensorFlow 2 and Keras 3 that saves memory and
gives exact gradients.

    from tf_checkpointing import checkpointable

    @checkpointable(checkpoint=True)
    def block(x, training=None): ...

The package has three floors, each importing only the ones below it: the replay
core (:mod:`tf_checkpointing.core`: one checkpointed call and what keeps its
replay exact), planning (:mod:`tf_checkpointing.planning`: profiles in, a plan
out), and the API in this folder (the decorator, the Keras integration, and the
runners of chains and models), which uses both.

Importing it turns on TensorFlow's CPU memory statistics when that can still
take effect (see :mod:`tf_checkpointing._cpu_statistics`).
"""

import sys

from tf_checkpointing import _cpu_statistics

_cpu_statistics.arrange()  # before TensorFlow creates its devices

if getattr(sys, "orig_argv", [])[-2:] == ["-m", "tf_checkpointing"] and (
        "tensorflow" not in sys.modules):
    # The report (python -m tf_checkpointing) is read by people pasting it into bug
    # reports: TensorFlow's start-up lines, printed while it loads, are not part of it.
    from tf_checkpointing._quiet import start_up_noise_hidden

    with start_up_noise_hidden():
        import tensorflow  # noqa: F401

# ruff: noqa: E402 - the allocator is arranged before TensorFlow is used

from tf_checkpointing import policies
from tf_checkpointing._decorator import checkpointable
from tf_checkpointing._keras import apply_checkpointing
from tf_checkpointing._remat_scope import RematScope
from tf_checkpointing._sequential import checkpoint_sequential, plan_sequential
from tf_checkpointing._sequential_layer import CheckpointedSequential
from tf_checkpointing._version import __version__ as __version__
from tf_checkpointing._whole_model import plan_model
from tf_checkpointing.core._errors import ChainedOutputWarning, ReplayMismatchError
from tf_checkpointing.core._flags import is_checkpointing, is_recomputing
from tf_checkpointing.core._memory import MemoryStats, measure
from tf_checkpointing.core._residuals import Residual, print_saved_residuals, saved_residuals
from tf_checkpointing.core._save_policies import checkpoint_name
from tf_checkpointing.planning._plan import ModelPlan, Plan, Segment, SequentialPlan

__all__ = [
    "ChainedOutputWarning",
    "CheckpointedSequential",
    "MemoryStats",
    "ModelPlan",
    "Plan",
    "RematScope",
    "ReplayMismatchError",
    "Residual",
    "Segment",
    "SequentialPlan",
    "apply_checkpointing",
    "checkpoint_name",
    "checkpoint_sequential",
    "checkpointable",
    "is_checkpointing",
    "is_recomputing",
    "measure",
    "plan_model",
    "plan_sequential",
    "policies",
    "print_saved_residuals",
    "saved_residuals",
]
