"""The memory and time model of a chain, for the schedule solver (:mod:`._rotor`).

The model is the one the step runs in, as profiled (:mod:`..measuring._profile`): eager
backprop's, or a ``tf.function``'s (a graph keeps fewer intermediates),
including what our replay holds on top (the incoming gradient, the weight
gradients of later layers, and in eager mode the forward's output, which the
custom gradient's tape entry holds); its accuracy is in
docs/decisions/0007-rotor-for-chains.md. Under XLA the graph profile is scaled to
the measured XLA plain step.

With save policies (:mod:`..measuring._choices`), a layer may also run as a checkpointed
call of its own that keeps what its policy picks (``policy_kept`` bytes) and
replays the rest (``policy_cost`` seconds); the replay times are then the
measured ``tf.function`` step times, so that full replays and policies are
compared in the same unit.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from tf_checkpointing.planning.measuring._choices import PolicyChoices
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile
from tf_checkpointing.planning.plans._plan import Segment

__all__ = ["Chain", "fitted_chain", "predict_peak", "peak", "extra_seconds"]

_NEVER = 1e15  # bytes no segment's forward fits in


class Chain:
    """The profile as arrays, in bytes (and seconds for ``cost``).

    ``scale`` multiplies what was measured per layer (not the sizes of the
    tensors between layers): see :func:`fitted_chain`. ``choices`` adds the save
    policies each layer may run with.
    """

    def __init__(self, profile: ChainProfile, scale: float = 1.0,
                 choices: Optional[PolicyChoices] = None) -> None:
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
        # What replaying a layer costs: its forward timed alone (see untaped_pass),
        # or with policies the measured extra step time of a full replay (the
        # same unit as theirs).
        seconds = np.array([p.seconds for p in layers], float)
        if choices is not None:
            seconds = choices.replay_seconds
        # A small floor keeps the program from treating a cheap layer as free.
        self.cost = np.maximum(seconds, 0.05 * max(seconds.mean(), 1e-9))
        self.cost_prefix = np.concatenate([[0.0], np.cumsum(self.cost)])
        self.w_prefix = np.concatenate([[0.0], np.cumsum([p.weight_grad_bytes
                                                          for p in layers])])
        self.policies: tuple[Any, ...] = () if choices is None else choices.policies
        # [layer, policy]: bytes kept on top of a full replay's, and replay seconds.
        self.policy_kept = (np.zeros((self.n, 0)) if choices is None
                            else choices.kept_fraction * self.kept[:, None])
        self.policy_cost = (np.zeros((self.n, 0)) if choices is None
                            else np.maximum(choices.policy_seconds, 0.0))
        # untaped[s, e]: peak of running [s, e) without a tape, above x[s].
        n = self.n
        self.untaped = np.zeros((n + 1, n + 1))
        for s in range(n):
            running = 0.0
            for k in range(s, n):
                running = max(running, (self.x[k] if k > s else 0.0) + self.fwd0[k])
                self.untaped[s, k + 1] = running
        # No checkpointed segment starts among the layers no gradient reaches: a
        # finite "never fits" (the programs round bytes to integer units).
        self.untaped[:profile.frozen_prefix] = _NEVER

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

    def policy_index(self, policy: Any) -> int:
        return self.policies.index(policy)


def fitted_chain(profile: ChainProfile, choices: Optional[PolicyChoices] = None) -> Chain:
    """The model of ``profile``; for a graph, scaled down to predict the measured
    peak of the plain chain when it predicts more.

    A layer's graph, run alone, may start the backward ops that need no output
    gradient before the reading between forward and backward, so the per-layer
    readings can add up to more than the chain holds as one graph. One factor
    on the per-layer bytes, fitted to the plain chain, corrects it. The model is
    never scaled up for a graph: where it predicts less, the headroom of every
    plan covers the difference. For XLA it is (up to 3x): XLA assigns buffers
    its own way, and its plain step peaks above what the per-layer graphs add
    up to, so a plan from the graph's numbers overshot its budget (see
    docs/decisions/0008-chain-model-scale.md).
    """
    chain = Chain(profile, choices=choices)
    if not profile.compiled:
        return chain
    plain = (Segment(0, chain.n, False),)

    def plain_peak(chain: Chain) -> float:
        return peak(chain, plain, 0, chain.n) + chain.outside

    if plain_peak(chain) <= profile.plain_peak_bytes and not profile.xla:
        return chain
    low, high = 0.0, 3.0 if profile.xla else 1.0
    for _ in range(20):
        middle = (low + high) / 2
        if plain_peak(Chain(profile, middle, choices)) > profile.plain_peak_bytes:
            high = middle
        else:
            low = middle
    return Chain(profile, low, choices)


def predict_peak(profile: ChainProfile, pieces: tuple[Segment, ...],
                 choices: Optional[PolicyChoices] = None) -> int:
    """The peak the model predicts for running ``pieces`` as a training step."""
    chain = fitted_chain(profile, choices)
    return int(peak(chain, pieces, 0, chain.n) + chain.outside)


def peak(chain: Chain, pieces: tuple[Segment, ...], s: int, t: int) -> float:
    """The modelled peak of backpropagating ``pieces`` (covering ``[s, t)``) above
    what their left holds."""
    held, top, lefts = 0.0, 0.0, []
    for piece in pieces:
        lefts.append(held)
        if piece.checkpointed:
            top = max(top, held + chain.untaped[piece.start, piece.stop])
            held += chain.x[piece.stop] + _policy_kept(chain, piece)
        else:
            for k in range(piece.start, piece.stop):
                top = max(top, held + chain.fwd[k])
                held += chain.kept[k]
    for piece, left in zip(reversed(pieces), reversed(lefts)):
        if piece.checkpointed:
            # A policy's replay makes again what it did not keep: with what it
            # kept, the layer's plain working set.
            inner = peak(chain, piece.pieces, piece.start, piece.stop)
            top = max(top, left + chain.replay_held(piece.stop, t) + inner)
        else:
            for k in reversed(range(piece.start, piece.stop)):
                below = left + chain.kept[piece.start:k].sum()
                top = max(top, below + chain.plain_backward(k, t))
    return top


def extra_seconds(chain: Chain, pieces: tuple[Segment, ...]) -> float:
    """The replay time the model predicts for ``pieces`` (beyond one forward)."""
    total = 0.0
    for piece in pieces:
        if piece.checkpointed and piece.policy is not None:
            total += float(np.sum([chain.policy_cost[k, chain.policy_index(piece.policy)]
                                   for k in range(piece.start, piece.stop)]))
        elif piece.checkpointed:
            total += chain.cost_prefix[piece.stop] - chain.cost_prefix[piece.start]
            total += extra_seconds(chain, piece.inner)
    return float(total)


def _policy_kept(chain: Chain, piece: Segment) -> float:
    if piece.policy is None:
        return 0.0
    j = chain.policy_index(piece.policy)
    return float(chain.policy_kept[piece.start:piece.stop, j].sum())
