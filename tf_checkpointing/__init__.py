"""Gradient checkpointing for TensorFlow 2 and Keras 3 that saves memory and
gives exact gradients.

    from tf_checkpointing import checkpointable

    @checkpointable(checkpoint=True)
    def block(x, training=None): ...
"""

from tf_checkpointing import policies
from tf_checkpointing._decorator import checkpointable
from tf_checkpointing._errors import ChainedOutputWarning, ReplayMismatchError
from tf_checkpointing._flags import is_checkpointing, is_recomputing
from tf_checkpointing._keras import apply_checkpointing
from tf_checkpointing._memory import MemoryStats, measure, peak_memory
from tf_checkpointing._remat_scope import RematScope
from tf_checkpointing._residuals import Residual, print_saved_residuals, saved_residuals
from tf_checkpointing._saving import checkpoint_name
from tf_checkpointing._sequential import CheckpointedSequential, checkpoint_sequential
from tf_checkpointing._version import __version__ as __version__
from tf_checkpointing.planning import (
    ModelPlan,
    Segment,
    SequentialPlan,
    plan_model,
    plan_sequential,
)

__all__ = [
    "ChainedOutputWarning",
    "CheckpointedSequential",
    "MemoryStats",
    "ModelPlan",
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
    "peak_memory",
    "plan_model",
    "plan_sequential",
    "policies",
    "print_saved_residuals",
    "saved_residuals",
]
