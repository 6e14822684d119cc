"""The largest batch ``Model.fit`` will feed, for a plan made while its step is traced.

Keras traces ``fit``'s training step on the data's element spec: a
``tf.data.Dataset`` batched without ``drop_remainder`` (the way most people feed
Keras), or arrays whose length is not a multiple of ``batch_size``, give the
step an unknown batch size, and a budget cannot be planned for an unknown size.
The data says it: the dataset's ``batch(n)``, or ``fit``'s ``batch_size``. So
``apply_checkpointing(model, budget=...)`` wraps the model's ``fit`` to tell the
installed runner that size before Keras traces: the plan is made for batches of
that size (synthetic ones; the data is not read), and holds for every batch,
none of which is larger. Nothing of the data is consumed, so training sees the
batches in the order a plain model would.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Optional

import keras
import tensorflow as tf
import wrapt

from tf_checkpointing.core._internals import dataset_batch_size

__all__: list[str] = []

_FIT_SIGNATURE = inspect.signature(keras.Model.fit)
_KERAS_DEFAULT_BATCH = 32  # fit's batch size for arrays when none is given


def largest_batch(args: tuple, kwargs: dict) -> Optional[int]:
    """The largest batch, per replica, that ``fit(*args, **kwargs)`` feeds the
    model, or None where the data does not say (a generator, a PyDataset).

    Example:
        >>> import numpy as np, tensorflow as tf
        >>> from tf_checkpointing._fit_batches import largest_batch
        >>> largest_batch((np.zeros([20, 3]), np.zeros([20])), {"batch_size": 8})
        8
        >>> largest_batch((tf.data.Dataset.range(20).batch(6),), {})
        6
    """
    try:
        bound = _FIT_SIGNATURE.bind(None, *args, **kwargs).arguments
    except TypeError:
        return None
    x = bound.get("x")
    if isinstance(x, tf.data.Dataset):
        size = dataset_batch_size(x)
    elif x is not None and all(hasattr(leaf, "shape") and len(leaf.shape)
                               for leaf in tf.nest.flatten(x)):
        samples = min(int(leaf.shape[0]) for leaf in tf.nest.flatten(x))
        size = min(bound.get("batch_size") or _KERAS_DEFAULT_BATCH, samples)
    else:
        return None
    if size is None:
        return None
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return math.ceil(size / replicas)


class _FitThatTellsTheBatch(wrapt.FunctionWrapper):
    """``model.fit``, telling the model's runner the largest batch first."""


def tell_the_batch_on_fit(model: Any, tell: Callable[[Any, Optional[int]], None]) -> None:
    """Wraps ``model.fit`` (once) so that each call first does
    ``tell(model, largest_batch(...))``."""
    if isinstance(vars(model).get("fit"), _FitThatTellsTheBatch):
        return

    def fit(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        tell(model, largest_batch(args, kwargs))
        return wrapped(*args, **kwargs)

    # Plain object.__setattr__: a method is nothing for Keras to track.
    object.__setattr__(model, "fit", _FitThatTellsTheBatch(model.fit, fit))
