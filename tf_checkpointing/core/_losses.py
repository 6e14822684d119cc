"""Losses that layers add inside a checkpointed call (``add_loss``, activity regularizers).

A Keras layer adds a loss by appending a tensor to its own list (inside a
``keras.StatelessScope`` that collects losses, to the scope's), and
``model.losses`` reads those lists after the call. A checkpointed call's
forward runs with no tape recording, so a loss added there would be a constant
to the user's tape: its value right, its gradient silently zero (measured: an
``activity_regularizer`` on a Dense inside a region left the kernel's gradient
off by 0.11; a layer calling ``add_loss`` in ``checkpointable`` counted its
loss twice after the replay). So every checkpointed call runs its function
through :func:`with_added_losses`: the losses its layers add are taken out of
their lists and returned as extra outputs of the call, whose gradient replays
the function, and :func:`put_back` adds the returned (differentiable) tensors
where the layers had put theirs. A replay's losses are taken out the same way,
so they are never added twice. The losses returned so are noted
(:func:`returned_as_loss`): an output of the call they were computed from is
flagged by the chained-output check (``_structure``), whose message can then say
that it feeds an added loss, not an output the caller returned.

Which losses a call adds is known by wrapping ``keras.layers.Layer.add_loss``
(with ``wrapt``, once, when this module is imported): while a checkpointed call
of this thread runs, each loss added is noted for it. Outside one, ``add_loss``
runs as Keras wrote it.

:class:`AddedLosses` is the other direction, for the planners: their profile
calls the layers in a thread of its own, and the losses those calls add are
removed from the layers' lists afterwards.

Example:
    >>> import keras, tensorflow as tf
    >>> from tf_checkpointing.core._losses import with_added_losses, put_back
    >>> layer = keras.layers.Dense(2, activity_regularizer="l2")
    >>> run, added = with_added_losses(lambda x: layer(x))
    >>> y, losses = run(tf.ones([1, 3]))
    >>> len(losses), len(layer.losses)      # taken out, returned
    (1, 0)
    >>> put_back(added, losses)
    >>> len(layer.losses)
    1
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Callable

import keras
import wrapt

from tf_checkpointing.core._internals import keras_backend as backend

__all__ = ["AddedLosses", "put_back", "with_added_losses"]

_collecting = threading.local()  # per thread: the lists of the calls running
# The losses checkpointed calls returned as outputs, by ``Tensor._id`` (never
# reused), held weakly: the chained-output check tells them from the call's own
# outputs.
_returned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _note_added_loss(wrapped: Callable[..., Any], layer: Any, args: tuple,
                     kwargs: dict) -> Any:
    """``Layer.add_loss``, noting for the innermost checkpointed call running
    in this thread which losses it added (and where Keras put them)."""
    stack = getattr(_collecting, "stack", None)
    if not stack:
        return wrapped(*args, **kwargs)
    own = layer._losses  # noqa: SLF001 - where Keras keeps a layer's added losses
    scope = backend.get_stateless_scope() if backend.in_stateless_scope() else None
    own_before = len(own)
    scope_before = len(scope.losses) if scope is not None else 0
    result = wrapped(*args, **kwargs)
    stack[-1].extend((layer, loss, None) for loss in own[own_before:])
    if scope is not None:
        stack[-1].extend((layer, loss, scope) for loss in scope.losses[scope_before:])
    return result


wrapt.wrap_function_wrapper(keras.layers.Layer, "add_loss", _note_added_loss)


@contextlib.contextmanager
def _collected() -> Iterator[list[tuple[Any, Any, Any]]]:
    if not hasattr(_collecting, "stack"):
        _collecting.stack = []
    noted: list[tuple[Any, Any, Any]] = []
    _collecting.stack.append(noted)
    try:
        yield noted
    finally:
        _collecting.stack.pop()


def with_added_losses(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` returning ``(its result, the losses it added)``, the losses taken out
    of the layers' lists; and a list that gets, on the first call, the layers
    that added them (for :func:`put_back`)."""
    owners: list[Any] = []
    calls: list[bool] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
        with _collected() as noted:
            result = fn(*args, **kwargs)
        for layer, loss, scope in noted:
            kept = layer._losses if scope is None else scope.losses  # noqa: SLF001
            for k, other in enumerate(kept):
                if other is loss:
                    del kept[k]
                    break
        if not calls:
            owners.extend(layer for layer, _, _ in noted)
        calls.append(True)
        for _, loss, _ in noted:
            key = getattr(loss, "_id", None)
            if isinstance(key, int):
                _returned[key] = loss
        return result, [loss for _, loss, _ in noted]

    return run, owners


def returned_as_loss(tensor: Any) -> bool:
    """Whether ``tensor`` is a loss a layer added inside a checkpointed call,
    which :func:`with_added_losses` returned as an output of the call."""
    key = getattr(tensor, "_id", None)
    return isinstance(key, int) and _returned.get(key) is tensor


def put_back(owners: Sequence[Any], losses: Sequence[Any]) -> None:
    """Adds each of ``losses`` to the layer at its position in ``owners``, with
    ``add_loss`` (so that an enclosing checkpointed call notes it in turn)."""
    for layer, loss in zip(owners, losses):
        layer.add_loss(loss)


class AddedLosses:
    """Marks how many losses ``layers`` hold now; :meth:`take` removes and
    returns the ones added since (by any thread)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers = list(layers)
        self.lengths = [len(layer._losses) for layer in self.layers]  # noqa: SLF001

    def take(self) -> list[Any]:
        taken: list[Any] = []
        for layer, length in zip(self.layers, self.lengths):
            own = layer._losses  # noqa: SLF001
            taken.extend(own[length:])
            del own[length:]
        return taken

