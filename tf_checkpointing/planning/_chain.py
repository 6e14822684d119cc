"""Where the checkpoints go: the schedule with least recomputation within a memory budget.

Splitting a chain of ``N`` equal layers into ``sqrt(N)`` checkpointed segments
(Chen et al. 2016) is the right answer for one memory level only, and for equal
layers only. Real chains are not equal (a stem keeps 4x the bytes of a head,
attention keeps more than a feed-forward), and a budget may sit anywhere
between "store nothing but one input" and "store everything". This module
measures the real layers once (:mod:`tf_checkpointing.planning._profile`) and solves
for the schedule exactly, with the dynamic program of Beaumont et al. 2019
("Optimal checkpointing for heterogeneous chains", the *rotor* algorithm) over
the chain of unequal layers:

``opt(s, t, m)``, the least forward work to backprop layers ``[s, t)`` given
their input is held and ``m`` bytes are free, takes the better of

* run layer ``s`` on the tape, keeping its activations, and solve ``[s+1, t)``
  with ``m - kept[s]``; or
* run ``[s, s')`` as a checkpointed segment (keeping only its output ``x[s']``),
  solve ``[s', t)`` with ``m - bytes(x[s'])``, then replay ``[s, s')`` with the
  memory left once the right part is done: ``opt(s, s', m - grad bytes)``,
  which may checkpoint again, inside.

The second branch is what makes checkpoints nest: at a tight budget a replay
itself stores only a few inputs (down to ``O(log N)`` for ``O(N log N)`` work,
or one input for ``O(N^2)`` at the very minimum), and each level of nesting is
one more :func:`~tf_checkpointing._recompute.checkpointed_call` around a part
of the replay. Memory is counted in ``M`` units of the budget (sizes rounded
up, so a plan never exceeds its budget in the model); a second program finds
the least memory any schedule needs, which the error for a budget below it
reports.

The memory model is the one the step runs in, as profiled: eager backprop's,
or a ``tf.function``'s (``mode="graph"``; a graph keeps fewer intermediates,
so the same budget leaves more layers plain), including what our replay holds
on top (the incoming gradient, the weight gradients of later layers, and in
eager mode the forward's output, which the custom gradient's tape entry
holds). Measured on a 64-layer chain (``benchmarks/sequential.py``) it
predicts peaks within 10% in eager mode and 5% under ``tf.function`` (a
fragmented allocator adds up to ~20%, so plans keep 10% of the budget free).
Under XLA (``mode="xla"``) the graph profile is scaled to the measured XLA plain step.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_checkpointing.planning._plan import Segment, SequentialPlan
from tf_checkpointing.planning._profile import (
    ChainProfile,
    in_xla_context,
    profile_chain,
    route_keywords,
    validate_layers,
)

__all__ = ["plan_sequential"]

_API = "plan_sequential"
_MAX_UNITS = 1000
_HEADROOM = 0.10
_CACHE_SIZE = 16
# (layer ids, input shapes and dtypes, keywords) -> (layers, profile, {budget: plan})
_profiles: collections.OrderedDict = collections.OrderedDict()


_MODES = ("auto", "eager", "graph", "xla")


def plan_sequential(layers: Any, inputs: Any, *, budget: float, mode: str = "auto",
                    **kwargs: Any) -> SequentialPlan:
    """Plans the checkpoints of a chain of layers for a memory budget.

    Profiles the chain once on ``inputs`` (each layer's forward and backward,
    measured with the device allocator; the state the layers change is put
    back), then finds the schedule, nested checkpoints included, that
    recomputes the least forward work while its peak stays within ``budget``.
    A budget at or above the plain step's peak recomputes nothing.

    Args:
        layers: the chain: Keras layers or callables, each fed the previous output.
        inputs: the chain's input, a tensor or a nested structure of tensors, at
            the batch size training uses (the plan is for these shapes).
        budget: bytes the training step may allocate on top of what is allocated
            before it (weights, inputs): activations, stored checkpoints,
            gradients.
        mode: how the training step runs, which decides what backprop keeps:
            ``"eager"``; ``"graph"`` for a ``tf.function`` (``Model.fit``
            included), whose graph keeps fewer intermediates, so the same budget
            leaves more layers un-checkpointed; ``"auto"`` (the default):
            ``"graph"`` when called while a ``tf.function`` is being traced,
            else ``"eager"``; ``"xla"`` for a ``jit_compile=True`` step (also
            chosen by ``"auto"`` while one is traced): a graph profile scaled to
            the measured XLA plain step.
        **kwargs: keywords for the layers, e.g. ``training=True``; each layer gets
            those its call accepts, as in :func:`checkpoint_sequential`.

    Returns:
        A :class:`SequentialPlan`; pass its ``budget`` to
        :func:`checkpoint_sequential` or read ``segments``, ``predicted_peak_bytes``
        and ``extra_forward_layers``.

    Raises:
        ValueError: the budget is below the least memory any schedule needs (the
            message gives it), or not a positive number.

    Example (on CPU, with ``TF_CPU_ALLOCATOR_USE_BFC=true`` set before TensorFlow
    is imported):
        >>> import keras, tensorflow as tf
        >>> from tf_checkpointing import plan_sequential
        >>> layers = [keras.layers.Dense(64, activation="relu") for _ in range(16)]
        >>> x = tf.random.normal([1024, 64])
        >>> plan = plan_sequential(layers, x, budget=4 * 2**20)
        >>> plan.predicted_peak_bytes <= 4 * 2**20 < plan.plain_peak_bytes
        True
        >>> plan.segments[0][0], plan.segments[-1][1], plan.extra_forward_layers > 0
        (0, 16, True)
    """
    layers = validate_layers(layers, _API)
    budget = _expect_budget(budget, _API)
    if mode not in _MODES:
        raise ValueError(
            f"{_API}: argument `mode` must be one of {', '.join(map(repr, _MODES))}; "
            f"received mode={mode!r}. Pass mode='graph' when the training step is a "
            "tf.function (or Model.fit), mode='xla' when it is compiled with "
            "jit_compile=True, mode='eager' when it runs eagerly."
        )
    return cached_plan(layers, inputs, budget, kwargs, route_keywords(layers, kwargs, _API),
                       api=_API, mode=mode)


def cached_plan(layers: list[Any], inputs: Any, budget: int, kwargs: dict[str, Any],
                routed: list[dict], *, api: str, mode: str = "auto") -> SequentialPlan:
    """The plan for ``budget``, profiling the chain only the first time it is
    seen with these input shapes, keywords and mode (the last 16 chains are
    kept). ``mode="auto"`` plans for a graph while a ``tf.function`` is traced."""
    compiled = mode in ("graph", "xla") or (mode == "auto" and tf.inside_function())
    xla = mode == "xla" or (mode == "auto" and in_xla_context())
    signature = tuple((tuple(leaf.shape), leaf.dtype.name) if hasattr(leaf, "dtype")
                      else _hashable(leaf) for leaf in tf.nest.flatten(inputs))
    key = (tuple(id(layer) for layer in layers), signature,
           tuple(sorted((k, _hashable(v)) for k, v in kwargs.items())), compiled, xla)
    entry = _profiles.get(key)
    if entry is None:
        calls = [functools.partial(_call, layer, kw) for layer, kw in zip(layers, routed)]
        names = [getattr(layer, "name", None) or getattr(layer, "__name__", None)
                 or type(layer).__name__ for layer in layers]
        profile = profile_chain(calls, inputs, names=names, api=api, compiled=compiled,
                                xla=xla)
        # The layers are kept alive with the entry, so their ids stay theirs.
        entry = _profiles[key] = (list(layers), profile, {})
        if len(_profiles) > _CACHE_SIZE:
            _profiles.popitem(last=False)
    _profiles.move_to_end(key)
    plans: dict[int, SequentialPlan] = entry[2]
    if budget not in plans:
        plans[budget] = solve(entry[1], budget, api=api)
    return plans[budget]


def _call(layer: Any, kw: dict, x: Any) -> Any:
    return layer(x, **kw)


def _hashable(value: Any) -> Any:
    if isinstance(value, (tf.Tensor, tf.Variable)):
        return ("tensor", tuple(value.shape), value.dtype.name)
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def _expect_budget(budget: Any, api: str) -> int:
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer,
                                                          np.floating)):
        raise TypeError(
            f"{api}: argument `budget` must be a number of bytes; received {budget!r} of "
            f"type {type(budget).__name__}. Pass e.g. budget=512 * 2**20 for 512 MiB."
        )
    if not (budget > 0 and math.isfinite(budget)):
        raise ValueError(
            f"{api}: argument `budget` must be a positive, finite number of bytes; "
            f"received budget={budget!r}. Pass e.g. budget=512 * 2**20 for 512 MiB, or "
            "no budget (segments=...)."
        )
    return int(budget)


class _Chain:
    """The profile as arrays, in bytes (and seconds for ``cost``).

    ``scale`` multiplies what was measured per layer (not the sizes of the
    tensors between layers): see :func:`_fitted_chain`.
    """

    def __init__(self, profile: ChainProfile, scale: float = 1.0) -> None:
        layers = profile.layers
        self.n = len(layers)
        self.kept = scale * np.array([p.kept_bytes for p in layers], float)
        self.fwd = scale * np.array([p.forward_peak_bytes for p in layers], float)
        self.fwd0 = scale * np.array([p.untaped_peak_bytes for p in layers], float)
        self.bwd = scale * np.array([p.backward_peak_bytes for p in layers], float)
        # Eager: the custom gradient's tape entry holds a checkpointed segment's
        # output until its backward; a graph frees it after its last reader.
        self.holds_output = not profile.compiled
        self.x = np.array(profile.boundary_bytes, float)
        self.dx = np.array(profile.boundary_grad_bytes, float)
        # Held by the caller through the whole backward: the gradient of the
        # chain's output (the output itself is counted with the last piece).
        self.outside = self.dx[self.n]
        # A small floor keeps the program from treating a cheap layer as free.
        seconds = np.array([p.seconds for p in layers], float)
        self.cost = np.maximum(seconds, 0.05 * max(seconds.mean(), 1e-9))
        self.cost_prefix = np.concatenate([[0.0], np.cumsum(self.cost)])
        self.w_prefix = np.concatenate([[0.0], np.cumsum([p.weight_grad_bytes
                                                          for p in layers])])
        # untaped[s, e]: peak of running [s, e) without a tape, above x[s].
        n = self.n
        self.untaped = np.zeros((n + 1, n + 1))
        for s in range(n):
            running = 0.0
            for k in range(s, n):
                running = max(running, (self.x[k] if k > s else 0.0) + self.fwd0[k])
                self.untaped[s, k + 1] = running

    def weight_grads(self, s: Any, t: int) -> Any:
        return self.w_prefix[t] - self.w_prefix[s]

    def replay_held(self, mid: Any, t: int) -> Any:
        """Held while ``[s, mid)`` is replayed inside ``[s, t)``, above its left: the
        gradient of its output, the weight gradients of ``[mid, t)``, and (in
        eager mode, held by the custom gradient) its forward's output."""
        grad_in = np.where(np.asarray(mid) < t, self.dx[mid], 0.0)
        output = self.x[mid] if self.holds_output else 0.0
        return grad_in + output + self.weight_grads(mid, t)

    def plain_backward(self, s: int, t: int) -> float:
        """Peak of layer s's backward inside [s, t), above what its left holds."""
        grad_in = self.dx[s + 1] if s + 1 < t else 0.0
        return self.kept[s] + grad_in + self.weight_grads(s + 1, t) + self.bwd[s]


def _fitted_chain(profile: ChainProfile) -> _Chain:
    """The model of ``profile``; for a graph, scaled down to predict the measured
    peak of the plain chain when it predicts more.

    A layer's graph, run alone, may start the backward ops that need no output
    gradient before the reading between forward and backward, so the per-layer
    readings can add up to more than the chain holds as one graph (measured:
    1.00-1.15x on the benchmark models and test chains). One factor on the
    per-layer bytes, fitted to the plain chain, corrects it. The model is never
    scaled up for a graph: where it predicts less (0.93x on the U-Net), the 10%
    headroom of every plan covers the difference. For XLA it is (up to 3x):
    XLA assigns buffers its own way, and its plain step peaks above what the
    per-layer graphs add up to (EfficientNetB0 in blocks: 512 MiB plain), so
    a plan from the graph's numbers overshot its budget 2.4x there.
    """
    chain = _Chain(profile)
    if not profile.compiled:
        return chain
    plain = (Segment(0, chain.n, False),)

    def plain_peak(chain: _Chain) -> float:
        return _peak(chain, plain, 0, chain.n) + chain.outside

    if plain_peak(chain) <= profile.plain_peak_bytes and not profile.xla:
        return chain
    low, high = 0.0, 3.0 if profile.xla else 1.0
    for _ in range(20):
        middle = (low + high) / 2
        if plain_peak(_Chain(profile, middle)) > profile.plain_peak_bytes:
            high = middle
        else:
            low = middle
    return _Chain(profile, low)


def predict_peak(profile: ChainProfile, pieces: tuple[Segment, ...]) -> int:
    """The peak the model predicts for running ``pieces`` as a training step."""
    chain = _fitted_chain(profile)
    return int(_peak(chain, pieces, 0, chain.n) + chain.outside)


def _peak(chain: _Chain, pieces: tuple[Segment, ...], s: int, t: int) -> float:
    held, peak, lefts = 0.0, 0.0, []
    for piece in pieces:
        lefts.append(held)
        if piece.checkpointed:
            peak = max(peak, held + chain.untaped[piece.start, piece.stop])
            held += chain.x[piece.stop]
        else:
            for k in range(piece.start, piece.stop):
                peak = max(peak, held + chain.fwd[k])
                held += chain.kept[k]
    for piece, left in zip(reversed(pieces), reversed(lefts)):
        if piece.checkpointed:
            inner = _peak(chain, piece.pieces, piece.start, piece.stop)
            peak = max(peak, left + chain.replay_held(piece.stop, t) + inner)
        else:
            for k in reversed(range(piece.start, piece.stop)):
                below = left + chain.kept[piece.start:k].sum()
                peak = max(peak, below + chain.plain_backward(k, t))
    return peak


def solve(profile: ChainProfile, budget: int, *, api: str = _API) -> SequentialPlan:
    """The plan with least recomputation for ``budget``, from a profile."""
    chain = _fitted_chain(profile)
    n = chain.n
    plain = (Segment(0, n, False),)
    plain_peak = profile.plain_peak_bytes
    min_peak, min_pieces = _least_memory(chain)
    # Plans keep some of the budget free: the allocator hands out whole blocks
    # (up to twice a tensor's size) once it is fragmented, which no per-layer
    # profile sees (measured: eager peaks up to ~20% above the prediction late
    # in a long-running process, within 3% in a fresh one).
    min_budget = min(plain_peak, int(math.ceil((min_peak + chain.outside) / (1 - _HEADROOM))))
    plan = SequentialPlan(num_layers=n, pieces=plain, budget_bytes=budget,
                          predicted_peak_bytes=plain_peak, plain_peak_bytes=plain_peak,
                          min_budget_bytes=min_budget, profile=profile)
    if budget >= plain_peak:
        return plan
    if budget < min_budget:
        raise ValueError(
            f"{api}: argument `budget` is below the least memory any checkpointing "
            f"schedule of these {n} layers needs (its least peak, plus "
            f"{_HEADROOM:.0%} for the allocator): expected at least {min_budget} bytes "
            f"({min_budget / 2**20:.2f} MiB), received budget={budget} "
            f"({budget / 2**20:.2f} MiB). Raise the budget to at least {min_budget}, or "
            "make the step smaller (a smaller batch, or split the largest layer)."
        )
    usable = budget * (1 - _HEADROOM)
    pieces = _least_work(chain, usable - chain.outside) or min_pieces
    return dataclasses.replace(plan, pieces=pieces, predicted_peak_bytes=int(
        _peak(chain, pieces, 0, n) + chain.outside))


def _least_memory(chain: _Chain) -> tuple[float, tuple[Segment, ...]]:
    """Least peak of any schedule (ties: least work), and that schedule."""
    n = chain.n
    peak = np.full((n + 1, n + 1), np.inf)
    work = np.full((n + 1, n + 1), np.inf)
    choice = np.full((n + 1, n + 1), -1, int)
    for t in range(1, n + 1):
        for s in range(t - 1, -1, -1):
            rest_peak = peak[s + 1, t] if s + 1 < t else 0.0
            rest_work = work[s + 1, t] if s + 1 < t else 0.0
            best = max(chain.fwd[s], chain.kept[s] + rest_peak, chain.plain_backward(s, t))
            best_work, best_choice = chain.cost[s] + rest_work, -1
            for mid in range(s + 1, t):
                value = max(chain.untaped[s, mid], chain.x[mid] + peak[mid, t],
                            chain.replay_held(mid, t) + peak[s, mid])
                value_work = (chain.cost_prefix[mid] - chain.cost_prefix[s] + work[mid, t]
                              + work[s, mid])
                if value < best * (1 - 1e-9) or (value <= best * (1 + 1e-9)
                                                  and value_work < best_work):
                    best, best_work, best_choice = value, value_work, mid
            peak[s, t], work[s, t], choice[s, t] = best, best_work, best_choice

    def build(s: int, t: int) -> tuple[Segment, ...]:
        pieces = []
        while s < t:
            mid = int(choice[s, t])
            if mid < 0:
                pieces.append(Segment(s, s + 1, False))
                s += 1
            else:
                pieces.append(Segment(s, mid, True, _inner(build(s, mid))))
                s = mid
        return _merge(pieces)

    return float(peak[0, n]), build(0, n)


def _least_work(chain: _Chain, available: float) -> Optional[tuple[Segment, ...]]:
    """The rotor program in ``units`` of memory; None if nothing fits."""
    n = chain.n
    units = int(max(50, min(_MAX_UNITS, 3e7 // ((n + 1) ** 2))))
    unit = available / units
    up = lambda v: np.ceil(np.asarray(v) / unit - 1e-9).astype(int)  # noqa: E731
    m = np.arange(units + 1)
    # opt[s, t, pad + m]: least work for [s, t) with m units free; the first
    # `pad` entries are infinite, so that a shift by k reads opt[.., pad + m - k].
    pad = units + 1
    opt = np.full((n + 1, n + 1, pad + units + 1), np.inf, np.float32)
    choice = np.full((n + 1, n + 1, units + 1), -1, np.int16)
    kept_u, x_u = up(chain.kept), up(chain.x)

    def shifted(rows: np.ndarray, by: np.ndarray) -> np.ndarray:
        """rows[i, pad + m - by[i]] for each row i and each m."""
        index = pad + m[None, :] - np.minimum(by, pad)[:, None]
        return rows[np.arange(len(rows))[:, None], index]

    for t in range(1, n + 1):
        for s in range(t - 1, -1, -1):
            need = max(up(chain.fwd[s]), up(chain.plain_backward(s, t)))
            if s + 1 < t:
                rest = opt[s + 1, t, pad + m - min(kept_u[s], pad)]
            else:
                rest = np.where(m >= kept_u[s], 0.0, np.inf)
            best = np.where(m >= need, chain.cost[s] + rest, np.inf)
            pick = np.full(units + 1, -1, np.int16)
            if s + 1 < t:
                mids = np.arange(s + 1, t)
                right = shifted(opt[mids, t], x_u[mids])
                held = up(chain.replay_held(mids, t))
                left = shifted(opt[s, mids], held)
                total = (chain.cost_prefix[mids] - chain.cost_prefix[s])[:, None] + right + left
                total[m[None, :] < up(chain.untaped[s, mids])[:, None]] = np.inf
                k = np.argmin(total, axis=0)
                value = total[k, m]
                better = value < best * (1 - 1e-6)
                best = np.where(better, value, best)
                pick = np.where(better, mids[k], pick).astype(np.int16)
            opt[s, t, pad:], choice[s, t] = best, pick
    if not np.isfinite(opt[0, n, pad + units]):
        return None

    def build(s: int, t: int, free: int) -> tuple[Segment, ...]:
        pieces = []
        while s < t:
            mid = int(choice[s, t, free])
            if mid < 0:
                pieces.append(Segment(s, s + 1, False))
                free -= kept_u[s]
                s += 1
            else:
                held = int(up(chain.replay_held(mid, t)))
                pieces.append(Segment(s, mid, True, _inner(build(s, mid, free - held))))
                free -= x_u[mid]
                s = mid
        return _merge(pieces)

    return build(0, n, units)


def _inner(pieces: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """A replay that runs all its layers plainly needs no inner description."""
    return () if all(not p.checkpointed for p in pieces) else pieces


def _merge(pieces: list[Segment]) -> tuple[Segment, ...]:
    """Joins runs of plain single layers into one plain piece."""
    merged: list[Segment] = []
    for piece in pieces:
        if merged and not piece.checkpointed and not merged[-1].checkpointed:
            merged[-1] = Segment(merged[-1].start, piece.stop, False)
        else:
            merged.append(piece)
    return tuple(merged)
