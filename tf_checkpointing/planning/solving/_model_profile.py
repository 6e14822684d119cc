"""What each call of a model's layer graph costs, measured once per model.

:func:`cached_profile` profiles the graph (:mod:`..layer_graph._layer_graph`) as a chain of
states, state ``i`` being every tensor alive before call ``i``, so that the
allocator measures each call exactly as the chain profile measures a layer
(:mod:`..measuring._profile`); the readings become the :class:`GraphCosts` the region
program (:mod:`._regions`) plans on. Profiles and the save policies' readings
are cached per model, input shapes, mode and set of frozen layers, so that
planning another budget of the same model measures nothing again.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import keras
import numpy as np
import tensorflow as tf

from tf_checkpointing.core._internals import keras_numpy_ops
from tf_checkpointing.planning._cache import registered
from tf_checkpointing.planning._constants import MODEL_CACHE_SIZE as _CACHE_SIZE
from tf_checkpointing.planning.layer_graph._frozen import backprop_calls, without_backward
from tf_checkpointing.planning.layer_graph._graph_choices import graph_choices
from tf_checkpointing.planning.layer_graph._layer_graph import (
    LayerGraph,
    last_uses,
    repeated_calls,
    run_call,
    tensor_keys,
)
from tf_checkpointing.planning.layer_graph._saved_tensors import keys_read, saved_tensors
from tf_checkpointing.planning.measuring._allocator import in_fresh_thread
from tf_checkpointing.planning.measuring._choices import PolicyChoices
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile
from tf_checkpointing.planning.measuring._modes import Mode
from tf_checkpointing.planning.measuring._profile import profile_chain
from tf_checkpointing.planning.measuring._whole_step import StepReading
from tf_checkpointing.planning.solving._regions import GraphCosts, RegionModel
from tf_checkpointing.planning.solving._xla import fit_sources, forget_model_anchor

__all__: list[str] = []

_profiles: dict[Any, tuple[Any, ChainProfile, GraphCosts]] = registered({})
_choices: dict[Any, tuple[Any, PolicyChoices]] = registered({})
# Measured steps of plans of a profiled model, per (profile key, plan): another budget
# of the same model measures a plan once.
_plan_peaks: dict[tuple[Any, Any], StepReading] = registered({})


def measured_step(key: Any, plan: Any, measure: Callable[[], StepReading]) -> StepReading:
    """The peak and time of ``plan``'s step on the model of profile ``key``:
    ``measure()`` the first time, then what it gave (until the profile is made
    again)."""
    if (key, plan) not in _plan_peaks:
        _plan_peaks[(key, plan)] = measure()
    return _plan_peaks[(key, plan)]


def calibrated(costs: GraphCosts, plain_peak: int) -> RegionModel:
    """The model with the plain calls' bytes scaled (within [0.3, 2]) so that
    it predicts the measured plain peak: per-call readings of small graphs do
    not add up to the whole step's, as the chain planner found, and an XLA
    step's plain peak is XLA's own (see :class:`RegionModel`)."""
    model = RegionModel(costs)
    low, high = 0.3, 2.0
    for _ in range(20):
        model.rescale_plain((low + high) / 2)
        if model.peak(()) > plain_peak:
            high = model.plain_scale
        else:
            low = model.plain_scale
    model.rescale_plain((low + high) / 2)
    return model


def cached_profile(graph: LayerGraph, inputs: Any,
                   mode: str) -> tuple[ChainProfile, GraphCosts]:
    """The profile, measured once per model, input shapes and mode (the last
    few are kept, with their models, so that their ids stay theirs)."""
    key = profile_key(graph, inputs, mode)
    if key not in _profiles:
        _profiles[key] = (graph.model, *_profile(graph, inputs, mode=mode))
        forget_model_anchor(key)  # a new profile (the id may be another model's now)
        for stale in [k for k in _plan_peaks if k[0] == key]:
            del _plan_peaks[stale]
        while len(_profiles) > _CACHE_SIZE:
            _profiles.pop(next(iter(_profiles)))
    return _profiles[key][1], _profiles[key][2]


def cached_choices(graph: LayerGraph, inputs: Any, mode: str,
                   policies: tuple[Any, ...]) -> PolicyChoices:
    """The policies measured on the graph, once per model, input shapes, mode and
    policies (as the profile)."""
    key = (*profile_key(graph, inputs, mode), policies)
    if key not in _choices:
        _choices[key] = (graph.model, graph_choices(
            graph, inputs, policies, repeated_calls(graph), mode=Mode(mode)))
        while len(_choices) > _CACHE_SIZE:
            _choices.pop(next(iter(_choices)))
    return _choices[key][1]


def profile_key(graph: LayerGraph, inputs: Any, mode: str) -> tuple:
    # The dtype's name: a NumPy batch given to plan_model and the tensor a Keras
    # step traces with are the same inputs (str() reads 'float32' for one and
    # "<dtype: 'float32'>" for the other, and the step profiled the model again).
    shapes = tuple((tuple(leaf.shape), tf.as_dtype(leaf.dtype).name)
                   for leaf in tf.nest.flatten(inputs) if hasattr(leaf, "shape"))
    # Which layers are frozen: unfreezing a backbone makes another profile.
    return (id(graph.model), len(graph.calls), shapes, mode, backprop_calls(graph))


def _profile(graph: LayerGraph, inputs: Any, *,
             mode: str) -> tuple[ChainProfile, GraphCosts]:
    """Profiles the graph as a chain of live-tensor states."""
    keys = tensor_keys(graph)
    reached = backprop_calls(graph, mode)
    last = last_uses(graph)
    made = graph.producers()
    n = len(graph.calls)
    alive = [[k for k, end in zip(keys, last) if made[k] < i <= end] for i in range(n + 1)]
    sizes: dict[Any, tuple[int, bool]] = {}
    profile, same = _profile_states(graph, inputs, alive, sizes, mode=mode)
    readers = graph.consumers()
    savers = _savers(graph, keys, alive, same, profile, readers)
    costs = _graph_costs(graph, profile, keys, last, sizes, readers, savers, mode)
    return profile, without_backward(costs, reached)


def _profile_states(graph: LayerGraph, inputs: Any, alive: list, sizes: dict, *,
                    mode: str) -> tuple[ChainProfile, list[int]]:
    """The chain profile of the graph's calls, each from the tensors ``alive``
    before it to those after it (``sizes`` filled in as they are made), and the
    graph's repeated calls."""
    n = len(graph.calls)
    flat = graph.model_inputs(inputs)
    position = {k: j for j, k in enumerate(graph.input_keys)}
    start = tuple(flat[position[k]] for k in alive[0])
    calls = [functools.partial(_step, graph.calls[i], alive[i], alive[i + 1], sizes)
             for i in range(n)]
    # The profile puts back the state it changes; under a distribution strategy
    # (mirrored seed and BatchNorm variables) its recorder misses some, so the
    # model's non-trainable variables are also saved and put back here.
    same = repeated_calls(graph)
    state = [v for v in graph.model.non_trainable_variables]
    saved = in_fresh_thread(lambda: [v.numpy() for v in state])
    try:
        profile = profile_chain(calls, start, names=[c.name for c in graph.calls],
                                mode=Mode(mode), same_as=same, applied=mode != "eager",
                                # A model whose every call backprop reaches is measured
                                # as it was validated (the input's gradient made too),
                                # but for XLA as fit's step is (see _xla.fit_sources).
                                trainable=fit_sources(graph, mode))
    finally:
        in_fresh_thread(lambda: [v.assign(value) for v, value in zip(state, saved)])
    return profile, same


def _savers(graph: LayerGraph, keys: list, alive: list, same: list[int],
            profile: ChainProfile, readers: dict) -> list[list[int]]:
    """Per tensor, the calls whose backward reads it, in order: its readers that
    save it, and its producer if its own backward reads it (a relu's output); n
    for a model output (held to the end)."""
    n = len(graph.calls)
    made = graph.producers()
    # What each call's backward reads, from the graph it was measured with (a
    # tf.function profile's), else traced for it.
    saved = saved_tensors(graph, same, [
        keys_read(graph.calls[i], alive[i], alive[i + 1], layer.backward_reads)
        if same[i] == i else None for i, layer in enumerate(profile.layers)])
    outputs = set(graph.output_keys)
    return [sorted({i for i in readers.get(k, []) if k in saved[i][0]}
                   | ({made[k]} if made[k] >= 0 and k in saved[made[k]][1] else set())
                   | ({n} if k in outputs else set())) for k in keys]


def _graph_costs(graph: LayerGraph, profile: ChainProfile, keys: list, last: list,
                 sizes: dict, readers: dict, savers: list, mode: str) -> GraphCosts:
    """The region model's costs of the graph from its chain profile, in ``mode``."""
    made = graph.producers()
    layers = profile.layers
    # A tf.function step updates a weight as soon as its gradient is made, while
    # the call's input gradient may still read the weight's value: the update
    # then copies the weight (a variable's buffer still read is copied on write),
    # one more weight beside its gradient, which the profile (gradients returned,
    # not applied) does not see; a large kernel copied so can make a least plan's
    # peak (see docs/decisions/0018-memory-model.md).
    update = np.array([p.weight_grad_bytes if mode == "graph" else 0 for p in layers], float)
    return GraphCosts(
        kept=np.array([p.kept_bytes for p in layers], float),
        fwd=np.array([p.forward_peak_bytes for p in layers], float),
        fwd0=np.array([p.untaped_peak_bytes for p in layers], float),
        bwd=np.array([p.backward_peak_bytes for p in layers], float) + update,
        bwd_alone=None if any(p.backward_alone_bytes is None for p in layers)
        else np.array([p.backward_alone_bytes for p in layers], float) + update,
        # A compiled step applies each weight gradient when it is ready (see
        # profile_chain); an eager one holds them all until the optimizer runs.
        wgrad=np.array([0 if mode != "eager" else p.weight_grad_bytes for p in layers],
                       float),
        cost=_costs(np.array([p.seconds for p in layers], float)),
        dx=np.array(profile.boundary_grad_bytes, float) - _shared_gradients(graph, sizes),
        size=np.array([sizes.get(k, (0, False))[0] for k in keys], float),
        producer=np.array([made[k] for k in keys]),
        last=np.array(last),
        readers=[readers.get(k, []) for k in keys],
        floating=np.array([sizes.get(k, (0, False))[1] for k in keys]),
        own_wgrad=np.array([0 if mode == "eager" else p.weight_grad_bytes for p in layers],
                           float),
        savers=savers)


def _shared_gradients(graph: LayerGraph, sizes: dict) -> np.ndarray:
    """Per cut, the gradient bytes ``boundary_grad_bytes`` counts twice: the
    tensors alive at a cut whose only reader from there on is one ``Add`` of
    same-shaped inputs have one gradient between them (``tf.add``'s gradient
    passes the output's to each input, the same tensor). At the cut before a
    residual block's ``Add`` the branch's output and the shortcut have one
    gradient, not two (traced; see docs/decisions/0018-memory-model.md)."""
    n = len(graph.calls)
    made, readers = graph.producers(), graph.consumers()
    outputs = set(graph.output_keys)
    shared = np.zeros(n + 1)
    for r, call in enumerate(graph.calls):
        if not isinstance(call.layer, (keras.layers.Add, keras_numpy_ops.Add)):
            continue
        shapes = {key: tuple(t.shape) for key, t in zip(call.arg_keys,
                                                        call.arguments.keras_tensors)}
        keys = [k for k in dict.fromkeys(call.in_keys) if sizes.get(k, (0, False))[1]]
        if len(keys) < 2 or len({shapes.get(k) for k in keys}) != 1:
            continue  # broadcast inputs get reduced gradients of their own
        for cut in range(1, r + 1):
            alone = [k for k in keys if made[k] < cut and k not in outputs
                     and all(i == r for i in readers[k] if i >= cut)]
            if len(alone) > 1:
                shared[cut] += (len(alone) - 1) * sizes[alone[0]][0]
    return shared


def _costs(seconds: np.ndarray) -> np.ndarray:
    # A small floor keeps the program from treating a cheap layer as free.
    return np.maximum(seconds, 0.05 * max(float(seconds.mean()), 1e-9))


def _step(call, before, after, sizes, state):
    env = dict(zip(before, state))
    for key, value in env.items():
        _note_size(sizes, key, value)
    run_call(call, env, {"training": True})
    for key in call.out_keys:
        _note_size(sizes, key, env[key])
    return tuple(env[k] for k in after)


def _note_size(sizes: dict, key: Any, value: Any) -> None:
    if key not in sizes and isinstance(value, tf.Tensor) and value.shape.is_fully_defined():
        sizes[key] = (value.shape.num_elements() * value.dtype.size,
                      value.dtype.is_floating)
