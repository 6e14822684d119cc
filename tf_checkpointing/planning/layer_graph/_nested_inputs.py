"""The inputs of a nested model expanded into its layers, converted as Keras would.

Expanded (:mod:`._layer_graph`), a nested model's ``__call__`` and ``Functional.call`` do
not run, and they convert its inputs before its layers read them. Each layer call
reading such an input carries the conversions (:class:`NestedInput`) that
:func:`~tf_checkpointing.planning.layer_graph._layer_graph.run_call` applies, and a nested model
whose conversion done per reader would differ from Keras' (:func:`converted_alike`)
is kept as one call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from tf_checkpointing.core._internals import (
    KerasTensor,
    SymbolicArguments,
    get_keras_mask,
    is_float_dtype,
    set_keras_mask,
    standardize_dtype,
)

__all__: list[str] = []


@dataclasses.dataclass(frozen=True, eq=False)  # by identity: == on a KerasTensor is an op
class NestedInput:
    """What Keras' call of a nested model does to one of its inputs before its
    layers read it, done again where it is expanded.

    Why: expanded, the nested model's ``__call__`` and ``Functional.call`` do
    not run, and they convert its inputs (``Layer.__call__`` casts float ones to
    ``input_dtype``, a Sequential's being its ``keras.Input``'s; then
    ``Functional._standardize_inputs`` casts each to its ``keras.Input``'s dtype
    and adds or drops a last axis of size one). Without that, a uint8 image fed to
    a float32 backbone reached its ``Lambda(lambda x: x / 127.5 - 1)`` as uint8 (a
    TypeError), and under mixed precision a float16 activation reached a layer that
    does not autocast as float16, where Keras gives it float32 (the
    ``keras.Input`` of any policy). A conversion that changes nothing returns the
    same tensor: no op.

    Attributes:
        model: the nested model as the outer graph calls it.
        tensor: its ``keras.Input`` (KerasTensor) this value enters as.
    """

    model: Any
    tensor: Any

    def __call__(self, value: Any) -> Any:
        """``value`` as the nested model's layers get it from Keras."""
        if value is None:
            return value
        mask = get_keras_mask(value)
        if getattr(self.model, "_convert_input_args", False):
            value = self.model.dtype_policy.convert_input(value, self.model.autocast,
                                                          self.model.input_dtype)
        value = keras.ops.convert_to_tensor(value, dtype=self.tensor.dtype,
                                            sparse=self.tensor.sparse)
        rank, expected = len(value.shape), self.tensor.shape
        if rank == len(expected) + 1 and value.shape[-1] == 1:
            value = keras.ops.squeeze(value, axis=-1)
        elif rank == len(expected) - 1 and expected[-1] == 1:
            value = keras.ops.expand_dims(value, axis=-1)
        if mask is not None:
            set_keras_mask(value, mask)
        return value

    def dtypes(self, dtype: str) -> tuple[str, str]:
        """The dtypes :meth:`__call__` takes a value of ``dtype`` through: the
        model's autocast's, then its ``keras.Input``'s."""
        if (getattr(self.model, "_convert_input_args", False) and self.model.autocast
                and is_float_dtype(dtype)):
            dtype = standardize_dtype(self.model.input_dtype)
        return dtype, standardize_dtype(self.tensor.dtype)


# For an input KerasTensor of an expanded model: the KerasTensor of the value
# fed to it from outside (where it was made), and the conversions on the way.
Entering = tuple[Any, tuple[NestedInput, ...]]


def as_fed(arguments: Any, entering: dict[int, Entering]) -> Any:
    """``arguments`` with each input KerasTensor of an expanded model replaced by
    a copy of the one of the value fed to it (as Keras recorded it outside).

    Why: the planner traces a call on its recorded arguments (which of them its
    backward keeps); recorded so, the trace runs on the value the call is given and
    its conversion. A copy: two inputs fed the same tensor stay two arguments."""
    copies = {}
    for t in arguments.keras_tensors:
        if id(t) in entering:
            source = entering[id(t)][0]
            copies[id(t)] = KerasTensor(source.shape, dtype=source.dtype, sparse=source.sparse,
                                        ragged=source.ragged, record_history=False)
    args, kwargs = arguments.convert(
        lambda v: copies.get(id(v), v) if isinstance(v, KerasTensor) else v)
    return SymbolicArguments(*args, **kwargs)


def converted_alike(node: Any, inner: Any, fed: list[Entering]) -> bool:
    """Whether converting each input of ``inner`` in each layer call that reads
    it (:class:`NestedInput`, in :func:`run_call`) gives the values and gradients
    of Keras' call, which converts it once for all its readers.

    The values are the same. The gradients too when an input is read once, or
    when its conversion casts no float (an int input has no gradient; a rank
    adjusted by a reshape, or no conversion, changes none). A float cast read
    twice is not: Keras sums the readers' gradients at the cast dtype and casts
    the sum back, converted per reader each gradient is cast back and they are
    summed at the given dtype (a float64 input read by two float32 layers: 997 of
    1000 gradient elements differed in their last bits). Such a model is kept as
    one call, and so is one that returns an input converted (the outer graph would
    read it unconverted) or that changes its sparseness (not converted here).
    Judged from the recorded KerasTensors; a layer recorded at another dtype than
    it returns (a ``Lambda`` that casts to int32 is recorded at float32) is still
    converted exactly, where it has one reader.
    """
    reads: dict[int, int] = {}
    for nodes in inner._nodes_by_depth.values():  # noqa: SLF001
        for inner_node in nodes:
            if inner_node.operation and not inner_node.is_input:
                for t in inner_node.arguments.keras_tensors:
                    reads[id(t)] = reads.get(id(t), 0) + 1
    outputs = {id(t) for t in inner.outputs}
    for (source, steps), expected in zip(fed, inner.inputs):
        if source.sparse != expected.sparse or source.ragged != expected.ragged:
            return False
        dtypes = [standardize_dtype(source.dtype)]
        for step in (*steps, NestedInput(node.operation, expected)):
            dtypes.extend(step.dtypes(dtypes[-1]))
        cast = len(set(dtypes)) > 1
        if id(expected) in outputs and (cast or len(source.shape) != len(expected.shape)):
            return False
        if reads.get(id(expected), 0) > 1 and is_float_dtype(dtypes[0]) and cast:
            return False
    return True
