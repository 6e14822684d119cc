"""The plan: which layers of a chain run as checkpointed segments, nested how.

A :class:`SequentialPlan` is a contiguous cover of a chain by :class:`Segment`
pieces; a checkpointed piece keeps only its input and is replayed in backprop,
possibly with checkpoints of its own inside (``inner``). :func:`even_plan`
makes the fixed ``segments=k`` schedule; :mod:`tf_checkpointing.planning._chain`
solves for one within a memory budget. A :class:`ModelPlan` is the whole-model
counterpart: which runs of a functional model's layer calls are checkpointed
(:mod:`tf_checkpointing.planning._model`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from tf_checkpointing.planning._layer_profile import ChainProfile

__all__ = ["ModelPlan", "SequentialPlan", "Segment"]


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers ``[start, stop)`` of a chain, run plainly or as one checkpointed call.

    Attributes:
        start, stop: the layers it runs.
        checkpointed: whether it keeps only its input and is replayed in backprop.
        inner: for a checkpointed segment, the pieces its replay runs (nested
            checkpoints); empty when the replay runs its layers plainly.
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
class SequentialPlan:
    """A checkpointing schedule for a chain of ``num_layers`` layers.

    Attributes:
        num_layers: length of the chain.
        pieces: the top level, a contiguous cover of the chain by :class:`Segment`.
        budget_bytes: the budget it was planned for: bytes, ``"min"`` (the least
            memory), or None (fixed segments).
        predicted_peak_bytes: the step's peak memory above what is allocated
            before it, as the profile predicts it (None without a profile).
        plain_peak_bytes: measured peak of the step without checkpointing.
        min_budget_bytes: least memory of any schedule (the smallest budget).
        profile: the per-layer measurements it was planned from.
        policies: the save policies the planner could choose per segment (see
            ``Segment.policy``); empty when it chose only between plain and full
            replays.
        predicted_extra_seconds: the replay time per step the plan adds, as the
            planner's time model predicts it (with ``policies``: measured
            ``tf.function`` step times; else eager forward times).
    """

    num_layers: int
    pieces: tuple[Segment, ...]
    budget_bytes: Optional[Union[int, str]] = None
    predicted_peak_bytes: Optional[int] = None
    plain_peak_bytes: Optional[int] = None
    min_budget_bytes: Optional[int] = None
    profile: Optional[ChainProfile] = dataclasses.field(default=None, repr=False)
    policies: tuple[Any, ...] = ()
    predicted_extra_seconds: Optional[float] = None

    @property
    def segments(self) -> list[tuple[int, int]]:
        """The top level: ``(start, stop)`` of each piece, covering the chain."""
        return [(p.start, p.stop) for p in self.pieces]

    @property
    def checkpointed(self) -> list[bool]:
        """For each of ``segments``, whether it is checkpointed."""
        return [p.checkpointed for p in self.pieces]

    @property
    def forward_counts(self) -> list[int]:
        """How many times each layer's forward runs in one training step."""
        counts = [1] * self.num_layers
        _count(self.pieces, 0, counts)
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
        mib = lambda n: "?" if n is None else f"{n / 2**20:.2f} MiB"  # noqa: E731
        head = f"SequentialPlan: {self.num_layers} layers"
        if self.budget_bytes is not None:
            budget = "min" if self.budget_bytes == "min" else mib(self.budget_bytes)
            head += (f", budget {budget} -> predicted peak "
                     f"{mib(self.predicted_peak_bytes)} (plain {mib(self.plain_peak_bytes)},"
                     f" least budget {mib(self.min_budget_bytes)})")
        head += (f"; {self.extra_forward_layers} extra layer forwards "
                 f"({sum(self.forward_counts) / self.num_layers:.2f}x forward)")
        if self.policies:
            head += f"; policies to choose from: {', '.join(map(policy_name, self.policies))}"
        if self.predicted_extra_seconds:
            head += f"; predicted replay time {self.predicted_extra_seconds * 1e3:.1f} ms"
        return "\n".join([head] + _describe(self.pieces, "  "))


def _count(pieces: tuple[Segment, ...], depth: int, counts: list[int]) -> None:
    for piece in pieces:
        if piece.checkpointed:
            for k in range(piece.start, piece.stop):
                counts[k] += 1
            _count(piece.inner, depth + 1, counts)


def _depth(pieces: tuple[Segment, ...]) -> int:
    return max((1 + _depth(p.inner) for p in pieces if p.checkpointed), default=0)


def _describe(pieces: tuple[Segment, ...], indent: str) -> list[str]:
    lines = []
    for p in pieces:
        kind = "checkpointed" if p.checkpointed else "plain"
        if p.checkpointed and p.policy is not None:
            kind += f" with {policy_name(p.policy)}"
        lines.append(f"{indent}[{p.start}, {p.stop}) {kind} ({p.stop - p.start} layers)")
        lines.extend(_describe(p.inner, indent + "  "))
    return lines


def policy_name(policy: Any) -> str:
    """How a plan shows a policy: its function's name (with the names a name
    policy keeps), else its repr."""
    config = getattr(policy, "_config", None)
    if config:
        return f"{config[0]}({', '.join(map(repr, config[1]))})"
    return getattr(policy, "__name__", None) or repr(policy)


def even_plan(num_layers: int, segments: int) -> SequentialPlan:
    """``segments`` pieces of (nearly) equal length; all but the last checkpointed
    (the last one's replay would start right away: it would save nothing)."""
    bounds = [round(i * num_layers / segments) for i in range(segments + 1)]
    pieces = tuple(Segment(bounds[i], bounds[i + 1], i < segments - 1)
                   for i in range(segments))
    return SequentialPlan(num_layers=num_layers, pieces=pieces)


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """Which runs of a model's layer calls are checkpointed.

    Attributes:
        call_names: the layer name of each call of the flattened graph, in run order.
        spans: ``(start, stop, inner)`` call ranges run as one checkpointed
            region each; ``inner`` are regions checkpointed inside its replay
            (the same triples; empty when the replay runs its calls plainly).
        mode: the step it was planned for: ``"eager"``, ``"graph"`` or ``"xla"``.
        budget_bytes: the budget (None for ``"min"``).
        predicted_peak_bytes: the step's peak above what is allocated before it,
            as the model predicts it.
        plain_peak_bytes: measured peak of the plain step.
        min_budget_bytes: the least budget accepted: the least predicted peak of any
            plan, plus 10% headroom for the allocator.
        region_policies: per span, the save policy its replay keeps what it picks
            with (:mod:`tf_checkpointing.policies`), or None for a full replay;
            empty: every region is replayed fully.
        policies: the save policies the planner could choose per region; empty
            when it chose only between plain calls and full replays.
        predicted_extra_seconds: the replay time per step the plan adds, as the
            planner's time model predicts it (each call's forward time; under a
            policy, scaled by the measured ratio of its replay time to a full
            replay's).
        call_kinds: per call, its layer's class and configuration (but the name)
            and the calls it reads: another instance of the same architecture,
            whose layers Keras numbered differently (``conv2d_54`` for
            ``conv2d_1``), takes the plan too.

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

    call_names: tuple[str, ...]
    spans: tuple
    mode: str
    budget_bytes: Optional[int]
    predicted_peak_bytes: int
    plain_peak_bytes: int
    min_budget_bytes: int
    region_policies: tuple[Any, ...] = ()
    policies: tuple[Any, ...] = ()
    predicted_extra_seconds: Optional[float] = None
    call_kinds: tuple[str, ...] = dataclasses.field(default=(), repr=False)

    def policy_of(self, k: int) -> Any:
        """The save policy of span ``k`` (None: a full replay)."""
        return self.region_policies[k] if k < len(self.region_policies) else None

    @property
    def regions(self) -> list[list[str]]:
        """Each checkpointed region as the names of its layers, in run order."""
        return [self._names(a, c, inner) for a, c, inner in self.spans]

    def _names(self, start: int, stop: int, inner: tuple) -> list:
        """Names of ``[start, stop)``, inner regions as nested lists."""
        out: list = []
        at = start
        for a, c, deeper in inner:
            out.extend(self.call_names[at:a])
            out.append(self._names(a, c, deeper))
            at = c
        return out + list(self.call_names[at:stop])

    @property
    def extra_forward_layers(self) -> int:
        """Layer calls recomputed per training step."""
        def count(spans: tuple) -> int:
            return sum(c - a + count(inner) for a, c, inner in spans)

        return count(self.spans)

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
        budget = "min" if self.budget_bytes is None else mib(self.budget_bytes)
        lines = [f"ModelPlan ({self.mode}): {len(self.call_names)} layer calls, budget "
                 f"{budget} -> predicted peak {mib(self.predicted_peak_bytes)} (plain "
                 f"{mib(self.plain_peak_bytes)}, least budget {mib(self.min_budget_bytes)}); "
                 f"{len(self.spans)} checkpointed regions, {self.extra_forward_layers} "
                 "extra layer forwards"]
        if self.policies:
            lines[0] += ("; policies to choose from: "
                         f"{', '.join(map(policy_name, self.policies))}")
        if self.predicted_extra_seconds:
            lines[0] += f"; predicted replay time {self.predicted_extra_seconds * 1e3:.1f} ms"
        self._describe(self.spans, "  ", lines, self.region_policies)
        return "\n".join(lines)

    def _describe(self, spans: tuple, indent: str, lines: list,
                  policies: tuple = ()) -> None:
        for k, (a, c, inner) in enumerate(spans):
            names = list(self.call_names[a:c])
            shown = names if len(names) <= 4 else names[:2] + ["..."] + names[-1:]
            policy = policies[k] if k < len(policies) else None
            kept = f", replayed with {policy_name(policy)}" if policy is not None else ""
            lines.append(f"{indent}[{', '.join(shown)}] ({len(names)} layers{kept}"
                         f"{', with checkpoints inside:' if inner else ''})")
            self._describe(inner, indent + "  ", lines)
