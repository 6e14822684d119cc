"""Every private TensorFlow and Keras API the library uses, imported in this one place.

What a replay must see again as the forward saw it (the tape, op callbacks,
Keras' call context and seed state, the layer graph of a functional model) is
not in TensorFlow's or Keras' public API. The names below are, each with the
module that needs it. When a TensorFlow or Keras release moves one, this is the
file to change (see ``docs/decisions/0033-private-apis-in-one-module.md``).
"""

from __future__ import annotations

from typing import Optional

# Keras: call context, masks, seeds and the functional graph.
from keras.src import backend as keras_backend  # _losses: the scope losses go to
from keras.src.backend import KerasTensor, is_float_dtype, standardize_dtype  # _nested_inputs
from keras.src.backend.common import global_state as keras_global_state  # _seeding, context
from keras.src.backend.common import symbolic_scope  # _layer_proxy: shape inference
from keras.src.backend.common.masking import get_keras_mask, set_keras_mask  # graph runner
from keras.src.models.functional import (  # planning.layer_graph._layer_graph
    operation_fn,
    unpack_singleton,
)
from keras.src.ops import numpy as keras_numpy_ops  # op nodes of a graph (`x + y`)
from keras.src.ops.symbolic_arguments import SymbolicArguments  # _nested_inputs
from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR  # _seeding

# TensorFlow: the tape, op callbacks and graph internals.
from tensorflow.python import pywrap_tfe  # _recompute: is recording stopped?
from tensorflow.python.autograph.core import config as autograph_config  # _decorator
from tensorflow.python.eager import context, forwardprop_util, record  # tape state
from tensorflow.python.eager import tape as tape_lib  # _recompute: variable watching
from tensorflow.python.framework import func_graph, op_callbacks, random_seed
from tensorflow.python.framework import (
    ops as tf_ops,  # planning.measuring._leave_no_trace: gradient registry
)
from tensorflow.python.ops import (
    control_flow_util,
    control_flow_v2_func_graphs,
    gen_random_ops,
    gen_resource_variable_ops,
    resource_variable_ops,  # planning.measuring._leave_no_trace: every variable's storage class
    stateful_random_ops,  # planning.measuring._leave_no_trace: the global generator
    tensor_array_ops,
)


def dataset_batch_size(dataset: object) -> Optional[int]:
    """The batch size of the outermost ``batch`` / ``padded_batch`` in a
    ``tf.data.Dataset``'s chain (``_input_dataset``, ``_batch_size``: private),
    or None (``_fit_batches``: the largest batch ``Model.fit`` will feed)."""
    while dataset is not None:
        size = getattr(dataset, "_batch_size", None)
        if size is not None:
            try:
                return int(size)
            except (TypeError, ValueError):  # a symbolic size: unknown
                return None
        dataset = getattr(dataset, "_input_dataset", None)
    return None


try:  # the profiler's protobufs (planning.measuring._requested); a TensorFlow that moved them
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
except ImportError:  # pragma: no cover - the XLA planner then reads the chunks
    xplane_pb2 = None

__all__ = [
    "GLOBAL_SEED_GENERATOR", "KerasTensor", "SymbolicArguments", "autograph_config",
    "context", "control_flow_util", "control_flow_v2_func_graphs", "dataset_batch_size",
    "forwardprop_util",
    "func_graph", "gen_random_ops", "gen_resource_variable_ops", "get_keras_mask",
    "is_float_dtype", "keras_backend", "keras_global_state", "keras_numpy_ops", "op_callbacks",
    "operation_fn",
    "pywrap_tfe", "random_seed", "record", "resource_variable_ops", "set_keras_mask",
    "standardize_dtype",
    "stateful_random_ops", "symbolic_scope", "tape_lib", "tensor_array_ops", "tf_ops",
    "unpack_singleton",
    "xplane_pb2",
]
