"""Flattening the arguments and outputs of a checkpointed call to tensors.

A checkpointed call can only pass gradients to the tensors it sees. ``tf.nest``
sees lists, tuples, dicts, namedtuples and ``attrs`` classes; two common kinds
of value hide tensors from it, and each used to lose gradients silently:

* composite tensors (``tf.RaggedTensor``, ``tf.SparseTensor``,
  ``tf.IndexedSlices``, ``tf.experimental.ExtensionType``) are opaque leaves
  unless flattened with ``expand_composites=True``; we expand them to their
  component tensors, so their float values get exact gradients. Variables are
  composite tensors too, but are kept whole (the function must receive the
  variable, not its handle);
* a ``tf.TensorArray`` inside a graph is its ``flow`` tensor (a variant that
  carries gradients); it is expanded to it and rebuilt around the new flow.
  (An eager TensorArray keeps Python lists of tensors: it cannot be expanded,
  and a call that uses it gets the capture guard's error naming it);
* ``dataclasses.dataclass`` instances (which neither ``tf.nest`` nor
  ``keras.tree`` flatten): we flatten their fields and rebuild a copy with the
  new values.

Any other object that holds floating tensors in its attributes cannot be seen
into; returned from a checkpointed call it would cut the gradient, so
:func:`refuse_opaque_outputs` raises an error naming its type and the fix.

An output that the call also used to compute its other outputs (``h`` and
``y = f(h)``) is, for the outer tape, independent of them: gradients with
respect to the call's inputs and variables are exact, but
``tape.gradient(loss, h)`` would miss the path through ``y``.
:func:`refuse_chained_outputs` raises in the check mode and warns (once per
function) otherwise. The same holds for a loss a layer adds inside the call
from an output it returns (an ``activity_regularizer`` on the block's last
layer): the call returns the loss as an output too (``_losses``), so the message
names it and the fixes that keep it outside the call.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Optional

import tensorflow as tf

from tf_checkpointing.core._errors import ChainedOutputWarning
from tf_checkpointing.core._internals import tensor_array_ops
from tf_checkpointing.core._losses import returned_as_loss

__all__: list[str] = []

# Composite tensors expanded to their components. Not every CompositeTensor:
# a tf.Variable, a tf.data.Dataset or an iterator must reach the function whole.
_EXPANDED = (tf.RaggedTensor, tf.SparseTensor, tf.IndexedSlices, tf.experimental.ExtensionType)


def _is_dataclass_instance(leaf: Any) -> bool:
    return dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)


def _dataclass_fields(leaf: Any) -> dict[str, Any]:
    return {field.name: getattr(leaf, field.name) for field in dataclasses.fields(leaf)}


def is_differentiable(leaf: Any) -> bool:
    """A floating (or complex) tensor: the leaves that get gradients."""
    return isinstance(leaf, tf.Tensor) and (leaf.dtype.is_floating or leaf.dtype.is_complex)


def own_gradient(leaf: Any) -> Any:
    """``leaf`` through a reshape to its own shape, which shares its buffer and
    whose gradient is a new tensor: read by a replay or a measured call, each
    input gets a gradient tensor of its own. Where two sources of one
    ``tape.gradient`` would get the same one (an ``Add`` passes its output
    gradient to both inputs), TensorFlow's tape keeps a reference too many to it,
    and with it the graph it was traced in (see docs/decisions/0042-shared-gradients.md).
    Anything not differentiable is returned unchanged.

        >>> import tensorflow as tf
        >>> from tf_checkpointing.core._structure import own_gradient
        >>> own_gradient(tf.ones([2, 3])).shape
        TensorShape([2, 3])
    """
    if not is_differentiable(leaf):
        return leaf
    shape = leaf.shape if leaf.shape.is_fully_defined() else tf.shape(leaf)
    return tf.reshape(leaf, shape)


def _is_graph_tensor_array(leaf: Any) -> bool:
    return isinstance(leaf, tf.TensorArray) and not tf.executing_eagerly()


class Flattened:
    """``structure`` as a flat list of leaves (tensors and other values), and
    the way back: ``pack(leaves)`` rebuilds the structure around new leaves.
    ``differentiable`` lists the positions of the leaves that get gradients."""

    def __init__(self, structure: Any) -> None:
        self.structure = structure
        outer = tf.nest.flatten(structure)
        self._parts: list[tuple[Any, Any, int]] | None = None
        flows: set[int] = set()
        if not any(isinstance(leaf, _EXPANDED) or _is_dataclass_instance(leaf)
                   or _is_graph_tensor_array(leaf) for leaf in outer):
            self.leaves = outer  # the common case: tf.nest sees everything
            self.differentiable = [i for i, x in enumerate(outer) if is_differentiable(x)]
            return
        self._parts, self.leaves = [], []
        for leaf in outer:
            if _is_graph_tensor_array(leaf):
                flows.add(len(self.leaves))
                inner: Any = [leaf.flow]
            elif isinstance(leaf, _EXPANDED):
                inner = tf.nest.flatten(leaf, expand_composites=True)
            elif _is_dataclass_instance(leaf):
                inner = Flattened(_dataclass_fields(leaf))
            else:
                inner = None
            parts = [leaf] if inner is None else getattr(inner, "leaves", inner)
            if isinstance(inner, Flattened):
                flows.update(len(self.leaves) + i for i in inner.differentiable
                             if not is_differentiable(inner.leaves[i]))
            self._parts.append((leaf, inner, len(parts)))
            self.leaves.extend(parts)
        self.differentiable = [i for i, x in enumerate(self.leaves)
                               if i in flows or is_differentiable(x)]

    def pack(self, leaves: Sequence[Any]) -> Any:
        if self._parts is None:
            return tf.nest.pack_sequence_as(self.structure, list(leaves))
        outer, start = [], 0
        for leaf, inner, count in self._parts:
            part = list(leaves[start:start + count])
            start += count
            if isinstance(inner, Flattened):
                outer.append(_rebuilt_dataclass(leaf, inner.pack(part)))
            elif _is_graph_tensor_array(leaf):
                outer.append(tensor_array_ops.build_ta_with_new_flow(leaf, part[0]))
            elif inner is not None:
                outer.append(tf.nest.pack_sequence_as(leaf, part, expand_composites=True))
            else:
                outer.append(part[0])
        return tf.nest.pack_sequence_as(self.structure, outer)


def _rebuilt_dataclass(template: Any, fields: dict[str, Any]) -> Any:
    """A shallow copy of ``template`` with new field values (also for frozen
    dataclasses and fields with ``init=False``, which ``dataclasses.replace``
    refuses)."""
    rebuilt = copy.copy(template)
    for name, value in fields.items():
        object.__setattr__(rebuilt, name, value)
    return rebuilt


def refuse_opaque_outputs(name: str, leaves: Sequence[Any]) -> None:
    """Raises if an output leaf is an object that holds floating tensors in its
    attributes: their gradients would be silently lost."""
    for leaf in leaves:
        if isinstance(leaf, (tf.Tensor, tf.Variable, str, bytes, int, float, bool)) \
                or leaf is None:
            continue
        attributes = getattr(leaf, "__dict__", None)
        if not isinstance(attributes, dict):
            continue
        held = [key for key, value in attributes.items() if _holds_float_tensor(value)]
        if held:
            kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
            raise TypeError(
                f"checkpointable: `{name}` returned an object of type {kind} that holds "
                f"tensors in its attributes {held}. A checkpointed call passes gradients "
                "only through the tensors it can see, so these would get none. Return "
                "the tensors in a tuple, list, dict, namedtuple, dataclass or attrs class "
                "(or make the type a tf.experimental.ExtensionType), or call it with "
                "_checkpoint=False."
            )


def _holds_float_tensor(value: Any) -> bool:
    if isinstance(value, tf.Variable):
        return False  # a layer or a module: its variables get gradients anyway
    return any(isinstance(t, tf.Tensor) and (t.dtype.is_floating or t.dtype.is_complex)
               for t in tf.nest.flatten(value, expand_composites=False))


_warned_chained: set[str] = set()
# dtypes whose tensors never carry a gradient (an op with only such outputs, as
# argmax, a cast to int, tf.shape or a comparison, ends every gradient path).
_NO_GRADIENT_KINDS = ("is_integer", "is_bool")


def may_carry_gradient(tensor: Any) -> bool:
    """Whether a gradient can flow through ``tensor``: anything but an integer,
    bool or string tensor. Conservative: a variant (a TensorList, a graph
    TensorArray's list) or a resource counts, as they can hold floats."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return True  # not a tensor we know: assume it can
    dtype = tf.as_dtype(dtype)
    return not (any(getattr(dtype, kind) for kind in _NO_GRADIENT_KINDS)
                or dtype == tf.string)


def _key(tensor: Any) -> Optional[int]:
    """A tensor's unique id: ``Tensor._id`` is never reused (unlike ``id()`` of a
    freed eager tensor), unique among the tensors of one graph, and holds no
    reference to the tensor. None if it has none."""
    key = getattr(tensor, "_id", None)
    return key if isinstance(key, int) else None


# Stands for "any tensor": an op output with no _id is assumed to reach every output.
_ANY = -1


class Consumed(dict):
    """What the ops of a call consumed, recorded by the capture guard.

    As a dict: ``{id(tensor): weakref}`` for every tensor an op consumed (the
    weak reference tells a reused id apart and keeps no activation alive).
    ``feeds`` is the data flow: for each consumed tensor's key, the keys of the
    outputs of its consumers through which a gradient can flow; an op whose
    outputs are all integers or bools (``argmax`` and the float ``where`` feeding
    it, casts to int) adds none, so no path is seen through it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.feeds: dict[Optional[int], set[int]] = {}

    def record(self, inputs: Sequence[Any], outputs: Sequence[Any]) -> None:
        """Notes one op (call it only for ops with an output that
        :func:`may_carry_gradient`)."""
        self.update((id(t), weakref.ref(t)) for t in inputs)
        keys: set[int] = set()
        for t in outputs:
            if may_carry_gradient(t):
                key = _key(t)
                keys.add(_ANY if key is None else key)
        for tensor in inputs:
            self.feeds.setdefault(_key(tensor), set()).update(keys)

    def reaches(self, tensor: Any, targets: set[int]) -> bool:
        """Whether a gradient path leads from ``tensor`` to one of ``targets``
        (keys) through the ops recorded. Conservative where unsure: a tensor
        with no key, or an output with none, reaches everything."""
        start = _key(tensor)
        if start is None:
            return True
        seen, todo = {start}, [start]
        while todo:
            for key in self.feeds.get(todo.pop(), ()):
                if key == _ANY or key in targets:
                    return True
                if key not in seen:
                    seen.add(key)
                    todo.append(key)
        return False


def _alive(ref: Any) -> Any:
    return None if ref is None else ref()


def refuse_chained_outputs(name: str, leaves: Sequence[Any], positions: Sequence[int],
                           consumed: Optional[dict[int, Any]], strict: bool) -> None:
    """Raises (``strict``) or warns once if a differentiable output also feeds
    another output of the call through a path a gradient can take.

    An output consumed only by ops with integer or bool outputs (``argmax``,
    a cast to int) feeds nothing a gradient could miss, so it is not flagged.
    The other outputs are all of them, also those of ``positions`` that only
    the caller reads: for the outer tape every output is independent of the
    rest. Without the data flow (``consumed`` a plain dict), any consumer counts.
    """
    if not consumed:
        return
    chained = [i for i in positions if _alive(consumed.get(id(leaves[i]))) is leaves[i]]
    to_losses_only = False
    if isinstance(consumed, Consumed) and chained:
        keys = {key for leaf in leaves
                if isinstance(leaf, tf.Tensor) and may_carry_gradient(leaf)
                and (key := _key(leaf)) is not None}
        chained = [i for i in chained
                   if consumed.reaches(leaves[i], keys - {_key(leaves[i])})]
        # Why tell them apart: the caller returned none of those losses, so "its
        # other outputs" would name nothing it wrote, and the fixes differ.
        own = {_key(leaf) for leaf in leaves if not returned_as_loss(leaf)}
        to_losses_only = bool(chained) and not any(
            consumed.reaches(leaves[i], (keys & own) - {_key(leaves[i])}) for i in chained)
    if not chained or (not strict and name in _warned_chained):
        return
    message = (_to_losses_message if to_losses_only else _chained_message)(name, chained)
    if strict:
        raise ValueError(message)
    _warned_chained.add(name)
    warnings.warn(message, ChainedOutputWarning, stacklevel=2)


def _chained_message(name: str, chained: list[int]) -> str:
    return (
        f"checkpointable: `{name}` returns differentiable output(s) {chained} (positions in "
        "the flattened output) that it also uses to compute its other outputs. For the "
        "outer tape the outputs of a checkpointed call are independent, so "
        "tape.gradient(loss, output) for such an output would miss the path through the "
        "outputs computed from it "
        "(gradients with respect to the call's inputs and variables are exact). Return "
        "only the final outputs, split the block into two checkpointed calls (the second "
        "taking that output as an argument), or call it with _checkpoint=False. "
        + _SILENCE
    )


def _to_losses_message(name: str, chained: list[int]) -> str:
    return (
        f"checkpointable: `{name}` returns differentiable output(s) {chained} (positions "
        "in the flattened output) from which a layer inside it computed a loss it added "
        "(an activity_regularizer, add_loss). The call returns that loss as an output "
        "too, so that it gets its gradient, and for the outer tape the outputs of a "
        "checkpointed call are independent, so tape.gradient(loss, output) for such an "
        "output would miss the path through the added loss (gradients with respect to "
        "the call's inputs and variables, model.losses included, are exact). Have the "
        "loss added outside the checkpointed call: checkpointable(layer) on that layer "
        "(Keras adds its activity regularizer's loss outside the checkpointed call), or "
        "call that layer after the checkpointed call; or call it with "
        "_checkpoint=False. " + _SILENCE
    )


_SILENCE = (
    "If you never take a gradient with respect to that output, nothing is wrong: silence "
    "this with warnings.filterwarnings('ignore', "
    "category=tf_checkpointing.debug.ChainedOutputWarning)."
)
