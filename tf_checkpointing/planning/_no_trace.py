"""Planning leaves no trace: every piece of state it could touch is put back.

Planning measures a model or chain by running it: profiles, timed steps, XLA
steps of candidate plans. Those runs update BatchNorm statistics, Keras
metrics, seed generators and ``tf.random.Generator`` states, advance the
global random sequences, and set the ``training`` flag of the Keras call
context they run in. A plain model would have done none of that, so after
planning, :func:`nothing_left` puts back:

* every variable alive in the process whose value planning changed. Not only
  the model's: a layer may draw from a module-level generator or count in a
  closed-over ``tf.Variable`` that no tracking reaches, and planning's traced
  steps advance those too. A variable planning did not change is not written,
  so nothing another thread does to it is undone;
* the random sequences a plain step draws from (see
  ``core._seeding.random_state_kept``), and no global generator where there
  was none;
* Keras' call context: planning runs outside the caller's, so a profile's
  ``training=True`` does not become the flag of the user's own call.

Example:
    >>> import keras, tensorflow as tf
    >>> from tf_checkpointing.planning._no_trace import nothing_left
    >>> layer = keras.layers.BatchNormalization()
    >>> _ = layer(tf.ones([2, 3]))
    >>> counter = tf.Variable(0)  # tracked by nothing
    >>> with nothing_left():
    ...     _ = layer(tf.random.normal([2, 3]), training=True)  # moves the statistics
    ...     _ = counter.assign_add(1)
    >>> float(tf.reduce_sum(layer.moving_mean)), int(counter.numpy())
    (0.0, 0)
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from tf_checkpointing.core import _keras_context
from tf_checkpointing.core._internals import resource_variable_ops, stateful_random_ops
from tf_checkpointing.core._seeding import random_state_kept

__all__ = ["nothing_left", "live_variables"]


@contextlib.contextmanager
def nothing_left() -> Iterator[None]:
    """Runs the block outside the caller's Keras call context, then puts back
    every variable whose value it changed, the random sequences, and the global
    generator's absence."""
    had_generator = stateful_random_ops.global_generator is not None
    # Outside the caller's Keras call: its autocast scope (mixed precision) reads
    # a float32 variable as float16, which would be put back rounded.
    with tf.init_scope(), _keras_context.outside():  # a step being traced: read eagerly
        saved = [(variable, value) for variable in live_variables()
                 if (value := _value(variable)) is not None]
    try:
        with random_state_kept(), _keras_context.outside():
            yield
    finally:
        with tf.init_scope(), _keras_context.outside():
            for variable, value in saved:
                now = _value(variable)
                if now is not None and not _same(now, value):
                    variable.assign(value)
            if not had_generator:  # planning made one: a plain step would not have
                stateful_random_ops.global_generator = None


def live_variables() -> list[Any]:
    """Every resource variable alive in the process: the storage under Keras
    variables, mirrored variables' components, generators' states."""
    return [obj for obj in gc.get_objects() if _is_variable(type(obj))]


@functools.cache
def _is_variable(kind: type) -> bool:
    # Cached per type: the heap holds ~10^5 objects of a few thousand types.
    return issubclass(kind, resource_variable_ops.BaseResourceVariable)


def _value(variable: Any) -> np.ndarray | None:
    """A copy of the variable's value, or None for one planning cannot have read:
    made inside a traced function, not yet initialized, or already deleted."""
    if tf.is_symbolic_tensor(variable.handle):
        return None
    try:
        if not variable.is_initialized():  # reads as an empty array, not its shape
            return None
        # A copy (np.array): a view of the buffer would make the variable's next
        # update copy it, in the pool the profile measures.
        return np.array(variable.numpy())
    except (tf.errors.FailedPreconditionError, tf.errors.NotFoundError,
            tf.errors.InvalidArgumentError):
        return None


def _same(now: np.ndarray, before: np.ndarray) -> bool:
    """Bit for bit, so that -0.0 against 0.0 and NaN payloads count as changes."""
    if now.shape != before.shape or now.dtype != before.dtype:
        return False
    if before.dtype == object:  # string variables
        return bool(np.array_equal(now, before))
    return now.tobytes() == before.tobytes()
