"""``apply_checkpointing``: checkpoint chosen layers of an existing Keras model.

Decorating a layer's ``call`` needs its source; ``checkpointable(layer)`` needs
the place where the layer is called. A model loaded from a file, a
``keras.applications`` network, or a functional model built elsewhere offers
neither. ``apply_checkpointing`` works on the finished object instead: it
replaces the ``call`` of each chosen layer *instance* with a checkpointed
version of itself. Keras' ``Layer.__call__`` runs ``self.call``, so the change
reaches functional, Sequential and subclassed models alike, and nothing else
moves: the same layer objects, the same variables (names, paths, order), the
same ``.keras`` / ``.weights.h5`` / ``tf.train.Checkpoint`` files.

Checkpointing is a property of the running model, not of its architecture:
``model.save("m.keras")`` writes the plain model, and a model loaded back is
checkpointed again by calling ``apply_checkpointing`` on it. (Layers whose class
decorates ``call`` with ``@checkpointable`` carry it in the class instead, so
a registered-serializable one comes back checkpointed by ``load_model``.)
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import keras

from tf_checkpointing._apply_arguments import expect_arguments
from tf_checkpointing._decorator import CheckpointedLayer, checkpointable
from tf_checkpointing._plan_maker import install
from tf_checkpointing._whole_model import warn_if_costly

__all__: list[str] = []

Selector = Union[
    Callable[[keras.layers.Layer], bool], str, type, Sequence[Union[str, type]]
]

_ORIGINAL_CALL = "_self_tf_checkpointing_original_call"


def apply_checkpointing(
    model: keras.layers.Layer,
    select: Optional[Selector] = None,
    *,
    budget: Optional[Union[int, float, str]] = None,
    plan: Any = None,
    force_seed: bool = False,
    check: Union[bool, str] = False,
    policy: Any = None,
    policies: Any = None,
    plan_cache: Any = None,
) -> list[keras.layers.Layer]:
    """Checkpoints the chosen layers of an existing model, in place.

    Pass exactly one of ``select``, ``budget`` and ``plan``. With ``budget``
    (bytes, or ``"min"`` for the least memory) the library picks the regions
    itself: the model's layer graph (functional or ``keras.Sequential``) is
    planned on its first training call, from that batch, in the mode that
    call runs (eager, ``tf.function``, XLA), and regions of consecutive layer
    calls run as one checkpoint each (see :func:`plan_model`); ``plan`` applies
    a plan made ahead with :func:`plan_model`. Per-layer ``select`` saves
    little on a DAG of small layers (each checkpointed layer keeps its inputs);
    a selection that predictably costs memory gets a warning.

    Each chosen layer keeps only its inputs during the forward pass and is
    replayed during backprop (see :func:`checkpointable`). Layers are searched
    at any depth of ``model``; a chosen layer nested inside another chosen
    layer is left alone, since the outer checkpoint already covers it. The
    model's weights, variable names and saved files do not change. ``model``'s
    own ``fit`` / ``evaluate`` / ``predict`` steps are traced again; a
    ``tf.function`` of your own that already traced the model must be made
    again.

    Calling it again on the same model never undoes a checkpoint (a model
    loaded from its file, or rebuilt, starts plain); what the new call does
    depends on what is already there:

    * ``budget`` or ``plan`` after ``budget`` or ``plan``: the new one replaces
      the previous one (the model's own ``call`` is kept, not wrapped twice).
    * ``select`` after ``select``: the chosen layers are checkpointed with the
      new options (a layer chosen again is re-wrapped from its own ``call``,
      not wrapped twice); layers chosen before and not now stay checkpointed
      with their old options.
    * ``select`` after ``budget`` / ``plan``, or ``budget`` / ``plan`` after
      ``select``: both apply (nested checkpoints). ``select`` leaves the
      regions running, and the plan already made, if any; a new ``budget``
      plans again on the next training call. The selected layers run
      checkpointed inside the regions, so a selected layer inside a region is
      recomputed by both.

    The change is made to the layer objects: a layer shared with another model
    is checkpointed there too. Keras runs ``quantized_call`` instead of
    ``call`` for quantized layers, so those are not checkpointed; do not
    combine with ``keras.RematScope`` on the same layers (each would replay).

    Args:
        model: a Keras model or layer (functional, Sequential or subclassed),
            usually already built.
        select: which sublayers to checkpoint (per-layer): a predicate
            ``fn(layer) -> bool``, a list of layer names (every layer with that
            name, at any depth), or a list of layer classes (``isinstance``); a
            list may mix names and classes, and a single name or class is
            accepted too.
        budget: bytes a training step may allocate above what is allocated
            before it, or ``"min"``: plan whole-model regions for it.
        plan: a :class:`ModelPlan` from :func:`plan_model` to apply.
        force_seed: passed to :func:`checkpointable` (replay legacy
            ``tf.random`` ops exactly; Keras random layers need nothing).
        check: passed to :func:`checkpointable` (verify each replay).
        policy: passed to :func:`checkpointable`: a save policy
            (:mod:`tf_checkpointing.policies`) for the chosen layers (with
            ``select`` only).
        policies: with ``budget``, more save policies the planner may replay
            each region under, besides ``policies.reductions_saveable`` (as for
            :func:`plan_model`): None (none more), ``"auto"``, or a list of
            policies.
        plan_cache: with ``budget``, a folder (``str`` or ``os.PathLike``) where
            each plan made is saved, and where the next run finds it instead of
            planning again: a plan is found only for the same model (layers,
            weights' shapes), input shapes, dtype policy, mode, budget,
            policies, trainable layers, device and versions of TensorFlow,
            Keras and this package, so a plan for anything else is never
            applied. None (the default): plans live in this process only.

    Returns:
        The layers now checkpointed, in model order (with ``budget`` or
        ``plan``: ``[model]``, whose ``call`` now runs the regions).

    Raises:
        ValueError: a name matches no layer, or the selection chooses nothing.
        TypeError: ``model`` is not a Keras layer, ``select`` has another type,
            ``policies`` is not None, ``"auto"`` or a list of policies, or
            ``policy`` is given with ``budget`` or ``plan``.

    Example:
        >>> import keras
        >>> from tf_checkpointing import apply_checkpointing
        >>> block = keras.Sequential([  # wide inside, narrow at its input
        ...     keras.layers.Dense(64, activation="relu"),
        ...     keras.layers.Dense(64, activation="relu"),
        ...     keras.layers.Dense(8),
        ... ], name="block")
        >>> model = keras.Sequential([keras.Input((8,)), block, keras.layers.Dense(1)])
        >>> [layer.name for layer in apply_checkpointing(model, ["block"])]
        ['block']
    """
    whole = expect_arguments(model, select, budget=budget, plan=plan, policy=policy,
                             policies=policies, plan_cache=plan_cache)
    if whole is not None:  # budget= or plan=: the graph runner
        install(model, whole, force_seed=force_seed, check=check)
        _forget_traced_steps(model)
        return [model]
    chosen = _chosen_layers(model, select)
    warn_if_costly(model, chosen)  # here: its stacklevel names the caller's line
    for layer in chosen:
        _checkpoint_layer(layer, force_seed=force_seed, check=check, policy=policy)
    _forget_traced_steps(model)
    return chosen


def _chosen_layers(model: keras.layers.Layer, select: Selector) -> list[keras.layers.Layer]:
    """The outermost sublayers of ``model`` that ``select`` chooses (at least one)."""
    candidates = model._flatten_layers(include_self=False, recursive=True)  # noqa: SLF001
    if not candidates:
        raise ValueError(
            f"apply_checkpointing: `{model.name}` has no sublayers yet, so `select` has "
            f"nothing to choose from; received select={select!r}. A model whose layers are "
            "created in build() has none until it is built: build it first, e.g. "
            "model.build(input_shape) or model(sample_batch), then call apply_checkpointing."
        )
    matches = _matcher(select, candidates)
    chosen = _outermost([layer for layer in candidates if matches(layer)])
    if not chosen:
        raise ValueError(
            f"apply_checkpointing: argument `select` chose no layer of `{model.name}`; "
            f"received select={select!r}. Its layers are: {_names(candidates)}. Pass a "
            "predicate that returns True for some of them, or their names or classes."
        )
    return chosen


def _checkpoint_layer(layer: keras.layers.Layer, *, force_seed: bool, check: Any,
                      policy: Any = None) -> None:
    if type(layer) is CheckpointedLayer:  # a checkpointable(layer) proxy: patch the layer
        layer = layer.__wrapped__
    current = vars(layer).get("call")
    original = getattr(current, _ORIGINAL_CALL, None) or layer.call
    wrapped = checkpointable(original, checkpoint=True, force_seed=force_seed, check=check,
                             policy=policy)
    setattr(wrapped, _ORIGINAL_CALL, original)
    # Plain object.__setattr__: a function is nothing for Keras or TensorFlow to track.
    object.__setattr__(layer, "call", wrapped)


def _forget_traced_steps(model: keras.layers.Layer) -> None:
    """Makes ``fit`` / ``evaluate`` / ``predict`` trace their step again: one
    traced before the change would keep running the plain ``call``."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


def _matcher(select: Selector, candidates: Sequence[keras.layers.Layer]) -> Callable[[Any], bool]:
    if isinstance(select, (str, type)):
        select = [select]
    if isinstance(select, keras.layers.Layer):
        raise _select_type_error(select)
    if callable(select) and not isinstance(select, (list, tuple, set, frozenset)):
        return lambda layer: bool(select(layer))
    if not isinstance(select, Iterable):
        raise _select_type_error(select)
    names, classes = set(), []
    for item in select:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, keras.layers.Layer):
            classes.append(item)
        else:
            raise _select_type_error(item, in_list=True)
    known = {layer.name for layer in candidates}
    missing = sorted(names - known)
    if missing:
        # Suggest only close names of layers worth checkpointing (not `input_layer`).
        suggestible = [layer.name for layer in candidates
                       if not isinstance(layer, keras.layers.InputLayer)]
        hints = {n: difflib.get_close_matches(n, suggestible, n=1, cutoff=0.7) for n in missing}
        hint = "; ".join(f"{n!r}: did you mean {h[0]!r}?" for n, h in hints.items() if h)
        if "min" in missing:
            # apply_checkpointing(model, "min") passes "min" as `select` (the one
            # positional argument), not as the budget it almost surely meant.
            hint = "; ".join(filter(None, (hint, "'min': did you mean budget='min'? Pass "
                                           "apply_checkpointing(model, budget='min')")))
        raise ValueError(
            f"apply_checkpointing: argument `select` names layers that do not exist: "
            f"{missing}. {hint + '. ' if hint else ''}The layers are: {_names(candidates)}. "
            "Pass existing names (see model.summary()), or a predicate."
        )
    classes_tuple = tuple(classes)
    return lambda layer: layer.name in names or isinstance(layer, classes_tuple)


def _select_type_error(value: Any, in_list: bool = False) -> TypeError:
    where = "an item of `select`" if in_list else "`select`"
    return TypeError(
        f"apply_checkpointing: argument `select` must be a predicate fn(layer) -> bool, "
        f"a list of layer names, or a list of keras.layers.Layer subclasses; {where} "
        f"is {value!r} of type {type(value).__name__}. Pass e.g. select=['block_1'], "
        "select=[keras.layers.Dense] or select=lambda layer: 'block' in layer.name."
    )


def _outermost(chosen: list[keras.layers.Layer]) -> list[keras.layers.Layer]:
    """Drops chosen layers that sit inside another chosen layer."""
    inner = set()
    for layer in chosen:
        for sub in layer._flatten_layers(include_self=False, recursive=True):  # noqa: SLF001
            inner.add(id(sub))
    return [layer for layer in chosen if id(layer) not in inner]


def _names(layers: Sequence[keras.layers.Layer]) -> str:
    names = [layer.name for layer in layers]
    shown = ", ".join(repr(n) for n in names[:20])
    return f"[{shown}{', ...' if len(names) > 20 else ''}]"
