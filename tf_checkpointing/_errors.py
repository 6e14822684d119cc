"""The library's own errors, for users to catch."""

from __future__ import annotations

__all__ = ["ReplayMismatchError"]


class ReplayMismatchError(RuntimeError):
    """The check mode found that a replay differs from its forward.

    Raised during backprop by a function checkpointed with ``check=True`` or
    ``check="values"`` (or ``TF_CHECKPOINTING_CHECK``): its replay returned another
    structure, or other values, than its forward did, so its gradients would be
    wrong. The message names the function and the fix. A value check inside a
    ``tf.function`` runs in the graph, where TensorFlow raises its own
    ``tf.errors.InvalidArgumentError`` carrying the same message.

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing import ReplayMismatchError, checkpointable
        >>> import random
        >>> block = checkpointable(lambda x: x * random.random(), checkpoint=True,
        ...                        check="values")
        >>> x = tf.ones([3])
        >>> with tf.GradientTape() as tape:
        ...     tape.watch(x)
        ...     y = block(x)
        >>> try:
        ...     tape.gradient(y, x)
        ... except ReplayMismatchError as error:
        ...     print(str(error)[:60])
        checkpointable: the replay of `<lambda>` computed other valu
    """
