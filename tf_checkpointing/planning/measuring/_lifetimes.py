"""How long each tensor of a layer graph lives, for the region model.

The memory model of :mod:`..solving._regions` asks, for every run ``[a, c)`` of layer
calls: which bytes made inside it are still needed after it, which are needed
only by the forward, what its replay must copy and keep of its inputs, and
which backward passes run beside each other. Those answers depend only on the
graph (who makes, reads and saves each tensor) and on the per-call profile,
not on the plan, so they are computed once here, as ``(n + 1) x (n + 1)``
tables over pairs of cuts.

Everything here was checked against allocator traces of real steps (the
TensorFlow profiler's allocation events): a model that counted every output a
replay makes (BatchNorm and ``Add`` outputs, which no backward reads and the
executor frees at once) and both a region's inputs and their copies predicted
plans far above the peak of their tensors; one that missed parallel branches'
backward passes running at once, below it (see docs/decisions/0018-memory-model.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["GraphCosts", "Lifetimes", "concurrent_backward"]


@dataclasses.dataclass
class GraphCosts:
    """The numbers the program needs, per call ``i`` (``n`` calls) and per tensor.

    ``kept, fwd, fwd0, bwd, wgrad, cost``: per call (from the profile);
    ``bwd_alone``: per call, the backward alone above what the forward kept (see
    :class:`~tf_checkpointing.planning.measuring._layer_profile.LayerProfile`).
    ``own_wgrad``: per call, the weight-gradient bytes a replay holds until its
    backward ends (a compiled step's; eager steps count them in ``wgrad``).
    ``dx``: ``n + 1`` gradient bytes of the tensors alive at each cut.
    ``size, producer, last, readers``: per tensor: bytes, the call making it
    (-1 for a model input), the last call reading it (``n`` for an output),
    and whether it is floating (``floating``).
    ``savers``: per tensor, every call whose backward reads it, in order (its
    producer when its own backward does, ``n`` for an output); None: every
    reader's backward is taken to read it up to its last reader (``last``).
    """

    kept: np.ndarray
    fwd: np.ndarray
    fwd0: np.ndarray
    bwd: np.ndarray
    wgrad: np.ndarray
    cost: np.ndarray
    dx: np.ndarray
    size: np.ndarray
    producer: np.ndarray
    last: np.ndarray
    readers: list
    floating: np.ndarray
    own_wgrad: Optional[np.ndarray] = None
    savers: Optional[list] = None
    # Per call, its backward's own peak above what its forward kept and its output
    # gradient (LayerProfile.backward_alone_bytes); None: not measured (eager).
    bwd_alone: Optional[np.ndarray] = None
    # [call, policy]: bytes a region replayed under the policy keeps of the
    # call on top of its inputs, and the call's replay seconds under it.
    policy_kept: Optional[np.ndarray] = None
    policy_cost: Optional[np.ndarray] = None

    @property
    def n(self) -> int:
        return len(self.kept)


class Lifetimes:
    """The tables (see the module): ``live``, ``held_live``, ``passing``,
    ``kept_in``, ``free_out``, ``enter``, ``double`` and ``beside``.

    ``live[a, i]``: bytes made by calls ``[a, i)`` still read at or after cut ``i``.
    """

    def __init__(self, costs: GraphCosts) -> None:
        n = self.n = costs.n
        # by_made_alive[p + 1, i]: bytes made by call p (row 0: inputs) alive at cut i.
        by_made_alive = np.zeros((n + 1, n + 1))
        for size, p, last in zip(costs.size, costs.producer, costs.last):
            by_made_alive[p + 1, p + 1:last + 1] += size
        made_prefix = np.vstack([np.zeros((1, n + 1)), np.cumsum(by_made_alive, axis=0)])
        rows = np.arange(n + 1)
        self.live = made_prefix[rows[None, :] + 1, rows[None, :]] - made_prefix[rows[:, None] + 1,
                                                                                 rows[None, :]]
        self._forward_only(costs)
        self._inputs(costs)
        self.beside = concurrent_backward(costs)

    def _forward_only(self, costs: GraphCosts) -> None:
        """The tables of tensors that no backward after some cut reads.

        A tensor made in ``[a, c)`` and read after ``c`` only by calls whose
        backward does not read it (a skip connection read by ``Concatenate``) is free
        once the forward read it: the region does not hold it for the backward
        (``held_live``). If a later region reads it, that region keeps it as
        its input until its backward (``kept_in``: charged there, not where it
        was made). In the forward it is alive until its last read
        (``passing``: counted in the forward peaks of the calls it passes).
        """
        n = self.n
        # The last call whose backward reads each tensor (-1: none).
        saver = costs.last if costs.savers is None else np.minimum(
            np.array([max(s, default=-1) for s in costs.savers]), costs.last)
        rows = np.arange(n + 1)
        held_alive = np.zeros((n + 1, n + 1))   # as by_made_alive, until the last saver
        free_alive = np.zeros((n + 1, n + 1))   # alive in the forward, past the last saver
        self.kept_in = np.zeros((n + 1, n + 1))
        for t, (size, p, last) in enumerate(zip(costs.size, costs.producer, costs.last)):
            if p < 0:  # a model input: allocated before the step, never counted
                continue
            held_alive[p + 1, p + 1:saver[t] + 1] += size
            free_alive[p + 1, max(p, saver[t]) + 1:last + 1] += size
            reads = sorted(r for r in costs.readers[t] if r > saver[t] and r > p)
            # A region [a, c) with a > saver[t] reading it keeps it (its first read r >= a).
            at = 0
            for a in range(max(p, saver[t]) + 1, (reads[-1] + 1) if reads else 0):
                while reads[at] < a:
                    at += 1
                self.kept_in[a, reads[at] + 1:] += size
        held_prefix = np.vstack([np.zeros((1, n + 1)), np.cumsum(held_alive, axis=0)])
        self.held_live = (held_prefix[rows[None, :] + 1, rows[None, :]]
                          - held_prefix[rows[:, None] + 1, rows[None, :]])
        # passing[a, k]: forward-only bytes made before a, alive at cut k.
        self.passing = np.vstack([np.zeros((1, n + 1)), np.cumsum(free_alive, axis=0)])[1:]
        # Outputs of plain call k that no backward reads: not held by its tape.
        free_out = np.zeros(n)
        for size, p, s in zip(costs.size, costs.producer, saver):
            if p >= 0 and s < p:  # s == p: the call's own backward reads it (relu)
                free_out[p] += size
        self.free_out = free_out

    def _inputs(self, costs: GraphCosts) -> None:
        """The tables of a region's inputs during its replay.

        The replay starts with a fresh copy of each floating input (``enter``:
        the copies; ``kept_in``: originals the region alone kept, see
        :meth:`_forward_only`), and the original is freed once copied unless
        another backward still to come reads it. A copy lives on only while a
        backward inside the region reads it. So while the region's calls run
        their backward, an input costs nothing beyond what the program already
        holds for it (its original, held for the backward reading it) except
        when both live: some call of the region saves it *and* a backward
        before the region (or the step's end, for a model output) still needs
        the original (``double``; a residual block's input, saved by the block's
        first convolution inside the region and by the ReLU that made it, before).
        """
        n = self.n
        savers = costs.savers if costs.savers is not None else [
            [int(s)] if s >= 0 else [] for s in costs.last]
        self.enter = np.zeros((n + 1, n + 1))
        self.double = np.zeros((n + 1, n + 1))
        for t, reads in enumerate(costs.readers):
            if not costs.floating[t] or not reads:
                continue
            p, size, reads = costs.producer[t], costs.size[t], sorted(reads)
            saving = sorted(s for s in savers[t] if s < n)
            lives_on = n in savers[t]
            at = 0
            for a in range(p + 1, reads[-1] + 1):
                while reads[at] < a:
                    at += 1
                self.enter[a, reads[at] + 1:] += size  # regions [a, c) reading it
                inside = next((s for s in saving if s >= a), None)
                if inside is not None and (lives_on or (saving and saving[0] < a)):
                    self.double[a, inside + 1:] += size


def concurrent_backward(costs: GraphCosts) -> np.ndarray:
    """Per call ``k``, the largest backward peak of a call on a branch beside it.

    Calls on parallel branches (no path from one to the other: a residual
    block's shortcut convolution and its main branch) have their backward run at
    the same time: the executor runs whatever is ready, and both branches'
    output gradients arrive together from the ``Add``. Traced inside a replay,
    both branches' BatchNorm backward temporaries were alive at once, a peak the
    one-call-at-a-time sum missed (see docs/decisions/0018-memory-model.md).
    """
    n = costs.n
    successors: list[set[int]] = [set() for _ in range(n)]
    for p, reads in zip(costs.producer, costs.readers):
        if p >= 0:
            successors[p].update(r for r in reads if r < n)
    below = [0] * n  # bit j of below[i]: call j depends on call i
    for i in reversed(range(n)):
        for j in successors[i]:
            below[i] |= (1 << j) | below[j]
    beside = np.zeros(n)
    for k in range(n):
        for j in range(k + 1, n):
            if not (below[k] >> j) & 1:  # j > k cannot be above k
                beside[k] = max(beside[k], costs.bwd[j])
                beside[j] = max(beside[j], costs.bwd[k])
    return beside
