"""The library's own errors, for users to catch."""

from __future__ import annotations

__all__ = ["ChainedOutputWarning", "ReplayMismatchError"]


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


class ChainedOutputWarning(UserWarning):
    """A checkpointed call returns an output that it also uses to compute another
    of its outputs (an encoder block returning ``skip`` and ``pool(skip)``).

    Gradients with respect to the call's inputs and variables, which is what
    training takes, are exact. Only ``tape.gradient(loss, that_output)`` would miss
    the path through the outputs computed from it, because the outer tape sees the
    outputs of one checkpointed call as independent. Warned once per function; the
    check mode (``check=True``) raises instead. If you never take a gradient with
    respect to that output, silence it:

    Example:
        >>> import warnings
        >>> from tf_checkpointing.debug import ChainedOutputWarning
        >>> warnings.filterwarnings("ignore", category=ChainedOutputWarning)
    """
