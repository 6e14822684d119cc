"""Measuring and debugging: what a step allocates, and what its gradient keeps.

`measure` runs a function (one training step) and reads the device allocator's
peak above where it started: the number checkpointing lowers. `saved_residuals`
(`print_saved_residuals` prints it as a table) lists each tensor that the
gradient of a function keeps from its forward pass for its backward, and why:
what a checkpoint or a save policy changes. `ChainedOutputWarning` is the warning
to filter when a checkpointed call returns an output that it computes another
output from, and you never take a gradient with respect to that output.

Example:
    >>> import tensorflow as tf
    >>> from tf_checkpointing.debug import measure, saved_residuals
    >>> w = tf.Variable(tf.ones([4, 4]))
    >>> kept = saved_residuals(lambda x: tf.nn.gelu(x @ w), tf.ones([2, 4]))
    >>> sum(r.bytes for r in kept if r.kind == "activation")
    96
    >>> measure(lambda: tf.reduce_sum(tf.zeros([1024, 1024]) + 1.0)).peak_bytes >= 4 * 2**20
    True
"""

from tf_checkpointing.core._errors import ChainedOutputWarning as ChainedOutputWarning
from tf_checkpointing.core._memory import MemoryStats as MemoryStats
from tf_checkpointing.core._memory import measure as measure
from tf_checkpointing.core._memory import peak_memory as peak_memory
from tf_checkpointing.core._residuals import Residual as Residual
from tf_checkpointing.core._residuals import print_saved_residuals as print_saved_residuals
from tf_checkpointing.core._residuals import saved_residuals as saved_residuals

# peak_memory (deprecated: measure(fn).peak_bytes) is importable but not listed.
__all__ = ["ChainedOutputWarning", "MemoryStats", "Residual", "measure",
           "print_saved_residuals", "saved_residuals"]
