"""The layer graph of a Keras model, as one flat list of calls in run order.

A functional model (and a ``keras.Sequential`` built with an input) records
every layer call as a ``Node`` of its graph (``keras/src/ops/function.py``):
the layer, its symbolic arguments, its symbolic outputs. :func:`read_graph`
lists those nodes in the order ``Functional._run_through_graph`` runs them
(deepest first), and replaces each functional model nested as a layer by its
own nodes, so that a region may start or end inside it. Tensors are named by
keys (``(scope, id(keras_tensor))``: a nested model called twice gets two
scopes), and each call knows which keys it reads and writes. A layer reading
an input of an expanded model converts it as Keras' call of that model would
(:class:`NestedInput`). The planner
(:mod:`tf_checkpointing.planning._model`) and the runner
(:mod:`tf_checkpointing._graph_runner`) both work on this list.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

import keras
from keras.src.backend import KerasTensor, is_float_dtype, standardize_dtype
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask
from keras.src.models.functional import operation_fn as _operation_fn
from keras.src.ops.symbolic_arguments import SymbolicArguments

__all__: list[str] = []

Key = tuple[int, int]


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


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One layer call of the flattened graph.

    Attributes:
        name: the layer's name.
        layer: the layer (a Keras ``Operation``) called.
        arguments: the node's ``SymbolicArguments`` (args and kwargs with
            KerasTensors in them; an input of an expanded model stands there as a
            copy of the KerasTensor fed to it, the dtype the call is given).
        arg_keys: for each KerasTensor of ``arguments.keras_tensors``, the key
            of the value it stands for.
        out_keys: the keys of its outputs, in ``tree.flatten`` order.
        entering: for each KerasTensor of ``arguments.keras_tensors``, the
            :class:`NestedInput` conversions the value of its key goes through
            first (the input of an expanded model, outermost first); empty for all:
            none.
    """

    name: str
    layer: Any
    arguments: Any
    arg_keys: tuple[Key, ...]
    out_keys: tuple[Key, ...]
    entering: tuple[tuple[NestedInput, ...], ...] = ()

    @property
    def in_keys(self) -> tuple[Key, ...]:
        return tuple(dict.fromkeys(self.arg_keys))


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """A model's graph: ``calls`` in run order, from ``input_keys`` (one per
    flat model input) to ``output_keys`` (one per flat model output)."""

    model: Any
    calls: tuple[GraphCall, ...]
    input_keys: tuple[Key, ...]
    output_keys: tuple[Key, ...]

    def model_inputs(self, inputs: Any) -> list[Any]:
        """``inputs`` as the flat list of values for ``input_keys``, as Keras'
        own ``Functional.call`` standardizes them (structure, dtypes)."""
        return list(functional_of(self.model)._standardize_inputs(inputs))  # noqa: SLF001

    def consumers(self) -> dict[Key, list[int]]:
        """For each key, the indices of the calls that read it, in order."""
        readers: dict[Key, list[int]] = {}
        for i, call in enumerate(self.calls):
            for key in call.in_keys:
                readers.setdefault(key, []).append(i)
        return readers

    def producers(self) -> dict[Key, int]:
        """For each key, the index of the call that writes it (-1: a model input)."""
        made = {key: -1 for key in self.input_keys}
        for i, call in enumerate(self.calls):
            for key in call.out_keys:
                made[key] = i
        return made


def functional_of(model: Any) -> Any:
    """The ``Functional`` that runs ``model``: itself, a Sequential's inner one,
    or None for a model whose graph is not recorded (subclassed, unbuilt)."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth") and hasattr(
            model, "_run_through_graph"):
        return model
    return None


def read_graph(model: Any, api: str) -> LayerGraph:
    """The flattened layer graph of ``model``, or a clear error when it has none."""
    functional = functional_of(model)
    if functional is None:
        kind = "keras.Sequential without an input shape" if isinstance(
            model, keras.Sequential) else f"{type(model).__name__} (a subclassed model)"
        raise ValueError(
            f"{api}: planning a whole model needs its layer graph, but `{model.name}` "
            f"is a {kind}, whose graph Keras does not record; received model={model!r}. "
            "Build it with the functional API or keras.Sequential([keras.Input(...), "
            "...]); or checkpoint chosen layers with apply_checkpointing(model, "
            "select=...), a chain of them with CheckpointedSequential(budget=...), or "
            "decorate its blocks with checkpointable."
        )
    scopes = itertools.count(1)
    input_keys = tuple((0, id(x)) for x in functional.inputs)
    calls: list[GraphCall] = []
    output_keys = _flatten_into(functional, 0, {}, calls, scopes)
    return LayerGraph(model=model, calls=tuple(calls), input_keys=input_keys,
                      output_keys=tuple(output_keys))


# For an input KerasTensor of an expanded model: the KerasTensor of the value
# fed to it from outside (where it was made), and the conversions on the way.
_Entering = tuple[Any, tuple[NestedInput, ...]]


def _flatten_into(functional: Any, scope: int, aliases: dict[int, Key],
                  calls: list[GraphCall], scopes: Any,
                  entering: Optional[dict[int, _Entering]] = None) -> list[Key]:
    """Appends ``functional``'s calls; returns the keys of its outputs.
    ``aliases`` maps ids of its input KerasTensors to the outer keys they take,
    ``entering`` to what Keras' calls would do to them first."""
    entering = entering or {}

    def key_of(tensor: Any) -> Key:
        return aliases.get(id(tensor), (scope, id(tensor)))

    def fed(tensor: Any) -> _Entering:
        return entering.get(id(tensor), (tensor, ()))

    for depth in sorted(functional._nodes_by_depth, reverse=True):  # noqa: SLF001
        for node in functional._nodes_by_depth[depth]:  # noqa: SLF001
            if not node.operation or node.is_input:
                continue
            arg_keys = tuple(key_of(t) for t in node.arguments.keras_tensors)
            inner = functional_of(node.operation)
            if inner is not None and _expandable(node, inner, [
                    fed(t) for t in node.arguments.keras_tensors]):
                inner_scope = next(scopes)
                inner_aliases = {id(x): k for x, k in zip(inner.inputs, arg_keys)}
                inner_entering = {}
                for x, t in zip(inner.inputs, node.arguments.keras_tensors):
                    source, steps = fed(t)
                    inner_entering[id(x)] = (source, (*steps, NestedInput(node.operation, x)))
                outs = _flatten_into(inner, inner_scope, inner_aliases, calls, scopes,
                                     inner_entering)
                # The outer node's outputs are the inner model's outputs.
                for tensor, key in zip(node.outputs, outs):
                    aliases[id(tensor)] = key
                continue
            arguments = node.arguments
            conversions: tuple[tuple[NestedInput, ...], ...] = ()
            if any(id(t) in entering for t in arguments.keras_tensors):
                arguments = _as_fed(arguments, entering)
                conversions = tuple(fed(t)[1] for t in node.arguments.keras_tensors)
            calls.append(GraphCall(
                name=node.operation.name, layer=node.operation, arguments=arguments,
                arg_keys=arg_keys, out_keys=tuple(key_of(t) for t in node.outputs),
                entering=conversions))
    return [key_of(t) for t in functional.outputs]


def _as_fed(arguments: Any, entering: dict[int, _Entering]) -> Any:
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


def _expandable(node: Any, inner: Any, fed: list[_Entering]) -> bool:
    """A nested model called on one positional argument holding exactly its
    inputs, in a list/tuple or alone (a dict is matched by name in Keras:
    kept as one call), with no keyword (``training=`` or ``mask=`` given
    there would differ from the outer call's), whose ``call`` is Keras' own,
    and whose input conversions are exact when done by each reader
    (:func:`_converted_alike`; ``fed``: what reaches each input)."""
    args = node.arguments.args
    # Keras records a nested model's call with ``mask=None``: no keyword given.
    kwargs = {k: v for k, v in node.arguments.kwargs.items() if v is not None}
    if len(args) != 1 or kwargs or isinstance(args[0], dict):
        return False
    if "call" in vars(node.operation) or "call" in vars(inner):
        return False  # patched (checkpointed) already: run it as it is
    flat = keras.tree.flatten(args[0])
    return (len(flat) == len(inner.inputs) == len(node.arguments.keras_tensors)
            and len(node.outputs) == len(inner.outputs)
            and _converted_alike(node, inner, fed))


def _converted_alike(node: Any, inner: Any, fed: list[_Entering]) -> bool:
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


def run_call(call: GraphCall, env: dict[Key, Any], context: dict[str, Any]) -> None:
    """Runs one call on the values in ``env`` and stores its outputs there, as
    ``Functional._run_through_graph`` does: the call-context arguments
    (``training``, ...) reach the layers that register them."""
    values = {}
    for n, (t, k) in enumerate(zip(call.arguments.keras_tensors, call.arg_keys)):
        value = env[k]
        # An expanded model's input: as Keras' call of that model would give it.
        for step in call.entering[n] if call.entering else ():
            value = step(value)
        values[id(t)] = value
    args, kwargs = call.arguments.fill_in(values)
    outputs = _operation_fn(call.layer, **context)(*args, **kwargs)
    for key, value in zip(call.out_keys, keras.tree.flatten(outputs)):
        env[key] = value


def last_uses(graph: LayerGraph) -> list[int]:
    """For each key, the index of the last call that reads it (``len(calls)`` for
    a model output), as a list aligned with :func:`tensor_keys`."""
    readers = graph.consumers()
    outputs = set(graph.output_keys)
    return [len(graph.calls) if key in outputs else max(readers.get(key, [-1]))
            for key in tensor_keys(graph)]


def tensor_keys(graph: LayerGraph) -> list[Key]:
    """Every key, in the order it is made: the inputs, then each call's outputs."""
    keys = list(dict.fromkeys(graph.input_keys))
    for call in graph.calls:
        keys.extend(call.out_keys)
    return list(dict.fromkeys(keys))


def repeated_calls(graph: LayerGraph) -> list[int]:
    """For each call, the first call that computes the same thing: the same
    layer class and configuration (but the name) on the same argument shapes."""
    first: dict[Any, int] = {}
    same_as = []
    for i, call in enumerate(graph.calls):
        try:
            config = dict(call.layer.get_config())
            config.pop("name", None)
            shapes = [(tuple(t.shape), str(t.dtype)) for t in call.arguments.keras_tensors]
            arguments = call.arguments.convert(lambda v: "T" if hasattr(v, "shape") else v)
            key = repr((type(call.layer), sorted(config.items()), shapes, arguments,
                        [tuple(w.shape) for w in call.layer.weights]))
        except Exception:  # noqa: BLE001 - no config: profiled on its own
            key = repr(("unique", i))
        same_as.append(first.setdefault(key, i))
    return same_as


def chain_break(layers: list[Any]) -> Optional[str]:
    """Why ``layers`` (e.g. ``model.layers`` of a functional model) is not a
    chain, from the graph their calls recorded; None when it may be one.

    Only layers called once in a graph are judged (a layer called elsewhere
    too may well be used as a chain here)."""
    previous = None
    for i, layer in enumerate(layers):
        nodes = getattr(layer, "_inbound_nodes", None)
        if isinstance(layer, keras.layers.InputLayer) or not nodes or len(nodes) != 1:
            previous = layer
            continue
        sources = [getattr(getattr(t, "_keras_history", None), "operation", None)
                   for t in nodes[0].arguments.keras_tensors]
        names = [getattr(s, "name", "?") for s in sources]
        if len(sources) > 1:
            return (f"layer {layer.name!r} (index {i}) takes {len(sources)} inputs, from "
                    f"{', '.join(map(repr, names))}")
        if previous is not None and sources and sources[0] is not previous:
            return (f"layer {layer.name!r} (index {i}) reads the output of {names[0]!r}, "
                    f"not of the layer before it, {previous.name!r}")
        previous = layer
    return None
