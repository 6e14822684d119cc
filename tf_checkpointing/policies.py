"""Save policies: which results of a checkpointed call to keep instead of replaying.

A checkpointed call keeps only its inputs and replays everything in backprop.
With a policy it also keeps the outputs of the ops the policy chooses (typically
the expensive ones: matrix products and convolutions), and its replay reuses
them instead of computing them again; only the cheap ops around them (element-wise
ops, normalizations, softmax, dropout) are replayed. This is JAX's
``jax.checkpoint(policy=...)`` and PyTorch's selective activation checkpointing
for TensorFlow.

A policy is a callable taking one :class:`OpOutput` (a tensor produced inside the
checkpointed call) and returning True to keep it. The module-level policies below
are such callables; ``save_only_these_names`` and ``save_anything_except_these_names``
build one from names given with :func:`tf_checkpointing.checkpoint_name`.

Example:
    >>> import keras
    >>> import tensorflow as tf
    >>> from tf_checkpointing import checkpointable, policies
    >>> @checkpointable(checkpoint=True, policy=policies.dots_saveable)
    ... def block(x, w):
    ...     return tf.nn.gelu(x @ w)
    >>> x, w = tf.ones([2, 3]), tf.Variable(tf.ones([3, 3]))
    >>> with tf.GradientTape() as tape:
    ...     y = tf.reduce_sum(block(x, w))
    >>> tape.gradient(y, w).shape
    TensorShape([3, 3])
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

__all__ = [
    "OpOutput",
    "Policy",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "nothing_saveable",
    "random_saveable",
    "reductions_saveable",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
]


@dataclasses.dataclass(frozen=True)
class OpOutput:
    """One tensor produced inside a checkpointed call, as a policy sees it.

    Attributes:
        op_type: the op's type, e.g. ``"MatMul"``, ``"Conv2D"``, ``"Identity"``.
        op_name: the op's name in the graph (``None`` in eager execution).
        name: the name given with :func:`tf_checkpointing.checkpoint_name`, or None.
        shape: the tensor's static shape (a ``tf.TensorShape``).
        dtype: the tensor's dtype.
        input_shapes: the static shapes of the op's inputs.
        index: which output of the op this is (0 for single-output ops).
        attrs: the op's attributes that policies may need (e.g. ``"equation"``
            of an ``Einsum``), as Python values.
        random: True for a tensor computed from random draws alone (and
            constants) that the rest of the call reads: a dropout mask
            (``uniform >= rate``, boolean), additive noise. Policies are asked
            about such a tensor only there, not about the draws it is made of.
    """

    op_type: str
    op_name: Optional[str]
    name: Optional[str]
    shape: tf.TensorShape
    dtype: tf.DType
    input_shapes: tuple[tf.TensorShape, ...] = ()
    index: int = 0
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)
    random: bool = False


Policy = Callable[[OpOutput], bool]

# Matrix products and convolutions as TensorFlow and Keras emit them, and the fused
# forms Grappler's remapper and oneDNN rewrite them into.
DOT_OPS = frozenset((
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "_FusedMatMul", "_MklMatMul", "_MklFusedMatMul", "_FusedBatchMatMulV2",
    "SparseMatMul", "QuantizedMatMul",
))
CONV_OPS = frozenset((
    "Conv1D", "Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
    "Conv3DBackpropInputV2", "_FusedConv2D", "_FusedConv3D",
    "_FusedDepthwiseConv2dNative", "_MklConv2D", "_MklFusedConv2D",
))

# Reductions as TensorFlow and Keras emit them (a BatchNorm's or LayerNorm's
# moments are ``Mean`` ops; ``tf.reduce_*`` are these).
REDUCTION_OPS = frozenset(("Mean", "Sum", "Max", "Min", "Prod", "EuclideanNorm"))
# A reduction is kept when its result is at most this fraction of its input: then
# keeping it adds at most 1/16 of a tensor the call already makes, and saves a
# full pass over that tensor in the replay.
_REDUCED_AT_MOST = 1 / 16


def nothing_saveable(out: OpOutput) -> bool:
    """Keep nothing but the call's inputs: replay everything (the default)."""
    return False


def everything_saveable(out: OpOutput) -> bool:
    """Keep everything: no replay at all (the call is run as plain TensorFlow)."""
    return True


def random_saveable(out: OpOutput) -> bool:
    """Keep what the call draws at random where the rest of the call reads it:
    dropout masks (boolean, 1 byte an element), additive noise. The replay then
    draws nothing (``OpOutput.random``)."""
    return out.random


def dots_saveable(out: OpOutput) -> bool:
    """Keep the outputs of matrix products and convolutions (``MatMul``,
    ``BatchMatMulV2/V3``, ``Einsum``, ``Conv2D``/``Conv3D``,
    ``DepthwiseConv2dNative`` and their fused forms) and the dropout masks
    (:func:`random_saveable`), replay the rest. TF1's ``checkpoints='speed'``;
    JAX's ``dots_saveable`` plus the masks.

    Why the masks, which JAX's policy does not keep: TensorFlow's random number
    generation is slow on CPU (drawing a GPT-2 block's three dropout masks costs
    more than its softmax, nearly as much as its dense products), so replaying
    it took about a third of this policy's replay time, while a mask costs a
    quarter of a float activation of the same shape (measured in
    benchmarks/results/notes/save-policies.md). JAX's exact choice:
    ``lambda out: dots_saveable(out) and not out.random``."""
    return out.op_type in DOT_OPS or out.op_type in CONV_OPS or out.random


def reductions_saveable(out: OpOutput) -> bool:
    """Keep the results of reductions (``Mean``, ``Sum``, ``Max``, ``Min``,
    ``Prod``, ``EuclideanNorm``) that are at most 1/16 of their input: a
    BatchNorm's batch mean and variance (one number per channel), a
    LayerNorm's per-token statistics. They cost almost no memory, and the
    replay skips the passes over the input that made them (a BatchNorm's
    forward makes three of its five passes for its statistics).

    The replay uses the values the forward computed, so the gradients are the
    plain model's, as with a full replay (within float32 rounding, under
    ``tf.function`` and XLA). On a model with many BatchNorms it makes the
    step measurably faster at the same peak (``docs/save-policies.md``;
    ``docs/decisions/0022-reductions-saveable-per-region.md``).

    Example:
        >>> import tensorflow as tf
        >>> from tf_checkpointing import policies
        >>> from tf_checkpointing.policies import OpOutput
        >>> policies.reductions_saveable(OpOutput(
        ...     "Mean", None, None, tf.TensorShape([1, 1, 1, 64]), tf.float32,
        ...     (tf.TensorShape([8, 32, 32, 64]), tf.TensorShape([3]))))
        True
    """
    if out.op_type not in REDUCTION_OPS or not out.input_shapes:
        return False
    size, reduced = out.shape.num_elements(), out.input_shapes[0].num_elements()
    return size is not None and reduced is not None and size <= reduced * _REDUCED_AT_MOST


def dots_with_no_batch_dims_saveable(out: OpOutput) -> bool:
    """Keep the outputs of matrix products that have no batch dimension, as JAX
    defines it: a dimension of both operands that is neither contracted nor
    broadcast (attention's ``q @ k^T`` per head has one, a ``Dense`` layer's
    ``x @ kernel`` has none, even on a 3-D ``x``), and the dropout masks (as
    :func:`dots_saveable`). Convolutions are not kept."""
    if out.random or out.op_type in ("MatMul", "_FusedMatMul", "_MklMatMul",
                                     "_MklFusedMatMul"):
        return True
    if out.op_type.startswith("BatchMatMul") or out.op_type == "_FusedBatchMatMulV2":
        ranks = [s.rank for s in out.input_shapes]
        return any(r is not None and r <= 2 for r in ranks)
    if out.op_type == "Einsum":
        return not _einsum_batch_labels(out.attrs.get("equation"))
    return False


def save_from_both_policies(first: Policy, second: Policy) -> Policy:
    """A policy keeping what either policy keeps (JAX's combinator).

    Example:
        >>> from tf_checkpointing import policies
        >>> keep = policies.save_from_both_policies(
        ...     policies.save_only_these_names("attention_out"), policies.random_saveable)
    """
    for argument, given in (("first", first), ("second", second)):
        if not callable(given):
            raise TypeError(
                f"policies.save_from_both_policies: argument `{argument}` must be a save "
                f"policy (a callable taking an OpOutput); received {given!r} of type "
                f"{type(given).__name__}. Pass e.g. policies.random_saveable.")

    def either(out: OpOutput) -> bool:
        return bool(first(out)) or bool(second(out))

    name = f"save_from_both_policies({_name(first)}, {_name(second)})"
    either.__name__ = either.__qualname__ = name
    either._config = ("save_from_both_policies",  # type: ignore[attr-defined]
                      [to_config(first), to_config(second)])
    return either


def _name(policy: Policy) -> str:
    return getattr(policy, "__name__", repr(policy))


def _einsum_batch_labels(equation: Any) -> set[str]:
    """Labels present in both operands and in the output (``...`` counts as one)."""
    if isinstance(equation, bytes):
        equation = equation.decode()
    if not isinstance(equation, str) or "->" not in equation:
        return {"?"}  # unknown: assume a batch dimension, keep nothing
    operands, output = equation.replace(" ", "").replace("...", ".").split("->")
    terms = operands.split(",")
    if len(terms) != 2:
        return {"?"}
    return set(terms[0]) & set(terms[1]) & set(output)


def save_only_these_names(*names: str) -> Policy:
    """A policy keeping only the tensors named with
    :func:`tf_checkpointing.checkpoint_name` as one of ``names``.

    Example:
        >>> from tf_checkpointing import policies
        >>> keep = policies.save_only_these_names("attn_proj", "mlp_out")
    """
    wanted = _expect_names("save_only_these_names", names)

    def policy(out: OpOutput) -> bool:
        return out.name is not None and out.name in wanted

    policy.__name__ = policy.__qualname__ = f"save_only_these_names{tuple(sorted(wanted))}"
    policy._config = ("save_only_these_names", sorted(wanted))  # type: ignore[attr-defined]
    return policy


def save_anything_except_these_names(*names: str) -> Policy:
    """A policy keeping every tensor except those named with
    :func:`tf_checkpointing.checkpoint_name` as one of ``names`` (only these,
    and what they need that nothing kept provides, are replayed)."""
    unwanted = _expect_names("save_anything_except_these_names", names)

    def policy(out: OpOutput) -> bool:
        return out.name is None or out.name not in unwanted

    policy.__name__ = policy.__qualname__ = (
        f"save_anything_except_these_names{tuple(sorted(unwanted))}")
    policy._config = ("save_anything_except_these_names", sorted(unwanted))  # type: ignore
    return policy


def _expect_names(where: str, names: tuple) -> frozenset[str]:
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"policies.{where}: every name must be a str; received {name!r} of type "
                f"{type(name).__name__}. Pass the names given to checkpoint_name, e.g. "
                f'policies.{where}("attn_proj", "mlp_out").'
            )
    return frozenset(names)


def resolve(policy: Any, argument: str = "policy", *,
            api: str = "checkpointable") -> Optional[Policy]:
    """Validates a ``policy=`` / ``_policy=`` value given to ``api``: None or
    ``nothing_saveable`` (keep only the inputs) become None; any other callable
    is returned as is."""
    problem = not_a_policy(policy, argument)
    if problem is not None:
        raise TypeError(f"{api}: {problem}")
    return None if policy is None or policy is nothing_saveable else policy


def not_a_policy(policy: Any, argument: str = "policy") -> Optional[str]:
    """Why ``policy`` is not a save policy (nor None), naming ``argument``, with
    the fix; None when it is one. The message has no function's name in front:
    :func:`resolve` puts the caller's there, planning raises it typed for the API
    layer to word (this module sits below both)."""
    if policy is None or (callable(policy) and not isinstance(policy, (type, str, tf.Tensor))):
        return None
    if isinstance(policy, str) and hasattr(_module(), policy):
        fix = f"policy=tf_checkpointing.policies.{policy}"
    else:
        fix = "policy=tf_checkpointing.policies.dots_saveable"
    return (
        f"argument `{argument}` must be None or a save policy (a callable "
        "taking a tf_checkpointing.policies.OpOutput and returning a bool, such as "
        f"tf_checkpointing.policies.dots_saveable); received {policy!r} of type "
        f"{type(policy).__name__}. Pass e.g. {fix}."
    )


def to_config(policy: Optional[Policy]) -> Any:
    """A policy as a config value (for ``get_config``): None, the name of a
    policy of this module, ``[factory, names]``, or a Keras-serialized function."""
    if policy is None:
        return None
    if hasattr(policy, "_config"):
        return list(policy._config)
    name = getattr(policy, "__name__", "")
    if getattr(_module(), name, None) is policy:
        return name
    return keras.saving.serialize_keras_object(policy)


def from_config(config: Any) -> Any:
    """The inverse of :func:`to_config` (anything else is returned as is)."""
    if isinstance(config, str) and config in __all__ and config != "OpOutput":
        return getattr(_module(), config)
    if isinstance(config, (list, tuple)) and len(config) == 2 and config[0] in (
            "save_only_these_names", "save_anything_except_these_names"):
        return getattr(_module(), config[0])(*config[1])
    if isinstance(config, (list, tuple)) and len(config) == 2 and (
            config[0] == "save_from_both_policies"):
        return save_from_both_policies(*(from_config(c) for c in config[1]))
    if isinstance(config, dict):
        return keras.saving.deserialize_keras_object(config)
    return config


def _module() -> Any:
    return sys.modules[__name__]
