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
(:class:`._nested_inputs.NestedInput`). The planner
(:mod:`tf_checkpointing.planning.solving._model_planner`) and the runner
(:mod:`tf_checkpointing._graph_runner`) both work on this list.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

import keras
import tensorflow as tf

from tf_checkpointing.core._internals import operation_fn as _operation_fn
from tf_checkpointing.planning._errors import PlanningValueError
from tf_checkpointing.planning.layer_graph._nested_inputs import (
    Entering,
    NestedInput,
    as_fed,
    converted_alike,
)
from tf_checkpointing.planning.measuring._profile import configuration, layer_key

__all__: list[str] = []

Key = tuple[int, int]


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
        defaults: call-context values (``training``) that reach the layer when the
            model's own call gives None: the ``training=`` an expanded model was
            called with in the graph (Keras' ``operation_fn`` lets a given
            ``training`` of the outer call override it, as here).
    """

    name: str
    layer: Any
    arguments: Any
    arg_keys: tuple[Key, ...]
    out_keys: tuple[Key, ...]
    entering: tuple[tuple[NestedInput, ...], ...] = ()
    defaults: tuple[tuple[str, Any], ...] = ()

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

    def kinds(self) -> tuple[str, ...]:
        """Per call, what it computes whatever the layers are named: its layer's
        class and configuration (but the name), the arguments that are not
        tensors (``h[:, :64]``'s index, ``use_causal_mask=True``), and the calls
        (or model inputs, by position) whose outputs it reads, by position."""
        made = self.producers()
        made.update({key: -1 - i for i, key in enumerate(self.input_keys)})
        outputs = {key: j for call in self.calls for j, key in enumerate(call.out_keys)}
        return tuple(repr((layer_key(call.layer, dict(call.defaults)),
                           [(made.get(k), outputs.get(k, 0)) for k in call.arg_keys],
                           *_non_tensor_arguments(call)))
                     for call in self.calls)


def argument_pattern(call: GraphCall) -> Any:
    """The call's arguments with each tensor as "T": what, besides its layer and
    shapes, tells one call's computation from another's (``h[:, :64]``'s index)."""
    return call.arguments.convert(lambda v: "T" if hasattr(v, "shape") else v)


def _non_tensor_arguments(call: GraphCall) -> tuple[Any, ...]:
    """``argument_pattern(call)`` when any argument is not a tensor (else nothing:
    the kinds of calls on tensors alone read as they always did)."""
    arguments = argument_pattern(call)
    leaves = tf.nest.flatten(arguments)
    return (arguments,) if any(not (isinstance(v, str) and v == "T") for v in leaves) else ()


def functional_of(model: Any) -> Any:
    """The ``Functional`` that runs ``model``: itself, a Sequential's inner one,
    or None for a model whose graph is not recorded (subclassed, unbuilt)."""
    if isinstance(model, keras.Sequential):
        return getattr(model, "_functional", None)
    if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth") and hasattr(
            model, "_run_through_graph"):
        return model
    return None


def read_graph(model: Any) -> LayerGraph:
    """The flattened layer graph of ``model``, or a clear error when it has none
    (a ``PlanningValueError``: the API called names itself)."""
    functional = functional_of(model)
    if functional is None:
        kind = "keras.Sequential without an input shape" if isinstance(
            model, keras.Sequential) else f"{type(model).__name__} (a subclassed model)"
        raise PlanningValueError(
            f"planning a whole model needs its layer graph, but `{model.name}` "
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


def _flatten_into(functional: Any, scope: int, aliases: dict[int, Key],
                  calls: list[GraphCall], scopes: Any,
                  entering: Optional[dict[int, Entering]] = None,
                  defaults: tuple[tuple[str, Any], ...] = ()) -> list[Key]:
    """Appends ``functional``'s calls; returns the keys of its outputs.
    ``aliases`` maps ids of its input KerasTensors to the outer keys they take,
    ``entering`` to what Keras' calls would do to them first, and ``defaults``
    are the call-context values of its calls (see :class:`GraphCall`)."""
    entering = entering or {}

    def key_of(tensor: Any) -> Key:
        return aliases.get(id(tensor), (scope, id(tensor)))

    def fed(tensor: Any) -> Entering:
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
                # `base(x, training=False)`: the first given value, from the outside
                # in, is the one Keras' nested calls pass on.
                given = _given(node)
                inner_defaults = defaults if any(k == "training" for k, _ in defaults) or (
                    "training" not in given) else (*defaults, ("training", given["training"]))
                outs = _flatten_into(inner, inner_scope, inner_aliases, calls, scopes,
                                     inner_entering, inner_defaults)
                # The outer node's outputs are the inner model's outputs.
                for tensor, key in zip(node.outputs, outs):
                    aliases[id(tensor)] = key
                continue
            arguments = node.arguments
            conversions: tuple[tuple[NestedInput, ...], ...] = ()
            if any(id(t) in entering for t in arguments.keras_tensors):
                arguments = as_fed(arguments, entering)
                conversions = tuple(fed(t)[1] for t in node.arguments.keras_tensors)
            calls.append(GraphCall(
                name=node.operation.name, layer=node.operation, arguments=arguments,
                arg_keys=arg_keys, out_keys=tuple(key_of(t) for t in node.outputs),
                entering=conversions, defaults=defaults))
    return [key_of(t) for t in functional.outputs]


def _given(node: Any) -> dict[str, Any]:
    """The keywords of a nested model's recorded call that were given: Keras
    records ``mask=None`` (a dict of Nones for dict inputs) when none was."""
    return {k: v for k, v in node.arguments.kwargs.items()
            if any(leaf is not None for leaf in keras.tree.flatten(v))}


def _expandable(node: Any, inner: Any, fed: list[Entering]) -> bool:
    """A nested model called on one positional argument holding exactly its
    inputs, in a list/tuple, alone, or in a dict with its inputs' names (Keras
    then matches them by name, and flattens both in key order), with no keyword
    but a Python ``training=`` (the fine-tuning form ``base(x, training=False)``;
    a ``mask=`` given there would differ from the outer call's), whose ``call``
    is Keras' own, and whose input conversions are exact when done by each
    reader (:func:`._nested_inputs.converted_alike`; ``fed``: what reaches each
    input). A backbone called either way was one call: no region inside it,
    and a least plan barely below plain (see docs/decisions/0020-nested-models.md)."""
    args = node.arguments.args
    kwargs = _given(node)
    if len(args) != 1 or set(kwargs) - {"training"} or not isinstance(
            kwargs.get("training", False), bool):
        return False
    if isinstance(args[0], dict) and not (
            isinstance(getattr(inner, "_inputs_struct", None), dict)
            and set(inner._inputs_struct) == set(args[0])):  # noqa: SLF001
        return False
    if "call" in vars(node.operation) or "call" in vars(inner):
        return False  # patched (checkpointed) already: run it as it is
    flat = keras.tree.flatten(args[0])
    return (len(flat) == len(inner.inputs) == len(node.arguments.keras_tensors)
            and len(node.outputs) == len(inner.outputs)
            and converted_alike(node, inner, fed))


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
    for name, value in call.defaults:
        if context.get(name) is None:
            context = {**context, name: value}
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
        config, key = configuration(call.layer), repr(("unique", i))
        if config is not None:  # without one: profiled on its own
            try:
                shapes = [(tuple(t.shape), str(t.dtype)) for t in call.arguments.keras_tensors]
                key = repr((type(call.layer), config, shapes, argument_pattern(call),
                            [tuple(w.shape) for w in call.layer.weights]))
            except Exception:  # noqa: BLE001 - arguments it cannot describe: on its own
                pass
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
