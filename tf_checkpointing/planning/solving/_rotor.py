"""The schedule with least recomputation within a memory budget: the solver.

Dynamic programming of Beaumont et al. 2019 ("Optimal checkpointing for
heterogeneous chains", the *rotor* algorithm) over a chain of unequal layers,
modelled by :class:`._chain_costs.Chain`. ``opt(s, t, m)``, the least forward
work to backprop layers ``[s, t)`` given their input is held and ``m`` bytes
are free, takes the best of

* run layer ``s`` on the tape, keeping its activations, and solve ``[s+1, t)``
  with ``m - kept[s]``;
* run ``[s, s')`` as a checkpointed segment (keeping only its output ``x[s']``),
  solve ``[s', t)`` with ``m - bytes(x[s'])``, then replay ``[s, s')`` with the
  memory left once the right part is done: ``opt(s, s', m - grad bytes)``,
  which may checkpoint again, inside;
* with save policies: run layer ``s`` as a checkpointed call of its own that
  keeps what policy ``p`` picks too (``x[s+1] + policy_kept[s, p]``) and
  replays the rest for ``policy_cost[s, p]``.

Memory is counted in ``M`` units of the budget (sizes rounded up, so a plan
never exceeds its budget in the model); a second program finds the least memory
any schedule needs (a full replay always needs less than a policy), which the
error for a budget below it reports.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Union

import numpy as np

from tf_checkpointing.planning._constants import HEADROOM as _HEADROOM
from tf_checkpointing.planning._constants import ROTOR_MAX_UNITS as _MAX_UNITS
from tf_checkpointing.planning._constants import ROTOR_MIN_UNITS, ROTOR_TABLE_CELLS
from tf_checkpointing.planning._errors import BudgetTooLow
from tf_checkpointing.planning.measuring._choices import PolicyChoices
from tf_checkpointing.planning.measuring._layer_profile import ChainProfile
from tf_checkpointing.planning.plans._budget import below_least, plain_fits
from tf_checkpointing.planning.plans._plan import Segment, SequentialPlan
from tf_checkpointing.planning.solving._chain_costs import Chain, extra_seconds, fitted_chain, peak

__all__ = ["solve"]

# _MAX_UNITS, ROTOR_MIN_UNITS, ROTOR_TABLE_CELLS: the program's memory units (see
# docs/decisions/0010-rotor-discretisation.md); _HEADROOM: see docs/decisions/0009-headroom.md.


def solve(profile: ChainProfile, budget: Union[int, str], *,
          choices: Optional[PolicyChoices] = None) -> SequentialPlan:
    """The plan with least recomputation for ``budget``, from a profile (and, with
    ``choices``, the save policies each layer may run with).

    Raises:
        BudgetTooLow: ``budget`` is below the least any schedule needs (the API
            called names itself, see ``planning._errors``)."""
    chain = fitted_chain(profile, choices)
    n = chain.n
    plain = (Segment(0, n, False),)
    plain_peak = profile.plain_peak_bytes
    min_peak, min_pieces = _least_memory(chain)
    # For XLA, the model's peaks are mapped onto two measured XLA steps (see _xla).
    anchor = profile.xla_anchor
    predict: Callable[[float], float] = anchor.predict if anchor is not None else float
    if anchor is not None and not anchor.helps:
        min_pieces = plain  # under XLA the least plan peaks no lower than plain
    # Plans keep some of the budget free: the allocator hands out whole blocks
    # (up to twice a tensor's size) once it is fragmented, which no per-layer
    # profile sees (see docs/decisions/0009-headroom.md).
    least = int(predict(min_peak + chain.outside))
    min_budget = min(plain_peak, int(math.ceil(least / (1 - _HEADROOM))))
    mode = profile.mode
    plan = SequentialPlan(names=tuple(layer.name for layer in profile.layers), pieces=plain,
                          mode=mode, budget_bytes=budget,
                          predicted_peak_bytes=plain_peak, plain_peak_bytes=plain_peak,
                          min_budget_bytes=min_budget, profile=profile,
                          policies=chain.policies, predicted_extra_seconds=0.0)
    if budget == "min":
        if least >= plain_peak:
            return plan
        return dataclasses.replace(plan, pieces=min_pieces, predicted_peak_bytes=least,
                                   predicted_extra_seconds=extra_seconds(chain, min_pieces))
    budget = int(budget)
    if plain_fits(budget, plain_peak, mode):
        return plan
    if below_least(budget, min_budget):
        raise BudgetTooLow(
            "argument `budget` is below the least memory any checkpointing "
            f"schedule of these {n} layers needs (its least peak, plus "
            f"{_HEADROOM:.0%} for the allocator): expected at least {min_budget} bytes "
            f"({min_budget / 2**20:.2f} MiB), received budget={budget} "
            f"({budget / 2**20:.2f} MiB). Raise the budget to at least {min_budget}, or "
            "make the step smaller (a smaller batch, or split the largest layer).",
            budget=budget, least=min_budget)
    usable = budget * (1 - _HEADROOM)
    if anchor is not None:
        usable = anchor.model_limit(usable)
    # Nothing fits: the least plan, or plain where that keeps no less (a budget
    # above plain's peak that plain does not fit with the headroom, see plain_fits).
    pieces = _least_work(chain, usable - chain.outside) or (
        min_pieces if least < plain_peak else plain)
    return dataclasses.replace(
        plan, pieces=pieces,
        predicted_peak_bytes=int(predict(peak(chain, pieces, 0, n) + chain.outside)),
        predicted_extra_seconds=extra_seconds(chain, pieces))


def _least_memory(chain: Chain) -> tuple[float, tuple[Segment, ...]]:
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


def _least_work(chain: Chain, available: float) -> Optional[tuple[Segment, ...]]:
    """The rotor program in ``units`` of memory; None if nothing fits.

    ``choice[s, t, m]``: -1 runs layer ``s`` plainly, ``mid > s`` checkpoints
    ``[s, mid)``, ``-2 - p`` runs layer ``s`` with policy ``p``.
    """
    n = chain.n
    units = int(max(ROTOR_MIN_UNITS, min(_MAX_UNITS, ROTOR_TABLE_CELLS // ((n + 1) ** 2))))
    unit = available / units
    up = lambda v: np.ceil(np.asarray(v) / unit - 1e-9).astype(int)  # noqa: E731
    m = np.arange(units + 1)
    # opt[s, t, pad + m]: least work for [s, t) with m units free; the first
    # `pad` entries are infinite, so that a shift by k reads opt[.., pad + m - k].
    pad = units + 1
    opt = np.full((n + 1, n + 1, pad + units + 1), np.inf, np.float32)
    choice = np.full((n + 1, n + 1, units + 1), -1, np.int16)
    kept_u, x_u = up(chain.kept), up(chain.x)
    policy_u = up(chain.policy_kept)

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
                best, pick = _with_policies(chain, opt[:, :, pad - 1:], s, t, best, pick,
                                            m, x_u, policy_u, up)
            opt[s, t, pad:], choice[s, t] = best, pick
    if not np.isfinite(opt[0, n, pad + units]):
        return None
    return _schedule(chain, choice, (kept_u, x_u, policy_u), up, 0, n, units)


def _schedule(chain: Chain, choice: np.ndarray, sizes: tuple[np.ndarray, np.ndarray, np.ndarray],
              up: Callable[[Any], Any], s: int, t: int, free: int) -> tuple[Segment, ...]:
    """The pieces of ``[s, t)`` with ``free`` units, read back from the rotor
    program's ``choice`` table; ``sizes``: the kept, input and policy-kept sizes
    in units."""
    kept_u, x_u, policy_u = sizes
    pieces = []
    while s < t:
        mid = int(choice[s, t, free])
        if mid == -1:
            pieces.append(Segment(s, s + 1, False))
            free -= kept_u[s]
            s += 1
        elif mid < -1:
            p = -2 - mid
            pieces.append(Segment(s, s + 1, True, policy=chain.policies[p]))
            free -= x_u[s + 1] + policy_u[s, p]
            s += 1
        else:
            held = int(up(chain.replay_held(mid, t)))
            inner = _schedule(chain, choice, sizes, up, s, mid, free - held)
            pieces.append(Segment(s, mid, True, _inner(inner)))
            free -= x_u[mid]
            s = mid
    return _merge(pieces)


def _with_policies(chain: Chain, opt: np.ndarray, s: int, t: int, best: np.ndarray,
                   pick: np.ndarray, m: np.ndarray, x_u: np.ndarray, policy_u: np.ndarray,
                   up: Callable[[Any], Any]) -> tuple[np.ndarray, np.ndarray]:
    """The third branch: layer ``s`` alone, checkpointed with each policy.
    ``opt[s, t, 1 + k]`` is the least work with ``k`` units free (``opt[.., 0]``
    and any index below it: infinite)."""
    if not chain.policies:
        return best, pick
    held = int(up(chain.replay_held(s + 1, t)))
    # The replay of layer s alone fits where its full replay's does (what the
    # policy kept is part of the layer's plain working set).
    fits = (np.isfinite(opt[s, s + 1, np.maximum(1 + m - held, 0)])
            & (m >= up(chain.untaped[s, s + 1])))
    for p in range(len(chain.policies)):
        keep = int(x_u[s + 1] + policy_u[s, p])
        right = opt[s + 1, t, np.maximum(1 + m - keep, 0)]
        value = np.where(fits, chain.cost[s] + chain.policy_cost[s, p] + right, np.inf)
        better = value < best * (1 - 1e-6)
        best = np.where(better, value, best)
        pick = np.where(better, -2 - p, pick).astype(np.int16)
    return best, pick


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
