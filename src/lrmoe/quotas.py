"""Max–min fair per-expert quotas of kept pairs under per-rank capacities (the controller's
quota step, docs/design.md "Controller").

Quotas are max–min fair: the largest common retention ratio ρ with q_e = q(ρ, c_e) (the fixed-
ratio quota) such that the kept pairs can be spread over each expert's holders within every
cap_r (a max-flow), found by progressive filling — a blocking set of experts whose holders are
full gets the largest ratio their capacity allows and is frozen, the rest continue — then
leftover capacity is filled. Deterministic and identical on every rank.
"""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.balance import experts_of_ranks, holder_lists_of, max_flow


def max_min_quotas(counts_E: torch.Tensor, holders: list[list[int]], cap_R: list[int]) -> torch.Tensor:
    """Max–min fair quotas by progressive filling, then leftover capacity filled.

    Each round looks for the largest ratio ρ at which every unfrozen expert can keep
    q(ρ, c_e) pairs (frozen ones keeping theirs). From ρ = 1 it runs a max-flow; a blocked
    flow names a set A of experts whose holders N(A) are full and serve A alone, so any
    feasible ρ satisfies Σ_{A} q ≤ cap(N(A)): ρ drops to the largest value meeting that and
    the flow is tried again. Every ρ tried bounds the answer from above, so the first feasible
    one is the round's ρ; the last blocking set is tight there and its unfrozen experts freeze.
    Every expert with pairs keeps at least one; a capacity too small for that is an error.

    How it is computed: a blocking set is the source side of the minimal minimum cut, the same
    for every maximum flow of the trial's targets, and it can only shrink when targets drop. So
    each trial solves the max-flow only among the experts of an earlier blocking set that bounds
    it (the previous round's first set for a round's first trial, the previous trial's set
    within a round), from whatever flow the last trial left. Leftover capacity is then handed
    out in the max-flow's path order, which depends on the whole history of the flow: where any
    is left for a frozen expert, the reference (:func:`_max_min_quotas_by_flows`) runs instead.
    """
    counts = counts_E.to(torch.long)
    c = counts.numpy()
    E, R = counts.numel(), len(cap_R)
    holder_lists = holder_lists_of(holders)
    cap = [int(x) for x in cap_R]
    if (c < 0).any() or (c >= 1 << 52).any() or any(x < 0 or x != y for x, y in zip(cap, cap_R)) or any(
            hs and (hs[0] < 0 or hs[-1] >= R) for hs in holder_lists):
        return _max_min_quotas_by_flows(counts_E, holders, cap_R)
    holders_of_rank = experts_of_ranks(holder_lists, R)
    c_l = c.tolist()
    c_f = [float(x) for x in c_l]

    # One flow carried through every trial (any flow gives the same blocking sets, so it only
    # needs to be valid): a trial moves it to its targets on its domain and augments.
    flow = [[0] * R for _ in range(E)]  # rows of expert e on rank r (holders only)
    placed = [0] * E
    slack = list(cap)

    def trial_cut(fl, pl, sl, target, domain):
        """Move the flow to ``target`` on ``domain`` (every expert whose blocking status may
        change) and return the blocking set (experts, ranks) or None."""
        supply = [0] * E
        for e in domain:
            t, p = target[e], pl[e]
            if p > t:  # hand rows back, highest rank first
                excess, f = p - t, fl[e]
                for r in reversed(holder_lists[e]):
                    k = f[r]
                    if k:
                        d = k if k < excess else excess
                        f[r] = k - d
                        sl[r] += d
                        excess -= d
                        if not excess:
                            break
            elif p < t:
                supply[e] = t - p
        for e in domain:  # rows that fit on a holder directly go there first
            s = supply[e]
            if s:
                f = fl[e]
                for r in holder_lists[e]:
                    k = sl[r]
                    if k > 0:
                        d = s if s < k else k
                        f[r] += d
                        sl[r] = k - d
                        s -= d
                        if not s:
                            break
                supply[e] = s
        blocked = max_flow(fl, supply, sl, holder_lists, holders_of_rank, domain)
        for e in domain:
            pl[e] = target[e] - supply[e]
        return blocked

    frozen = [False] * E
    target = list(c_l)  # q(1, c) = c for every count below 2⁵²: unfrozen experts stay at c
    domain = list(range(E))
    while True:
        rho, tight = 1.0, None
        trial = list(target)
        blocked = trial_cut(flow, placed, slack, trial, domain)
        first = True
        while blocked is not None:
            seen_e, seen_r = blocked
            if first:  # the next round's trials are bounded by this round's first set
                domain, first = seen_e, False
            active = [e for e in seen_e if not frozen[e]]
            room = sum(cap[r] for r in seen_r) - sum(target[e] for e in seen_e if frozen[e])
            if not active or len(active) > room:  # q(0, c) = 1: an active expert has c > 0
                need = sum(target[e] if frozen[e] else _quota_of(c_l[e], 0.0) for e in seen_e)
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts {seen_e} "
                    f"need at least {need} kept rows, "
                    f"their holders {seen_r} can keep {sum(cap[r] for r in seen_r)}"
                )
            rho = _ratio_of([c_l[e] for e in active], room)  # active experts have pairs
            if rho is None:
                rho = _largest_ratio(c[active], room)
            tight = active
            for e in active:
                q = -((1e-6 - rho * c_f[e]) // 1.0)  # _quota_of(c_e, rho), inline
                trial[e] = int(1.0 if q < 1.0 else (c_f[e] if q > c_f[e] else q))
            blocked = trial_cut(flow, placed, slack, trial, seen_e)
        if tight is None:
            target = trial
            break
        for e in tight:
            target[e] = trial[e]  # the quota at the round's ρ
            frozen[e] = True
    # Leftover capacity for frozen experts: where none is reachable (the usual case) the
    # quotas are the targets; else the reference's flow decides who gets it.
    wanted = [c_l[e] - target[e] for e in range(E)]
    left = list(wanted)
    short = [e for e in range(E) if left[e]]
    if short:
        max_flow(flow, left, slack, holder_lists, holders_of_rank, short)
        if left != wanted:
            return _max_min_quotas_by_flows(counts_E, holders, cap_R)
    return torch.from_numpy(np.array(target, dtype=np.int64))


def _max_min_quotas_by_flows(counts_E: torch.Tensor, holders: list[list[int]], cap_R: list[int]) -> torch.Tensor:
    """The reference implementation of :func:`max_min_quotas`: one flow carried through every
    trial and the leftover fill. Used where the leftover fill hands out rows (its result depends
    on that flow) or on inputs outside the fast path (negative counts or capacities)."""
    counts = counts_E.to(torch.long)
    c = counts.numpy()
    E, R = counts.numel(), len(cap_R)
    holders_of_rank = experts_of_ranks(holders, R)

    # One flow, carried across every trial: lowering a target hands rows back (highest rank
    # first), raising it adds supply; the max-flow resumes from there.
    flow = [dict.fromkeys(hs, 0) for hs in holders]
    slack = list(cap_R)

    def place(target: np.ndarray):
        supply = []
        for e, f in enumerate(flow):
            excess = sum(f.values()) - int(target[e])
            for r in sorted(f, reverse=True):
                if excess <= 0:
                    break
                k = min(excess, f[r])
                f[r] -= k
                slack[r] += k
                excess -= k
            supply.append(max(-excess, 0))
        return max_flow(flow, supply, slack, holders, holders_of_rank)

    frozen = np.zeros(E, bool)
    target = c.copy()
    while True:
        rho, tight = 1.0, None
        while True:
            trial = np.where(frozen, target, _quota(c, rho))
            blocked = place(trial)
            if blocked is None:
                break
            seen_e, seen_r = blocked
            seen = np.zeros(E, bool)
            seen[seen_e] = True
            active = seen & ~frozen
            room = sum(cap_R[r] for r in seen_r) - int(target[seen & frozen].sum())
            if not active.any() or int(_quota(c[active], 0.0).sum()) > room:
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts {seen_e} "
                    f"need at least {int(np.where(frozen, target, _quota(c, 0.0))[seen].sum())} kept rows, "
                    f"their holders {seen_r} can keep {sum(cap_R[r] for r in seen_r)}"
                )
            rho, tight = _largest_ratio(c[active], room), active
        if tight is None:
            target = trial
            break
        target = np.where(tight, _quota(c, rho), target)
        frozen |= tight
    # leftover capacity: frozen experts take what their holders still have room for
    max_flow(flow, (c - target).tolist(), slack, holders, holders_of_rank)
    return torch.tensor([sum(f.values()) for f in flow], dtype=torch.long)


def _quota(c: np.ndarray, rho: float) -> np.ndarray:
    """The fixed-ratio quota of docs/design.md, vectorised in numpy (see selection.fixed_ratio_quota)."""
    q = np.minimum(np.maximum(np.ceil(rho * c.astype(np.float64) - 1e-6), 1.0), c)
    return np.where(c > 0, q, 0).astype(np.int64)


def _quota_of(c: int, rho: float) -> int:
    """:func:`_quota` of one count, in plain floats (the same IEEE operations, so the same value)."""
    if c <= 0:
        return 0
    q = -(-(rho * float(c) - 1e-6) // 1.0)  # ceil, as a float like np.ceil
    return int(min(max(q, 1.0), float(c)))


_GRID = 2.0**-50  # _largest_ratio's bisection settles on a multiple of this
_TOP = (1 << 50) - 1  # the largest multiple of _GRID below 1, in units of _GRID


def _largest_ratio(c: np.ndarray, room: int) -> float:
    """Largest ρ in [0, 1] with Σ q(ρ, c_e) ≤ room; 0 if none: 1 itself, else the largest
    multiple of 2⁻⁵⁰ below 1 with Σ q ≤ room (what 50 halvings of [0, 1] settle on).

    q is a step function of ρ: expert e's quota passes k at ρ = (k + 10⁻⁶) / c_e, so the answer
    sits just below the (room − n + 1)-th of those steps, found among the few near the solution
    of the piecewise-linear relaxation; the grid points around it are checked against the exact
    sum, and the bisection runs where that check fails."""
    rho = _ratio_of([x for x in c.tolist() if x > 0], room)
    if rho is not None:
        return rho
    lo, hi = 0.0, 1.0
    for _ in range(50):  # q(ρ) is a step function; 50 halvings resolve every step
        mid = 0.5 * (lo + hi)
        if int(_quota(c, mid).sum()) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def _ratio_of(counts: list[int], room: int) -> float | None:
    """:func:`_largest_ratio` of the positive ``counts``, or None where its check fails."""
    if sum(counts) <= room and max(counts, default=0) < 1 << 52:  # q(1, x) = x: all fit
        return 1.0
    extra = room - len(counts)  # steps above one pair each that fit
    if extra < 0:
        return 0.0  # even one pair each does not fit, at any ρ > 0
    step = _step(counts, extra) if max(counts) < 1 << 52 else None
    if step is None:
        return None
    floats = [float(x) for x in counts]
    m = min(int(step / _GRID), _TOP)
    for _ in range(4):
        if m == 0 or _fits(floats, m * _GRID, room):
            break
        m -= 1
    else:
        return None
    for _ in range(4):
        if m == _TOP or not _fits(floats, (m + 1) * _GRID, room):
            return m * _GRID
        m += 1
    return None


def _fits(counts: list[float], rho: float, room: int) -> bool:
    """Σ_e _quota(c_e, ρ) ≤ room over positive counts, in the same float operations."""
    total = 0.0
    for x in counts:
        q = -((1e-6 - rho * x) // 1.0)  # ceil(ρ·x − 1e-6): fl(b − a) = −fl(a − b)
        total += 1.0 if q < 1.0 else (x if q > x else q)
    return total <= room


def _step(counts: list[int], extra: int) -> float | None:
    """The (extra + 1)-th smallest of the steps (k + 10⁻⁶) / c, 1 ≤ k < c, over the counts c;
    None if there are not that many (or, rarely, if rounding hides it: the caller then bisects).

    Steps of c at or below ρ: clip(⌊ρ·c − 10⁻⁶⌋, 0, c − 1), within 1 of the relaxation
    f(ρ) = Σ min(ρ·c, c − 1) (10⁻⁶ aside), which is piecewise linear: counts at or below
    1 / (1 − ρ) are capped. The wanted step lies between f⁻¹(extra) and f⁻¹(extra + 1 + n),
    where at most about 2n + 1 steps lie: list those and pick."""
    n = len(counts)
    if sum(counts) - n <= extra:
        return None
    xs = sorted(counts)
    suffix = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        suffix[j] = suffix[j + 1] + xs[j]
    bounds = []
    j = capped = 0  # xs[:j] capped at c − 1, contributing `capped`
    for y in (extra, extra + 1 + n):
        while True:
            if suffix[j] == 0:
                rho = 1.0
                break
            rho = (y - capped) / suffix[j]
            if j < n and rho >= 1.0 - 1.0 / xs[j]:
                capped += xs[j] - 1
                j += 1
                continue
            break
        bounds.append(min(max(rho, 0.0), 1.0))
    lo, hi = bounds
    below = 0
    window = []
    for x in counts:
        k_lo = int(lo * x - 1e-6)  # steps of x at or below lo (truncation is the floor here)
        k_lo = 0 if k_lo < 0 else (x - 1 if k_lo >= x else k_lo)
        k_hi = int(hi * x - 1e-6)
        k_hi = 0 if k_hi < 0 else (x - 1 if k_hi >= x else k_hi)
        below += k_lo
        if k_hi > k_lo:
            window += [(k + 1e-6) / x for k in range(k_lo + 1, k_hi + 1)]
    i = extra - below  # position of the wanted step among those in (lo, hi]
    if not 0 <= i < len(window):
        return None
    window.sort()
    return window[i]
