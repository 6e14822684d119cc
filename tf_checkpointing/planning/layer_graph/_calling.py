"""How each layer of a chain is called: the chain checked, and the call-time
keywords routed to the layers whose signature accepts them.

The profile and the checkpointed run call the layers alike: each layer gets the
call-time keywords its signature accepts (:func:`route_keywords`: ``training=``
reaches ``Dropout`` but not ``LayerNormalization`` or ``tf.nn.relu``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Optional

import keras

from tf_checkpointing.planning._errors import PlanningTypeError, PlanningValueError
from tf_checkpointing.planning.layer_graph._layer_graph import chain_break

__all__: list[str] = []


def layer_names(layers: Sequence[Any]) -> list[str]:
    """How a plan names each layer of a chain: a Keras layer's name, a
    function's ``__name__``, else its class name."""
    return [getattr(layer, "name", None) or getattr(layer, "__name__", None)
            or type(layer).__name__ for layer in layers]


def validate_layers(layers: Any) -> list[Any]:
    """The chain as a list, or a ``PlanningTypeError`` / ``PlanningValueError``
    that says what to pass (the API called names itself)."""
    if isinstance(layers, keras.Sequential):
        layers = list(layers.layers)
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        try:
            layers = list(layers)
        except TypeError:
            raise PlanningTypeError(
                "argument `layers` must be a list of callables (Keras layers or "
                f"functions); received {layers!r} of type {type(layers).__name__}. Pass "
                "the chain as a list, e.g. [keras.layers.Dense(64), tf.nn.relu]."
            ) from None
    layers = list(layers)
    if not layers:
        raise PlanningValueError(
            "argument `layers` must contain at least one layer; received an "
            "empty list. Pass the chain to run, e.g. [keras.layers.Dense(64) for _ in "
            "range(8)]."
        )
    reason = chain_break(layers)
    if reason is not None:
        raise PlanningValueError(
            "argument `layers` must form a chain (each layer fed the previous "
            f"one's output), but these layers come from a model graph that is not a "
            f"chain: {reason}. Checkpoint the whole model instead, with regions chosen "
            "for a memory budget: apply_checkpointing(model, budget=...) (bytes, or "
            "'min'), or plan_model(model, inputs, budget=...) to see the plan first."
        )
    for i, layer in enumerate(layers):
        if not callable(layer) or isinstance(layer, type):
            hint = " (a class: instantiate it)" if isinstance(layer, type) else ""
            raise PlanningTypeError(
                "argument `layers` must contain only callables (Keras layer "
                f"instances or functions); received {layer!r} of type "
                f"{type(layer).__name__} at index {i}{hint}. Pass e.g. "
                "keras.layers.Dense(64) or tf.nn.relu."
            )
    return layers


def accepted_keywords(layer: Any) -> Optional[frozenset[str]]:
    """The keyword arguments ``layer`` takes: a set of names, or None for any
    (``**kwargs``). A Keras layer is asked about its ``call``."""
    target = layer
    wrapped = getattr(layer, "__wrapped__", None)  # checkpointable(layer) proxies
    if isinstance(wrapped, keras.layers.Layer):
        target = wrapped
    if isinstance(target, keras.layers.Layer):
        target = target.call
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return frozenset(p.name for p in parameters
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def route_keywords(layers: Sequence[Any], kwargs: dict[str, Any], *,
                   strict: bool = True) -> list[dict]:
    """For each layer, the part of ``kwargs`` its signature accepts; with
    ``strict``, a keyword that no layer accepts is an error (likely a typo: a
    ``PlanningTypeError``, which the API called words)."""
    if not kwargs:
        return [{} for _ in layers]
    accepted = [accepted_keywords(layer) for layer in layers]
    routed = [dict(kwargs) if names is None else
              {k: v for k, v in kwargs.items() if k in names} for names in accepted]
    unused = [k for k in kwargs if not any(k in r for r in routed)]
    if unused and strict:
        raise PlanningTypeError(
            f"keyword argument(s) {', '.join(map(repr, unused))} are accepted by "
            f"none of the {len(layers)} layers; received {unused[0]}="
            f"{kwargs[unused[0]]!r}. Check the spelling, or pass only keywords that some "
            "layer's call takes (e.g. training=True)."
        )
    return routed
