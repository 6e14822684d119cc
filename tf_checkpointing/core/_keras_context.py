"""The Keras call state a replay must see again.

A Keras layer called without ``training=`` inherits it from the outermost
layer call (``model(x, training=True)`` sets it for every sublayer), and
mixed-precision layers read their variables through an autocast scope. Both
live in Keras' thread-local global state and are gone by the time backprop
replays the function, so a replayed ``Dropout`` would act as in inference and
a float16 layer would compute in float32. We capture them at the forward and
put them back around the replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tf_checkpointing.core._internals import keras_global_state

__all__: list[str] = []

_ATTRIBUTES = ("current_call_ctx", "autocast_scope")


def capture() -> tuple[Any, ...]:
    return tuple(keras_global_state.get_global_attribute(name) for name in _ATTRIBUTES)


@contextlib.contextmanager
def restored(captured: tuple[Any, ...]) -> Iterator[None]:
    if not captured:
        yield
        return
    saved = capture()
    for name, value in zip(_ATTRIBUTES, captured):
        keras_global_state.set_global_attribute(name, value)
    try:
        yield
    finally:
        for name, value in zip(_ATTRIBUTES, saved):
            keras_global_state.set_global_attribute(name, value)


@contextlib.contextmanager
def outside() -> Iterator[None]:
    """A block run as if no Keras layer were being called: what it calls starts
    a call context of its own, and the caller's (its ``training`` flag) is as
    it was afterwards."""
    with restored((None,) * len(_ATTRIBUTES)):
        yield
