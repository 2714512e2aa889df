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

from lrmoe.planning.filling import progressive_filling
from lrmoe.planning.flow import max_flow
from lrmoe.planning.holders import experts_of_ranks, holder_lists_of
from lrmoe.planning.quota_ratio import largest_ratio, quota_array


def max_min_quotas(counts_E: torch.Tensor, holders: list[list[int]], cap_R: list[int]) -> torch.Tensor:
    """Max–min fair quotas by progressive filling, then leftover capacity filled.

    Each round looks for the largest ratio ρ at which every unfrozen expert can keep
    q(ρ, c_e) pairs (frozen ones keeping theirs). From ρ = 1 it runs a max-flow; a blocked
    flow names a set A of experts whose holders N(A) are full and serve A alone, so any
    feasible ρ satisfies Σ_{A} q ≤ cap(N(A)): ρ drops to the largest value meeting that and
    the flow is tried again. Every ρ tried bounds the answer from above, so the first feasible
    one is the round's ρ; the last blocking set is tight there and its unfrozen experts freeze.
    Every expert with pairs keeps at least one; a capacity too small for that is an error.
    Leftover capacity is then handed out in the max-flow's path order, which depends on the
    whole history of the flow: where any is left for a frozen expert, the reference
    (:func:`_max_min_quotas_by_flows`) runs instead.

    How it is computed. A trial's blocking set is the source side of its minimal minimum cut —
    the minimal X maximising the deficiency D(X) = Σ_{e∈X} target_e − cap(N(X)) — the same for
    every maximum flow of the trial's targets. So any valid flow may be carried from trial to
    trial, and only the blocking sets (their unfrozen experts and room: capacity less frozen
    quotas) and, at the end, whether a frozen expert can take one more row, are read off it.
    Four reductions, each leaving all of those as they are, keep the max-flows few and small:

    1. Round 1's first max-flow leaves out every expert holding an *ample* rank, one that can
       take every pair of its experts, and that rank (see :func:`_contested_experts`);
    2. every later trial stays inside round 1's first blocking set, each inside an earlier
       blocking set, on a flow moved only where targets changed (see
       :class:`lrmoe.planning.filling._Filling`);
    3. a frozen set that fills its holders exactly leaves the problem (see
       :meth:`~lrmoe.planning.filling._Filling.drop_saturated`);
    4. after such a set leaves, the next round's first blocking set follows from this round's
       without a max-flow (ditto).

    The ratio itself comes from the few steps of q around the piecewise-linear solution, checked
    against the exact sums, as 50 bisection halvings would leave it (see :func:`largest_ratio`).
    """
    counts = counts_E.to(torch.long)
    c_l = counts.tolist()
    R = len(cap_R)
    holder_lists = holder_lists_of(holders)
    cap = [int(x) for x in cap_R]
    if (c_l and (min(c_l) < 0 or max(c_l) >= 1 << 52)) or min(cap, default=0) < 0 or (
            cap != cap_R if type(cap_R) is list else any(x != y for x, y in zip(cap, cap_R))):
        return _max_min_quotas_by_flows(counts_E, holders, cap_R)
    experts = _contested_experts(c_l, holder_lists, cap, R)
    if experts is None:  # a holder that is not a rank
        return _max_min_quotas_by_flows(counts_E, holders, cap_R)
    quota = counts.numpy().copy()
    if experts:
        cut = progressive_filling(experts, c_l, cap, holder_lists)
        if cut is None:
            return _max_min_quotas_by_flows(counts_E, holders, cap_R)
        for e, q in cut:
            quota[e] = q
    return torch.from_numpy(quota)


def _contested_experts(c_l: list[int], holder_lists: list[list[int]], cap: list[int], R: int) -> list[int] | None:
    """The experts with pairs none of whose holders is *ample* — able to take every pair of
    every expert still considered that holds it — ascending; None if a holder is not in [0, R)
    (the lists are sorted: their ends tell).

    Why they alone decide round 1's first blocking set (every target at c): let rank r be ample
    and X its experts. Put X's pairs all on r and a maximum flow of the rest on the other ranks
    (no expert of the rest holds r). No cut is smaller — the rest's minimum cut, plus X's pairs
    on the experts' side — so this flow is maximal; and a search from an unplaced pair, which
    starts outside X, never reaches X (X's rows lie on r alone, which no expert outside X
    holds). The blocking set is the rest's: X and r leave, and the rest's ranks are checked again
    without X's pairs, until none is ample. Experts without pairs carry no rows and are never
    reached."""
    load = [0] * R
    for hs, x in zip(holder_lists, c_l):
        if hs:
            if hs[0] < 0 or hs[-1] >= R:
                return None
            for r in hs:
                load[r] += x
    alive = range(len(c_l))
    while True:
        kept = []
        for e in alive:
            if c_l[e]:
                for r in holder_lists[e]:
                    if load[r] <= cap[r]:
                        break
                else:
                    kept.append(e)
        if len(kept) == len(alive):
            return kept
        alive = kept
        load = [0] * R  # the experts that left no longer load their other holders
        for e in alive:
            x = c_l[e]
            for r in holder_lists[e]:
                load[r] += x


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
            trial = np.where(frozen, target, quota_array(c, rho))
            blocked = place(trial)
            if blocked is None:
                break
            seen_e, seen_r = blocked
            seen = np.zeros(E, bool)
            seen[seen_e] = True
            active = seen & ~frozen
            room = sum(cap_R[r] for r in seen_r) - int(target[seen & frozen].sum())
            if not active.any() or int(quota_array(c[active], 0.0).sum()) > room:
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts {seen_e} "
                    f"need at least {int(np.where(frozen, target, quota_array(c, 0.0))[seen].sum())} kept rows, "
                    f"their holders {seen_r} can keep {sum(cap_R[r] for r in seen_r)}"
                )
            rho, tight = largest_ratio(c[active], room), active
        if tight is None:
            target = trial
            break
        target = np.where(tight, quota_array(c, rho), target)
        frozen |= tight
    # leftover capacity: frozen experts take what their holders still have room for
    max_flow(flow, (c - target).tolist(), slack, holders, holders_of_rank)
    return torch.tensor([sum(f.values()) for f in flow], dtype=torch.long)
