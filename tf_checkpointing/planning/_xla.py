"""Plans for an XLA step: the planners' model anchored at two measured XLA steps.

Why a plan made from a graph profile overshoots under ``jit_compile=True``
(measured, TF 2.21, XLA:CPU, from XLA's own buffer assignment,
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``): XLA allocates one
buffer for all of a step's temporaries, and its live bytes at the peak are the
activations the graph model predicts *plus* buffers that do not shrink with
checkpointing: the weights transposed for the backward convolutions (about the
size of all weights) and, for a MaxPool, the iota/broadcast tensors of its
gradient, which XLA's scheduler computes as soon as their inputs exist and
keeps until the backward reads them. ResNet50's least plan (128x128, batch 16):
124 MiB of activations, 89 MiB of weight copies, 68 MiB of MaxPool indices;
with the default concurrency-optimised scheduler of XLA:CPU, 172 + 162 + 85
MiB. The replays are not merged into the forward (the replayed convolutions
are all in the optimised HLO). A planner that scales the per-layer numbers to
the XLA plain step treats that constant part as proportional, and predicts
the plans that keep little far too low (ResNet50: 158 MiB predicted, 456
measured).

So for an XLA step the planners compile and measure one more step, the
least-memory plan, and map their model's peak ``g`` through the line that
takes the model's least and plain peaks to the measured ones: the constant
part is the intercept, the activations the slope. A budget is met when the
mapped peak fits it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Callable, Optional

from tf_checkpointing._state import StateRecorder
from tf_checkpointing.planning._allocator import concrete_inputs, in_fresh_thread, memory_device
from tf_checkpointing.planning._graph_profile import graph_plain_peak

__all__: list[str] = []

_CACHE_SIZE = 4
_model_anchors: dict[Any, XlaAnchor] = {}  # per profile key: the measured least plan


@dataclasses.dataclass(frozen=True)
class XlaAnchor:
    """The model's peaks of the least and the plain plan, and the XLA steps'.

    Example:
        >>> from tf_checkpointing.planning._xla import XlaAnchor
        >>> anchor = XlaAnchor(model_least=100, model_plain=400, least_bytes=250,
        ...                    plain_bytes=400)
        >>> anchor.predict(100), anchor.predict(400), anchor.predict(250)
        (250.0, 400.0, 325.0)
        >>> anchor.model_limit(325.0)
        250.0
    """

    model_least: float
    model_plain: float
    least_bytes: int
    plain_bytes: int

    @property
    def helps(self) -> bool:
        """Whether the least plan peaks below plain under XLA at all."""
        return self.least_bytes < self.plain_bytes and self.model_least < self.model_plain

    @property
    def slope(self) -> float:
        if not self.helps:
            return 1.0
        return (self.plain_bytes - self.least_bytes) / (self.model_plain - self.model_least)

    def predict(self, model_bytes: float) -> float:
        """The XLA peak of a plan the model predicts ``model_bytes`` for."""
        return self.least_bytes + self.slope * (model_bytes - self.model_least)

    def model_limit(self, xla_bytes: float) -> float:
        """The model peak a plan may have for its XLA peak to be ``xla_bytes``."""
        return self.model_least + (xla_bytes - self.least_bytes) / self.slope


def measure_xla_step(run: Callable[[Any], Any], inputs: Any, api: str,
                     variables: Sequence[Any] = ()) -> int:
    """Peak of ``run``'s forward and backward compiled with ``jit_compile=True``
    (each gradient consumed at once, as an optimizer in the step does), run on
    ``inputs`` eagerly in a thread of its own; the state it writes (BatchNorm
    statistics, seeds) and ``variables`` are put back."""

    def measure() -> int:
        x = concrete_inputs(inputs, api)
        device = memory_device(x, api)
        saved = [v.numpy() for v in variables]
        recorder = StateRecorder()
        with recorder:
            try:
                return graph_plain_peak([run], x, device, True, applied=True)
            finally:
                recorder.restore_before()
                for v, value in zip(variables, saved):
                    v.assign(value)

    return int(in_fresh_thread(measure))


def model_anchor(key: Any, graph: Any, inputs: Any, least_spans: tuple, *,
                 model_least: float, model_plain: float, plain_bytes: int,
                 api: str) -> XlaAnchor:
    """The anchor of a whole-model plan for an XLA step: its least plan
    (``least_spans``) compiled and measured, once per profile ``key``."""
    if key not in _model_anchors:
        # Imported here: the runner plans with the model planner, which uses this.
        from tf_checkpointing._graph_runner import GraphRunner  # noqa: PLC0415
        from tf_checkpointing.planning._plan import ModelPlan  # noqa: PLC0415

        names = tuple(call.name for call in graph.calls)
        runner = GraphRunner(graph, plan=ModelPlan(names, least_spans, "xla", None, 0, 0, 0))
        least_bytes = measure_xla_step(lambda x: runner(x, training=True), inputs, api,
                                       graph.model.non_trainable_variables)
        _model_anchors[key] = XlaAnchor(model_least=model_least, model_plain=model_plain,
                                        least_bytes=least_bytes, plain_bytes=plain_bytes)
        while len(_model_anchors) > _CACHE_SIZE:
            _model_anchors.pop(next(iter(_model_anchors)))
    return _model_anchors[key]


def forget_model_anchor(key: Any) -> Optional[XlaAnchor]:
    """Drops the anchor measured for profile ``key`` (its profile was replaced)."""
    return _model_anchors.pop(key, None)
