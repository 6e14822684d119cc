"""Gradient checkpointing for TensorFlow 2 and Keras 3 that saves memory and
gives exact gradients.

    from tf_checkpointing import checkpointable

    @checkpointable(checkpoint=True)
    def block(x, training=None): ...
"""

from tf_checkpointing._decorator import checkpointable
from tf_checkpointing._flags import is_checkpointing, is_recomputing
from tf_checkpointing._keras import apply_checkpointing
from tf_checkpointing._memory import MemoryStats, measure, peak_memory
from tf_checkpointing._sequential import CheckpointedSequential, checkpoint_sequential
from tf_checkpointing.planning import (
    ModelPlan,
    Segment,
    SequentialPlan,
    plan_model,
    plan_sequential,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointedSequential",
    "MemoryStats",
    "ModelPlan",
    "Segment",
    "SequentialPlan",
    "apply_checkpointing",
    "checkpoint_sequential",
    "checkpointable",
    "is_checkpointing",
    "is_recomputing",
    "measure",
    "peak_memory",
    "plan_model",
    "plan_sequential",
]
