"""``CheckpointedSequential``: a stack of Keras layers run as one checkpointed chain.

The layer form of :func:`~tf_checkpointing._sequential.checkpoint_sequential`:
it plans on its first call (with ``budget``), keeps the plan, and saves its
segments, budget and policies in its Keras config.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union, cast

import keras
import tensorflow as tf

from tf_checkpointing import policies as save_policies
from tf_checkpointing._sequential import (
    Segments,
    _expect_choice,
    _run_layers,
    chain_runner,
    expect_segments,
    run_plan,
)
from tf_checkpointing.core._recompute import needs_checkpoint
from tf_checkpointing.planning._errors import PlanningTypeError, PlanningValueError, worded
from tf_checkpointing.planning.layer_graph._calling import (
    layer_names,
    route_keywords,
    validate_layers,
)
from tf_checkpointing.planning.layer_graph._frozen import frozen_prefix, tape_reaches
from tf_checkpointing.planning.measuring._modes import step_mode
from tf_checkpointing.planning.plans._budget import Budget, expect_budget
from tf_checkpointing.planning.plans._plan import SequentialPlan, even_plan
from tf_checkpointing.planning.plans._reuse import PlansByShape
from tf_checkpointing.planning.solving._chain import cached_plan

__all__ = ["CheckpointedSequential"]

_LAYER_API = "CheckpointedSequential"


@keras.saving.register_keras_serializable(package="tf_checkpointing")
class CheckpointedSequential(keras.layers.Layer):
    """A stack of Keras layers run as one checkpointed chain.

    Behaves like ``keras.Sequential(layers)`` as a layer of a bigger model, with
    the same weights in the same order, so weights move between the two both
    ways: ``get_weights`` / ``set_weights``, and weight files
    (``keras.saving.save_weights(layer, "w.weights.h5")`` here,
    ``sequential.load_weights("w.weights.h5")`` there). Training keeps only the
    inputs of its segments (see :func:`checkpoint_sequential`); it trains in
    ``Model.fit`` and saves to ``.keras`` files (``get_config`` / ``from_config``).

    Args:
        layers: Keras layer instances, run one after another.
        segments: number of pieces or ``"sqrt"``, as in
            :func:`checkpoint_sequential`.
        budget: bytes a training step may allocate, or ``"min"`` for the
            least memory; the chain is planned on its first call that can take
            a gradient (``evaluate`` and ``predict`` run it plainly until then),
            from that batch, for eager steps or, if that call is traced in a
            ``tf.function`` (``Model.fit``), for graph steps (XLA ones under
            ``jit_compile=True``). That call's batch size must be known: a
            ``Model.fit`` on a number of samples that is not a multiple of
            ``batch_size`` traces with an unknown one, and the error names the
            fixes. A call in another mode, or with a larger batch, is planned
            again; a smaller batch (an epoch's last) runs the plan made for a
            larger one, and a later call of unknown batch size the largest
            plan, with a warning that the budget holds only for batches no
            larger.
        policy: a save policy for the checkpointed segments, as in
            :func:`checkpoint_sequential` (saved in the config by name for the
            policies of :mod:`tf_checkpointing.policies`).
        policies: with ``budget``, the save policies the plan may choose per
            layer, as in :func:`plan_sequential` (``"auto"``: ``dots_saveable``
            and ``dots_with_no_batch_dims_saveable``); saved in the config as
            ``policy`` is.
        **kwargs: base layer keywords (``name``, ``dtype``, ...).

    Call arguments:
        inputs: a tensor or nested structure of tensors.
        training: passed to the layers that accept it.

    Attributes:
        plan: the :class:`SequentialPlan` it runs (with ``budget``: None until
            the first call that plans).

    Example:
        >>> import keras, numpy as np
        >>> from tf_checkpointing import CheckpointedSequential
        >>> body = CheckpointedSequential(
        ...     [keras.layers.Dense(16, activation="relu") for _ in range(4)], segments=2)
        >>> model = keras.Sequential([keras.Input((16,)), body, keras.layers.Dense(1)])
        >>> model.compile("sgd", "mse")
        >>> model.fit(np.ones((8, 16)), np.ones((8, 1)), verbose=0).history["loss"][0] > 0
        True

        For a budget, choosing per layer among plain, a full replay and the save
        policies, in a ``tf.function`` step (the plan is made on the first call):

        >>> import tensorflow as tf
        >>> body = CheckpointedSequential(
        ...     [keras.layers.Dense(256, activation="gelu") for _ in range(6)],
        ...     budget=8 * 2**20, policies="auto")
        >>> @tf.function
        ... def step(x):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf.reduce_sum(body(x, training=True) ** 2)
        ...     return tape.gradient(loss, body.trainable_variables)
        >>> len(step(tf.random.normal([512, 256])))
        12
        >>> print(body.plan)  # doctest: +ELLIPSIS
        SequentialPlan (graph): 6 layers, budget 8.00 MiB -> ...
    """

    def __init__(self, layers: Sequence[keras.layers.Layer], segments: Segments = "sqrt",
                 budget: Optional[Union[float, str]] = None, policy: Any = None,
                 policies: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        with worded(_LAYER_API):  # the errors name the layer's class
            layers = validate_layers(layers)
            if isinstance(policies, (list, tuple)):  # from a config: names back to policies
                policies = [save_policies.from_config(p) for p in policies]
            self.policies = _expect_choice(policy, policies, budget)
            for i, layer in enumerate(layers):
                if not isinstance(layer, keras.layers.Layer):
                    raise PlanningTypeError(
                        "argument `layers` must contain only Keras layer instances "
                        f"(to be saved and loaded); received {layer!r} of type "
                        f"{type(layer).__name__} at index {i}. Wrap a function in a layer, "
                        "e.g. keras.layers.Activation(tf.nn.gelu) or keras.layers.Lambda(fn), "
                        "or use checkpoint_sequential for plain callables."
                    )
            count = None
            if budget is not None:
                budget = expect_budget(budget)
                if not isinstance(segments, str) or segments != "sqrt":
                    raise PlanningValueError(
                        "pass either `segments` or `budget`, not both; received "
                        f"segments={segments!r} and budget={budget!r}. Drop one of them."
                    )
            else:
                count = expect_segments(segments, len(layers))
        self.layers = list(layers)
        self.segments = segments
        self.budget = budget
        self.policy = save_policies.resolve(save_policies.from_config(policy), api=_LAYER_API)
        # The plan of the last call; with segments, the one fixed plan.
        self.plan: Optional[SequentialPlan] = (
            None if count is None else even_plan(layer_names(layers), count))
        # Plans made for `budget`, per number of leading layers outside backprop
        # (frozen ones: unfreezing plans anew).
        self._plans: dict[int, PlansByShape[SequentialPlan]] = {}

    def build(self, input_shape: Any) -> None:
        # Like keras.Sequential.build: a symbolic pass creates every layer's weights.
        # Outside any tf.function being traced (init_scope), so that the weights
        # hold their values at once: the budget's profile runs the layers eagerly,
        # and a variable created in a trace is initialized only when it runs.
        x = keras.tree.map_shape_structure(lambda shape: keras.KerasTensor(shape),
                                           input_shape)
        with tf.init_scope():
            for layer in self.layers:
                x = layer(x)

    def call(self, inputs: Any, training: Optional[bool] = None) -> Any:
        kwargs = {} if training is None else {"training": training}
        routed = route_keywords(self.layers, kwargs, strict=False)
        if not needs_checkpoint():  # eager with no tape: nothing to plan or keep
            return _run_layers(self.layers, routed, 0, len(self.layers), inputs)
        plan = self.plan
        if self.budget is not None:  # the plan for this mode and batch (see _reuse)
            with worded(_LAYER_API):  # planning's errors, warnings and progress name it
                mode = step_mode("auto")
                input_grad = tape_reaches(inputs)
                plans = self._plans.setdefault(
                    frozen_prefix(self.layers, input_grad=input_grad, mode=mode),
                    PlansByShape())
                plan, plan_anew = plans.find(mode, inputs, training=training)
                if plan_anew:
                    plan = cached_plan(self.layers, inputs, cast(Budget, self.budget),
                                       kwargs, routed,
                                       runner=chain_runner(self.layers, kwargs, routed),
                                       mode=mode, policies=self.policies,
                                       input_grad=input_grad)
                    plans.add(mode, inputs, plan)
            if plan is None:  # inference (evaluate, predict) before any plan
                return _run_layers(self.layers, routed, 0, len(self.layers), inputs)
            self.plan = plan
        return run_plan(self.layers, plan, inputs, kwargs, routed, policy=self.policy)

    def compute_output_spec(self, inputs: Any, training: Optional[bool] = None) -> Any:
        x = inputs
        for layer in self.layers:
            x = layer.compute_output_spec(x)
        return x

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            layers=[keras.saving.serialize_keras_object(layer) for layer in self.layers],
            segments=self.segments,
            budget=self.budget,
            policy=save_policies.to_config(self.policy),
            policies=[save_policies.to_config(p) for p in self.policies] or None,
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CheckpointedSequential:
        config = dict(config)
        config["layers"] = [keras.saving.deserialize_keras_object(layer)
                            for layer in config["layers"]]
        return cls(**config)
