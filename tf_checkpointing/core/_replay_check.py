"""The check mode: is the replay the forward again?

``checkpointable(check=True)`` (or ``TF_CHECKPOINTING_CHECK=1``) compares the
structure, shapes and dtypes the replay returns with the forward's;
``check="values"`` (``TF_CHECKPOINTING_CHECK=values``) also compares the values,
which keeps the forward's outputs until the backward. A mismatch means a source
of randomness or state the replay does not restore: the error names the fix.
"""

from __future__ import annotations

import os
from typing import Any

import tensorflow as tf

from tf_checkpointing.core._errors import ReplayMismatchError
from tf_checkpointing.core._structure import Flattened

__all__ = ["CHECK_ENV_VAR", "check_mode_from_environment", "signature", "verify_replay"]

CHECK_ENV_VAR = "TF_CHECKPOINTING_CHECK"


def check_mode_from_environment() -> Any:
    """``TF_CHECKPOINTING_CHECK``: ``1``/``true`` checks structure, ``values`` values."""
    setting = os.environ.get(CHECK_ENV_VAR, "").lower()
    if setting == "values":
        return "values"
    return setting in ("1", "true")


def verify_replay(replay: Any, out: Flattened, out_leaves: list[Any]) -> None:
    """Raises :class:`ReplayMismatchError` when the replay of ``replay`` (a
    ``_recompute._Replay``) returned another structure than its forward, or, in
    ``check="values"`` mode, other values."""
    replayed = signature(out)
    if replayed != replay.out_signature:
        raise ReplayMismatchError(
            f"checkpointable: the replay of `{replay.name}` returned {replayed}, but its "
            f"forward returned {replay.out_signature}. The function must return the same "
            "structure, shapes and dtypes when it is run again: make what decides its "
            "outputs depend on its arguments only (not on Python's `random`, NumPy's "
            "global generator, counters or other state changed by the forward)."
        )
    if replay.out_values is None:
        return
    for k, (before, i) in enumerate(zip(replay.out_values, replay.out_positions)):
        message = (
            f"checkpointable: the replay of `{replay.name}` computed other values than its "
            f"forward (output {k}{{difference}}), so its gradients would be wrong: a "
            "random source or state it reads is not replayed. Python's `random` or "
            "NumPy: draw from keras.random with a keras.random.SeedGenerator or from a "
            "tf.random.Generator instead, or draw outside and pass the numbers in as an "
            "argument. Legacy tf.random ops without a seed (tf.random.uniform, "
            "tf.nn.dropout): call with _force_seed=True or use "
            "checkpointable(..., force_seed=True). Other state: pass it as an argument."
        )
        if tf.executing_eagerly():
            after = out_leaves[i]
            if not bool(tf.reduce_all(_close(after, before))):
                worst = float(tf.reduce_max(tf.abs(tf.cast(after - before, tf.float64))))
                raise ReplayMismatchError(
                    message.format(difference=f", largest difference {worst:.3g}"))
            continue
        # In a graph the comparison is an op: the message reaches the user inside
        # TensorFlow's InvalidArgumentError, as close to ours as a graph allows.
        tf.debugging.Assert(
            tf.reduce_all(_close(out_leaves[i], before)), [message.format(difference="")],
            name="checkpointable_check")


def _close(after: tf.Tensor, before: tf.Tensor) -> tf.Tensor:
    after, before = tf.cast(after, tf.float64), tf.cast(before, tf.float64)
    return tf.abs(after - before) <= 1e-6 + 1e-5 * tf.abs(before)


def signature(out: Flattened) -> Any:
    def describe(leaf: Any) -> Any:
        if isinstance(leaf, tf.Tensor):
            return ("Tensor", tuple(leaf.shape.as_list()) if leaf.shape.rank is not None
                    else None, leaf.dtype.name)
        return type(leaf).__name__

    return tf.nest.map_structure(describe, out.structure), [describe(x) for x in out.leaves]
