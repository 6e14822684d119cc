"""The plan: which layers run as checkpointed regions, nested how, under which policy.

One type for chains and whole models. A :class:`Plan` names the layers (a
chain's layers, or a model's layer calls in run order) and covers them with
:class:`Segment` pieces: a plain piece runs its layers as they are; a
checkpointed one keeps only its inputs (and what its save policy picks) and is
replayed in backprop, possibly with checkpointed pieces of its own inside
(``inner``). :class:`SequentialPlan` (chains: ``checkpoint_sequential``,
``CheckpointedSequential``) and :class:`ModelPlan` (``apply_checkpointing``) are
the two views of it: the same fields, printing (:mod:`._plan_text`) and config,
plus what each runner needs. :func:`even_plan` makes the fixed ``segments=k`` schedule.

How planning runs a plan it wants to measure, without importing the runtime:
two measurements need the plan itself run (an XLA step compiles the whole
checkpointed step, so the least plan is compiled and measured, see
:mod:`tf_checkpointing.planning.solving._xla`): for those, the API floor hands
the planner a :data:`PlanRunner`, which turns a plan into the step body that
runs the chain or model by it. The planner calls it and never imports the code
behind it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar, Union

from tf_checkpointing import policies as save_policies
from tf_checkpointing.planning._errors import worded
from tf_checkpointing.planning.layer_graph._layer_graph import read_graph
from tf_checkpointing.planning.layer_graph._regions_by_name import spans_by_name
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile
from tf_checkpointing.planning.measuring._modes import expect_mode
from tf_checkpointing.planning.plans._plan_text import model_plan_text, plan_text

__all__ = ["ModelPlan", "Plan", "PlanRunner", "Segment", "SequentialPlan", "even_plan",
           "pieces_of_spans"]

P = TypeVar("P", bound="Plan")
_FROM_REGIONS = "ModelPlan.from_regions"

PlanRunner = Callable[[Any], Callable[[Any], Any]]
"""``runner(plan)`` -> ``body``; ``body(inputs)`` runs the chain or model by
``plan`` in training mode and returns its outputs."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers ``[start, stop)``, run plainly or as one checkpointed region.

    Attributes:
        start, stop: the layers it runs.
        checkpointed: whether it keeps only its inputs and is replayed in backprop.
        inner: for a checkpointed segment, the pieces its replay runs (nested
            checkpoints), covering ``[start, stop)``; empty when the replay runs
            its layers plainly.
        policy: for a checkpointed segment, the save policy it keeps what it
            picks with (:mod:`tf_checkpointing.policies`); None replays all of it.
    """

    start: int
    stop: int
    checkpointed: bool
    inner: tuple[Segment, ...] = ()
    policy: Any = None

    @property
    def pieces(self) -> tuple[Segment, ...]:
        """What running this segment's layers (its replay, when checkpointed) runs."""
        return self.inner or (Segment(self.start, self.stop, False),)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which layers run checkpointed: a cover of the layers by :class:`Segment` pieces.

    Attributes:
        names: the name of each layer (a model's: each layer call), in run order.
        pieces: the top level, a contiguous cover of the layers.
        mode: the step it was planned for: ``"eager"``, ``"graph"``
            (``tf.function``, ``Model.fit``) or ``"xla"`` (``jit_compile=True``);
            None for a schedule made without a profile (``segments=k``).
        budget_bytes: what it was planned for: bytes, ``"min"`` (the least
            memory), or None (not planned for a budget).
        predicted_peak_bytes: the step's peak above what is allocated before it,
            as the planner predicts it.
        plain_peak_bytes: the measured peak of the step without checkpointing.
        min_budget_bytes: the least budget: the least predicted peak of any
            plan, plus the headroom plans keep free (10%; whole-model plans under
            XLA 5%, docs/decisions/0053-xla-plans-keep-less-headroom.md). A budget
            up to 5% below it gets the least plan
            (docs/decisions/0046-least-budget-slack.md).
        policies: the save policies the planner could choose per region; empty
            when it chose only between plain and full replays.
        predicted_extra_seconds: the replay time per step the plan adds, as the
            planner's time model predicts it.

    Example:
        >>> from tf_checkpointing.plans import Segment, SequentialPlan
        >>> plan = SequentialPlan(names=("a", "b", "c"),
        ...                       pieces=(Segment(0, 2, True), Segment(2, 3, False)))
        >>> plan.regions, plan.extra_forward_layers
        ([['a', 'b']], 2)
        >>> SequentialPlan.from_config(plan.to_config()) == plan  # JSON-ready, by name
        True
    """

    names: tuple[str, ...]
    pieces: tuple[Segment, ...]
    mode: Optional[str] = None
    budget_bytes: Optional[Union[int, str]] = None
    predicted_peak_bytes: Optional[int] = None
    plain_peak_bytes: Optional[int] = None
    min_budget_bytes: Optional[int] = None
    policies: tuple[Any, ...] = ()
    predicted_extra_seconds: Optional[float] = None

    @property
    def num_layers(self) -> int:
        """How many layers (layer calls) the plan covers."""
        return len(self.names)

    @property
    def segments(self) -> list[tuple[int, int]]:
        """The top level: ``(start, stop)`` of each piece, covering the layers."""
        return [(p.start, p.stop) for p in self.pieces]

    @property
    def checkpointed(self) -> list[bool]:
        """For each of ``segments``, whether it is checkpointed."""
        return [p.checkpointed for p in self.pieces]

    @property
    def regions(self) -> list[list]:
        """Each checkpointed region as the names of its layers, in run order; a
        region checkpointed inside another's replay is a nested list."""
        return [_names(self.names, p) for p in self.pieces if p.checkpointed]

    @property
    def forward_counts(self) -> list[int]:
        """How many times each layer's forward runs in one training step."""
        counts = [1] * self.num_layers
        _count(self.pieces, counts)
        return counts

    @property
    def extra_forward_layers(self) -> int:
        """Layer forwards recomputed per step, on top of the one plain forward."""
        return sum(self.forward_counts) - self.num_layers

    @property
    def depth(self) -> int:
        """Levels of nested checkpoints (0: no recomputation)."""
        return _depth(self.pieces)

    def __str__(self) -> str:
        return plan_text(self)

    def to_config(self) -> dict[str, Any]:
        """The plan as JSON-ready values (save policies by name, see
        ``policies.to_config``); :meth:`from_config` makes it again."""
        config = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("pieces", "policies", "profile")}
        config.update(names=list(self.names), pieces=[_piece_config(p) for p in self.pieces],
                      policies=[save_policies.to_config(p) for p in self.policies])
        if "call_kinds" in config:
            config["call_kinds"] = list(config["call_kinds"])
        if "blocks" in config:
            config["blocks"] = [list(ref) for ref in config["blocks"]]
            config["block_names"] = list(config["block_names"])
        return config

    @classmethod
    def from_config(cls: type[P], config: dict[str, Any]) -> P:
        """The plan :meth:`to_config` described."""
        config = dict(config)
        config.pop("predicted_for", None)  # in plans saved before 0.2: their numbers' step
        config["names"] = tuple(config["names"])
        config["pieces"] = tuple(_piece_of(c) for c in config["pieces"])
        config["policies"] = tuple(save_policies.from_config(p) for p in config["policies"])
        if "call_kinds" in config:
            config["call_kinds"] = tuple(config["call_kinds"])
        if "blocks" in config:
            config["blocks"] = tuple(tuple(ref) for ref in config["blocks"])
            config["block_names"] = tuple(config.get("block_names", ()))
        return cls(**config)


@dataclasses.dataclass(frozen=True)
class SequentialPlan(Plan):
    """A :class:`Plan` for a chain of layers, as ``plan_sequential`` makes it.

    Attributes:
        profile: the per-layer measurements it was planned from (None for
            ``segments=k``).
    """

    profile: Optional[ChainProfile] = dataclasses.field(default=None, repr=False,
                                                         compare=False)


@dataclasses.dataclass(frozen=True)
class ModelPlan(Plan):
    """A :class:`Plan` for a whole functional model, as ``plan_model`` makes it.

    Attributes:
        call_kinds: per layer call, its layer's class and configuration (but the
            name) and the calls it reads: another instance of the same
            architecture, whose layers Keras numbered differently, takes the
            plan too.
        blocks: repeated blocks inside layer calls, checkpointed one by one as
            ``apply_checkpointing(model, [Block])`` would: each a ``(call index,
            index among the call's layer's sublayers)`` pair (a keras_hub
            ``ViTEncoder`` runs its ``ViTEncoderBlock`` s in a loop, where no
            region of the graph reaches).
        block_names: for display, ``"call/block"`` for each of ``blocks``.
        plain_step_seconds: the plain training step's time in ``mode``,
            measured while planning (None: not timed, e.g. an eager plan or one
            read from a file written before 0.2).
        predicted_step_seconds: this plan's step time as the planner's time
            model predicts it: the plain step plus its replays (see
            docs/decisions/0039-step-time-model.md).

    Example (``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing import apply_checkpointing, plan_model
        >>> x = keras.Input((32,))
        >>> h = x
        >>> for _ in range(4):
        ...     h = keras.layers.Add()([h, keras.layers.Dense(32, activation="relu")(h)])
        >>> model = keras.Model(x, keras.layers.Dense(1)(h))
        >>> plan = plan_model(model, tf.random.normal([256, 32]), budget="min")
        >>> len(plan.regions) >= 1  # lists of layer names; a nested list is a region inside
        True
        >>> plan.predicted_peak_bytes < plan.plain_peak_bytes
        True
        >>> apply_checkpointing(model, plan=plan) == [model]
        True
    """

    call_kinds: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    blocks: tuple[tuple[int, int], ...] = ()
    block_names: tuple[str, ...] = ()
    plain_step_seconds: Optional[float] = None
    predicted_step_seconds: Optional[float] = None

    def __str__(self) -> str:
        return model_plan_text(self)

    @property
    def call_names(self) -> tuple[str, ...]:
        """Deprecated: ``names``, the layer name of each call in run order. It will
        be removed in tf_checkpointing 0.3."""
        warnings.warn("`ModelPlan.call_names` is deprecated and will be removed in "
                      "tf_checkpointing 0.3: read `ModelPlan.names`, the same tuple.",
                      DeprecationWarning, stacklevel=2)
        return self.names

    @classmethod
    def from_regions(cls, model: Any, regions: Sequence[Sequence[Any]], *,
                     policies: Optional[Sequence[Any]] = None,
                     mode: str = "graph") -> ModelPlan:
        """The plan that checkpoints the given regions of ``model``, named by layer.

        For a plan fixed by hand (or a test that must checkpoint a given layer):
        no profile, no prediction. Each region is the names of consecutive layer
        calls in run order (``plan.names`` lists them); a nested list inside a
        region is checkpointed inside its replay.

        Args:
            model: the functional or Sequential Keras model.
            regions: the regions, in run order, e.g. ``[["conv1", "bn1", "relu1"],
                ["conv2", "bn2"]]``.
            policies: per region, the save policy its replay keeps what it picks
                with (None: a full replay); default: none.
            mode: the kind of step it is meant for (``"eager"``, ``"graph"``,
                ``"xla"``): only a warning uses it.

        Example:
            >>> import keras
            >>> from tf_checkpointing import ModelPlan
            >>> x = keras.Input((8,))
            >>> h = keras.layers.Dense(8, name="a")(x)
            >>> h = keras.layers.Dense(8, name="b")(h)
            >>> model = keras.Model(x, keras.layers.Dense(1, name="c")(h))
            >>> ModelPlan.from_regions(model, [["a", "b"]]).regions
            [['a', 'b']]
        """
        with worded(_FROM_REGIONS):  # a public function: it names itself
            graph = read_graph(model)
            names = tuple(call.name for call in graph.calls)
            spans, chosen = spans_by_name(names, regions, policies)
            mode = expect_mode(mode)
        return cls(names=names, pieces=pieces_of_spans(0, len(names), spans, chosen),
                   mode=mode, call_kinds=graph.kinds())


def even_plan(names: Sequence[str], segments: int) -> SequentialPlan:
    """``segments`` pieces of (nearly) equal length; all but the last checkpointed
    (the last one's replay would start right away: it would save nothing)."""
    n = len(names)
    bounds = [round(i * n / segments) for i in range(segments + 1)]
    pieces = tuple(Segment(bounds[i], bounds[i + 1], i < segments - 1)
                   for i in range(segments))
    return SequentialPlan(names=tuple(names), pieces=pieces)


def pieces_of_spans(start: int, stop: int, spans: tuple,
                    policies: Sequence[Any] = ()) -> tuple[Segment, ...]:
    """The cover of ``[start, stop)`` whose checkpointed pieces are ``spans``
    (``(start, stop, inner)`` triples, as the region solver gives them), each
    under the policy at its position in ``policies`` (missing: None)."""
    pieces: list[Segment] = []
    at = start
    for k, (a, c, inner) in enumerate(spans):
        if a > at:
            pieces.append(Segment(at, a, False))
        policy = policies[k] if k < len(policies) else None
        pieces.append(Segment(a, c, True, pieces_of_spans(a, c, inner) if inner else (),
                              policy))
        at = c
    if stop > at:
        pieces.append(Segment(at, stop, False))
    return tuple(pieces)


def _names(names: Sequence[str], piece: Segment) -> list:
    out: list = []
    for p in piece.pieces:
        if p.checkpointed and p is not piece:
            out.append(_names(names, p))
        else:
            out.extend(names[p.start:p.stop])
    return out


def _count(pieces: tuple[Segment, ...], counts: list[int]) -> None:
    for piece in pieces:
        if piece.checkpointed:
            for k in range(piece.start, piece.stop):
                counts[k] += 1
            _count(piece.inner, counts)


def _depth(pieces: tuple[Segment, ...]) -> int:
    return max((1 + _depth(p.inner) for p in pieces if p.checkpointed), default=0)


def _piece_config(piece: Segment) -> list:
    return [piece.start, piece.stop, piece.checkpointed,
            [_piece_config(p) for p in piece.inner], save_policies.to_config(piece.policy)]


def _piece_of(config: Sequence[Any]) -> Segment:
    start, stop, checkpointed, inner, policy = config
    return Segment(start, stop, checkpointed, tuple(_piece_of(c) for c in inner),
                   save_policies.from_config(policy))
