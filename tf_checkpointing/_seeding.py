"""``force_seed``: exact replay of TensorFlow's legacy stateful random ops.

``tf.random.uniform`` / ``tf.random.normal`` without a seed and ``tf.nn.dropout``
draw from a kernel's hidden state, which no variable exposes, so the replay
would draw new numbers. With ``force_seed`` the forward and its replay are made
to draw the same numbers, and each call still draws new ones:

* eager: each call picks a fresh seed, runs the forward and the replay with it
  as the global seed, and puts the user's global seed state back afterwards
  (the user's own sequence of random numbers is not reset);
* ``tf.function`` / XLA: each legacy random op built inside the call is
  replaced by its stateless twin, seeded from one per-call seed tensor, drawn
  in the forward and reused by the replay.

Keras random layers, ``keras.random`` with a ``SeedGenerator``,
``tf.random.Generator`` and stateless ops need none of this (see ``_state``).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework import op_callbacks

__all__: list[str] = []

_MAX_SEED = 2**31 - 1
# Seeds for eager calls come from a private generator, re-seeded from the
# user's global seed whenever that changes, so runs with a global seed repeat.
_seed_source = random.Random()
_seed_source_origin: Optional[int] = None


def draw_call_seed() -> Any:
    """A fresh seed for one checkpointed call: an int in eager mode, an int32
    tensor of shape [2] inside a graph (drawn anew each time the graph runs)."""
    global _seed_source_origin
    if not tf.executing_eagerly():
        return tf.random.uniform([2], maxval=_MAX_SEED, dtype=tf.int32)
    user_seed = context.context()._seed  # noqa: SLF001 (TensorFlow has no public getter)
    if user_seed is not None and user_seed != _seed_source_origin:
        _seed_source.seed(user_seed)
        _seed_source_origin = user_seed
    return _seed_source.randrange(_MAX_SEED)


@contextlib.contextmanager
def forced_seed(call_seed: Any) -> Iterator[None]:
    """Makes legacy stateful random ops in the body draw from ``call_seed``."""
    if isinstance(call_seed, int):
        with _eager_global_seed(call_seed):
            yield
    else:
        rewriter = _StatelessRewriter(call_seed)
        op_callbacks.add_op_callback(rewriter)
        try:
            yield
        finally:
            op_callbacks.remove_op_callback(rewriter)


@contextlib.contextmanager
def _eager_global_seed(seed: int) -> Iterator[None]:
    ctx = context.context()
    saved = (ctx._seed, getattr(ctx, "_rng", None))  # noqa: SLF001
    ctx._set_global_seed(seed)  # noqa: SLF001 (also clears the cached random kernels)
    try:
        yield
    finally:
        ctx._seed, ctx._rng = saved  # noqa: SLF001 (restored, not re-seeded)


class _StatelessRewriter:
    """Op callback that swaps each legacy random op's output for a stateless
    draw seeded by (call seed, index of the op in the call)."""

    def __init__(self, call_seed: tf.Tensor) -> None:
        self._call_seed = call_seed
        self._count = 0

    def __call__(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        make = _STATELESS_TWINS.get(op_type)
        if make is None or graph is None or outputs is None:
            return outputs  # unchanged (see _state.StateRecorder._on_op)
        seed = tf.random.experimental.stateless_fold_in(self._call_seed, self._count)
        self._count += 1
        return [make(inputs, outputs[0].dtype, seed)]


_STATELESS_TWINS = {
    "RandomUniform": lambda i, dtype, seed: tf.random.stateless_uniform(i[0], seed, dtype=dtype),
    "RandomStandardNormal": lambda i, dtype, seed: tf.random.stateless_normal(
        i[0], seed, dtype=dtype
    ),
    "TruncatedNormal": lambda i, dtype, seed: tf.random.stateless_truncated_normal(
        i[0], seed, dtype=dtype
    ),
    "RandomUniformInt": lambda i, dtype, seed: tf.random.stateless_uniform(
        i[0], seed, minval=i[1], maxval=i[2], dtype=dtype
    ),
}
