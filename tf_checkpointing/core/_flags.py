"""Thread-local flags that tell code whether it runs inside a checkpointed call.

A checkpointed function runs twice per training step: once in the forward pass
(``is_checkpointing()`` is True) and once more during backprop, when the library
replays it to rebuild the activations it did not keep (``is_recomputing()`` is
True as well). Code inside the function can use the flags to skip side effects
that must happen only once, such as logging or appending to a Python list::

    @checkpointable(checkpoint=True)
    def block(x):
        if not is_recomputing():
            print("forward of block")
        return tf.nn.gelu(x)

The flags are per thread, so two threads that train at once never see each
other's state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__: list[str] = []


class _Flags(threading.local):
    checkpointing: bool = False
    recomputing: bool = False
    entered: int = 0  # checkpoint scopes entered so far (forwards and replays)


_flags = _Flags()


def is_checkpointing() -> bool:
    """True inside a checkpointed call: its forward pass and its replay.

    Example:
        >>> from tf_checkpointing import checkpointable, is_checkpointing
        >>> is_checkpointing()
        False
    """
    return _flags.checkpointing


def is_recomputing() -> bool:
    """True only while a checkpointed call is replayed during backprop.

    Use it to keep a side effect from running twice per step::

        if not tf_checkpointing.is_recomputing():
            tf.print("activation norm", tf.norm(h))

    Example:
        >>> from tf_checkpointing import is_recomputing
        >>> is_recomputing()
        False
    """
    return _flags.recomputing


@contextlib.contextmanager
def checkpoint_scope(*, recomputing: bool) -> Iterator[None]:
    """Sets both flags for the body and restores the previous values after it,
    whether the body returns or raises."""
    saved = (_flags.checkpointing, _flags.recomputing)
    _flags.checkpointing, _flags.recomputing = True, recomputing
    _flags.entered += 1
    try:
        yield
    finally:
        _flags.checkpointing, _flags.recomputing = saved


def checkpoint_scopes_entered() -> int:
    """How many checkpoint scopes this thread has entered: a caller compares two
    readings to learn whether a checkpointed call ran in between."""
    return _flags.entered
