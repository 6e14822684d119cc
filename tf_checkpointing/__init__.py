"""Gradient checkpointing for TensorFlow 2 and Keras 3 that saves memory and
gives exact gradients.

    from tf_checkpointing import checkpointable

    @checkpointable(checkpoint=True)
    def block(x, training=None): ...
"""

from tf_checkpointing._decorator import checkpointable
from tf_checkpointing._flags import is_checkpointing, is_recomputing
from tf_checkpointing._keras import apply_checkpointing

__version__ = "0.1.0"

__all__ = ["apply_checkpointing", "checkpointable", "is_checkpointing", "is_recomputing"]
