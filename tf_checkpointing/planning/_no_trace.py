"""Planning leaves no trace: every piece of state it could touch is put back.

Planning measures a model or chain by running it: profiles, timed steps, XLA
steps of candidate plans. Those runs update BatchNorm statistics, Keras
metrics, seed generators and ``tf.random.Generator`` states, advance the
global random sequences, and set the ``training`` flag of the Keras call
context they run in. A plain model would have done none of that, so after
planning, :func:`nothing_left` puts back:

* every variable the roots own, found three ways so that no kind slips
  through: Keras' own tracking (weights, seed generators, metric variables of
  every nested layer) and TensorFlow's object graph (``tf.random.Generator``
  states and plain ``tf.Variable`` attributes);
* the random sequences a plain step draws from (see
  ``core._seeding.random_state_kept``) and TensorFlow's global generator;
* Keras' call context: planning runs outside the caller's, so a profile's
  ``training=True`` does not become the flag of the user's own call.

Example:
    >>> import keras, tensorflow as tf
    >>> from tf_checkpointing.planning._no_trace import nothing_left
    >>> layer = keras.layers.BatchNormalization()
    >>> _ = layer(tf.ones([2, 3]))
    >>> with nothing_left([layer]):
    ...     _ = layer(tf.random.normal([2, 3]), training=True)  # moves the statistics
    >>> float(tf.reduce_sum(layer.moving_mean))
    0.0
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_checkpointing.core import _keras_context
from tf_checkpointing.core._internals import stateful_random_ops
from tf_checkpointing.core._seeding import random_state_kept

__all__ = ["nothing_left", "owned_variables"]


@contextlib.contextmanager
def nothing_left(roots: Iterable[Any]) -> Iterator[None]:
    """Runs the block outside the caller's Keras call context, then puts back
    every variable ``roots`` own, the random sequences and the global generator."""
    variables = owned_variables(roots)
    generator = stateful_random_ops.global_generator
    # Outside the caller's Keras call: its autocast scope (mixed precision) reads
    # a float32 variable as float16, which would be put back rounded.
    with tf.init_scope(), _keras_context.outside():  # a step being traced: read eagerly
        # Copies (np.array): a view of a variable's buffer would make its next
        # update copy it, in the pool the profile measures.
        saved = [np.array(v.numpy()) for v in variables]
        generator_state = None if generator is None else np.array(generator.state.numpy())
    try:
        with random_state_kept(), _keras_context.outside():
            yield
    finally:
        with tf.init_scope(), _keras_context.outside():
            for variable, value in zip(variables, saved):
                variable.assign(value)
            if generator is not None and stateful_random_ops.global_generator is generator:
                generator.state.assign(generator_state)
            elif generator is None:  # planning made one: a plain step would not have
                stateful_random_ops.global_generator = None


def owned_variables(roots: Iterable[Any]) -> list[Any]:
    """Every variable reachable from ``roots`` (Keras layers or models, or any
    callables), each once."""
    found: dict[int, Any] = {}
    for root in roots:
        if isinstance(root, keras.layers.Layer):
            for layer in root._flatten_layers(include_self=True, recursive=True):  # noqa: SLF001
                for variable in [*layer.variables, *layer.metrics_variables]:
                    found.setdefault(id(variable), variable)
        if isinstance(root, tf.__internal__.tracking.Trackable):
            for obj in tf.train.TrackableView(root).descendants():
                if isinstance(obj, (tf.Variable, keras.Variable)):
                    found.setdefault(id(obj), obj)
    return list(found.values())
