"""The selections of repeated blocks a user could write, which a plan must never lose to.

``apply_checkpointing(model, [Block])`` checkpoints every call of a layer class
one by one. Where a model's repeated blocks are calls of its layer graph (a
keras_hub GPT-2's decoder blocks), that selection is a set of regions of the
graph: :func:`block_spans`; a model of Keras layers has its blocks by layer name
(:func:`named_block_spans`, ``conv2_block1_*``) and its pieces between residual
joins (:func:`segment_spans`). Where they run inside one layer that holds them
(keras_hub's ``ViTEncoder`` runs its ``ViTEncoderBlock`` s in a Python loop, a
custom stack keeps ``self.blocks = [Block() for _ in range(8)]``), the graph sees
that layer as one call: no region can reach inside it, and the least region plan
keeps what plain keeps. The blocks are then the sublayers of that call, found at
any depth: :func:`inner_block_choices` gives one selection per repeated block
class, each as ``(call index, sublayer index)`` pairs (a sublayer's index among
``sublayers(call.layer)``), which a :class:`~..plans._plan.ModelPlan` carries as its
``blocks`` and the runner checkpoints one by one.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from tf_checkpointing.planning.layer_graph._layer_graph import LayerGraph, last_uses, tensor_keys

__all__ = ["BlockRef", "block_layers", "block_spans", "candidate_layers", "holds_filter",
           "inner_block_choices", "named_block_spans", "plain_filters_replayed", "segment_spans",
           "sublayers"]

BlockRef = tuple[int, int]
"""A sublayer of a layer call: ``(call index, index in sublayers(call.layer))``."""

# At most this many block classes are measured (one compiled step each).
_MAX_CLASSES = 3
# A piece of the model cut at one live tensor shorter than this joins the one before
# (a ReLU after a residual Add is a piece of its own: no block).
_MIN_SEGMENT = 3
# Blocks named by layer are looked for at most this many numbered name parts deep.
_MAX_NAME_LEVELS = 3


def sublayers(layer: Any) -> list[Any]:
    """Every layer ``layer`` holds, at any depth, in Keras' tracking order (the
    same for every instance of one architecture)."""
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:
        return []
    return list(flatten(include_self=False, recursive=True))


def _is_block(layer: Any) -> bool:
    """A layer class of the user's or a model library's, with weights (Keras'
    own layers are the pieces blocks are made of)."""
    return bool(getattr(layer, "weights", None)) and not type(layer).__module__.startswith(
        "keras.")


def block_spans(graph: LayerGraph) -> tuple:
    """Each call of the model's repeated block as a region of its own: the calls
    of the most frequent layer class with weights that Keras does not define
    (a transformer's decoder block), if it is called at least twice; else ().
    What ``apply_checkpointing(model, [Block])`` runs.

        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> from tf_checkpointing.planning.layer_graph._blocks import block_spans
        >>> class Block(keras.layers.Dense): pass
        >>> x = keras.Input((4,))
        >>> model = keras.Model(x, Block(4)(keras.layers.Dense(4)(Block(4)(x))))
        >>> block_spans(read_graph(model))
        ((0, 1, ()), (2, 3, ()))
    """
    counts = Counter(type(call.layer) for call in graph.calls if _is_block(call.layer))
    if not counts:
        return ()
    block, n = counts.most_common(1)[0]
    if n < 2:
        return ()
    return tuple((i, i + 1, ()) for i, call in enumerate(graph.calls) if type(call.layer) is block)


def segment_spans(graph: LayerGraph, min_calls: int = _MIN_SEGMENT) -> tuple:
    """The model cut where one floating tensor alone is alive (a residual block's
    input, which both its branch and its skip read), each piece of at least
    ``min_calls`` calls (shorter ones join the piece before) as a region, the
    calls after the last cut (the head) plain: close to the per-block selection
    a user writes by layer-name prefix (:func:`named_block_spans` is that one),
    but cut where the graph allows, whatever the names. () when the model has
    fewer than two such pieces.

        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> from tf_checkpointing.planning.layer_graph._blocks import segment_spans
        >>> x = keras.Input((4,))
        >>> h = x
        >>> for _ in range(3):
        ...     y = keras.layers.Dense(4)(keras.layers.Dense(4)(h))
        ...     h = keras.layers.Add()([h, keras.layers.ReLU()(y)])
        >>> segment_spans(read_graph(keras.Model(x, keras.layers.Dense(1)(h))))
        ((0, 4, ()), (4, 8, ()), (8, 12, ()))
    """
    floating = {key: _is_floating(t) for call in graph.calls
                for t, key in zip(call.arguments.keras_tensors, call.arg_keys)}
    made, last = graph.producers(), dict(zip(tensor_keys(graph), last_uses(graph)))
    n = len(graph.calls)
    cuts = [i for i in range(1, n) if sum(
        1 for key, end in last.items() if made[key] < i <= end and floating.get(key, True)) == 1]
    bounds = [0]
    for cut in cuts:
        if cut - bounds[-1] >= min_calls:
            bounds.append(cut)
    pieces = [(a, c, ()) for a, c in zip(bounds, bounds[1:])]
    return tuple(pieces) if len(pieces) >= 2 else ()


def holds_filter(graph: LayerGraph, start: int, stop: int) -> bool:
    """Whether calls ``start:stop`` read a filter (a weight of rank 3 or more),
    which XLA turns for a convolution's backward (see
    docs/decisions/0004-filters-that-wait.md)."""
    return any(len(weight.shape) >= 3 for call in graph.calls[start:stop]
               for weight in getattr(call.layer, "weights", ()))


def plain_filters_replayed(graph: LayerGraph, spans: tuple) -> tuple:
    """``spans`` (regions in order) with each stretch of calls between them that
    holds a filter made a region of its own. Under XLA a plan's plain pieces
    that hold a filter run as regions that save everything (the runner's
    ``_filters_wait_under_xla``); replayed instead, they keep less, for a
    slower step (see docs/decisions/0054-xla-least-plans-replay-their-plain-pieces.md).

        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> from tf_checkpointing.planning.layer_graph._blocks import plain_filters_replayed
        >>> x = keras.Input((8, 8, 3))
        >>> h = keras.layers.Conv2D(4, 3)(x)
        >>> h = keras.layers.ReLU()(keras.layers.Conv2D(4, 3)(h))
        >>> model = keras.Model(x, keras.layers.Dense(2)(keras.layers.Flatten()(h)))
        >>> plain_filters_replayed(read_graph(model), ((1, 3, ()),))
        ((0, 1, ()), (1, 3, ()))
    """
    out, at = [], 0
    for start, stop, inner in (*spans, (len(graph.calls), len(graph.calls), ())):
        if start > at and holds_filter(graph, at, start):
            out.append((at, start, ()))
        if start < stop:
            out.append((start, stop, inner))
        at = stop
    return tuple(out)


def named_block_spans(graph: LayerGraph) -> tuple:
    """The model's blocks by layer name, each as a region: what a user selects
    with a layer-name prefix such as ``conv2_block1_`` or
    ``convnext_tiny_stage_0_block_0_``, from its first call to its last (a
    region leaves out a residual ``Add`` or a downsampling layer that Keras
    names otherwise). A name's block is its prefix up to its ``k``-th numbered
    part (``conv2``, then ``conv2_block1``), with ``k`` the level whose blocks
    are about as many as the model's residual pieces (:func:`segment_spans`);
    a block has at least two calls. () when there are fewer than two blocks.

        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> from tf_checkpointing.planning.layer_graph._blocks import named_block_spans
        >>> x = keras.Input((4,))
        >>> h = x
        >>> for k in range(3):
        ...     y = keras.layers.Dense(4, name=f"block{k}_in")(h)
        ...     y = keras.layers.Dense(4, name=f"block{k}_out")(y)
        ...     h = keras.layers.Add(name=f"add_{k}")([h, y])
        >>> named_block_spans(read_graph(keras.Model(x, keras.layers.Dense(1)(h))))
        ((0, 2, ()), (3, 5, ()), (6, 8, ()))
    """
    pieces = len(segment_spans(graph))
    if not pieces:
        return ()
    names = [call.name for call in graph.calls]
    levels = [_blocks_at_level(names, level) for level in range(1, _MAX_NAME_LEVELS + 1)]
    levels = [spans for spans in levels if len(spans) >= 2]
    return min(levels, key=lambda spans: abs(len(spans) - pieces), default=())


def _blocks_at_level(names: list[str], level: int) -> tuple:
    """The spans of the calls whose names share their prefix up to the
    ``level``-th ``_``-separated part that ends in a digit (not the name's last
    part), in run order, each of at least two calls, none overlapping the one
    before."""
    found: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        parts = name.split("_")
        numbered = [k for k, part in enumerate(parts[:-1]) if part[-1:].isdigit()]
        if len(numbered) >= level:
            found.setdefault("_".join(parts[:numbered[level - 1] + 1]), []).append(i)
    spans: list[tuple] = []
    for calls in sorted(found.values()):
        if len(calls) >= 2 and (not spans or calls[0] >= spans[-1][1]):
            spans.append((calls[0], calls[-1] + 1, ()))
    return tuple(spans)


def _is_floating(tensor: Any) -> bool:
    return "float" in str(getattr(tensor, "dtype", "float"))


def inner_block_choices(graph: LayerGraph) -> list[tuple[BlockRef, ...]]:
    """Per repeated block class found inside the graph's calls (the most
    frequent first, at most three), every instance of it that is not inside
    another, as ``(call index, sublayer index)`` pairs: what
    ``apply_checkpointing(model, [Block])`` checkpoints there. A class counts
    when it has weights, is not one of Keras' own, and has at least two
    instances inside the calls, none of which is a call of the graph itself.

        >>> import keras
        >>> from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
        >>> from tf_checkpointing.planning.layer_graph._blocks import inner_block_choices
        >>> class Block(keras.layers.Dense): pass
        >>> class Stack(keras.layers.Layer):
        ...     def __init__(self, **kwargs):
        ...         super().__init__(**kwargs)
        ...         self.blocks = [Block(4) for _ in range(3)]
        ...     def call(self, x):
        ...         for block in self.blocks:
        ...             x = block(x)
        ...         return x
        >>> x = keras.Input((4,))
        >>> model = keras.Model(x, keras.layers.Dense(1)(Stack()(x)))
        >>> inner_block_choices(read_graph(model))
        [((0, 0), (0, 1), (0, 2))]
    """
    in_graph = {id(call.layer) for call in graph.calls}
    found: dict[type, list[BlockRef]] = {}
    inside: dict[type, set[int]] = {}  # ids of the layers inside each class's instances
    for i, call in enumerate(graph.calls):
        for k, layer in enumerate(sublayers(call.layer)):
            if _is_block(layer) and id(layer) not in in_graph:
                found.setdefault(type(layer), []).append((i, k))
                inside.setdefault(type(layer), set()).update(id(s) for s in sublayers(layer))
    choices = []
    for cls, refs in sorted(found.items(), key=lambda item: -len(item[1])):
        outermost = [(i, k) for i, k in refs
                     if id(sublayers(graph.calls[i].layer)[k]) not in inside[cls]]
        if len(outermost) >= 2:
            choices.append(tuple(outermost))
    return choices[:_MAX_CLASSES]


def block_layers(graph: LayerGraph, refs: tuple[BlockRef, ...]) -> list[Any]:
    """The sublayers ``refs`` name (see :func:`inner_block_choices`)."""
    by_call: dict[int, list[Any]] = {}
    return [by_call.setdefault(i, sublayers(graph.calls[i].layer))[k] for i, k in refs]


def candidate_layers(graph: LayerGraph) -> list[Any]:
    """Every block of every selection :func:`inner_block_choices` offers."""
    refs = sorted({ref for choice in inner_block_choices(graph) for ref in choice})
    return block_layers(graph, tuple(refs))
