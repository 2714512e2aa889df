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

from lrmoe.planning.balance import max_flow
from lrmoe.planning.holders import experts_of_ranks, fill_holders, holder_lists_of
from lrmoe.planning.quota_ratio import fair_quotas, largest_ratio, quota_array, quota_of


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
       blocking set, on a flow moved only where targets changed (see :func:`_progressive_filling`);
    3. a frozen set that fills its holders exactly leaves the problem (ditto);
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
        cut = _progressive_filling(experts, c_l, cap, holder_lists)
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


def _progressive_filling(experts: list[int], c_l: list[int], cap: list[int],
                         holder_lists: list[list[int]]) -> list[tuple[int, int]] | None:
    """The rounds of :func:`max_min_quotas` on the contested ``experts`` (renumbered 0..n−1 in
    ascending order; ranks keep their numbers): (expert, quota) of every expert cut below its
    count, or None where leftover capacity would be handed out (the caller then runs the
    reference).

    *Bounds.* Round 1's first trial places every count: rows that fit on a holder directly go
    there first, a max-flow places the rest. Its blocking set A₁ bounds every later trial: A₁'s
    holders received rows from A₁ alone when that flow stopped (a rank with rows of another
    expert would have led the search to it), and each trial moves rows only of the experts it
    searches from and along augmenting paths out of them, so by induction no other expert ever
    has rows there or is reached, and keeps q(1, c) = c. Likewise each trial stays inside the
    earlier blocking set that bounds it — the previous trial's within a round, the previous
    round's first set for a round's first trial — whose experts are the only ones whose targets
    change; the other experts are at their targets (any value up to the one they were placed at
    then serves: they fit without the bounding set's ranks, so the minimal cut is the same).

    *Saturated sets leave.* Once a round's last blocking set S is frozen with quotas that fill
    its holders N(S) exactly, some maximum flow of any later trial keeps S on N(S); from an
    expert outside, the search then reaches ranks of N(S) that are full and carry rows of S
    alone, then experts of S whose rows all lie on ranks reached with them: the part of S reached
    adds no unfrozen expert and as much capacity as frozen quota. So blocking sets keep their
    unfrozen experts and room, no row can ever be added to S, and S's experts leave every search
    and N(S) the holders of everyone else.

    *The next round's first set.* For X outside S, N(X ∪ S) is N'(X) (its holders without N(S))
    and N(S) apart, so the next round's deficiency is D'(X) = D(X ∪ S) − D(S), D this round's
    at its first targets (S's unfrozen experts at c). This round's first set B₀ is the minimal
    maximiser of D and contains S, and maximisers of D (a supermodular function) are closed under
    ∩ and ∪, so the minimal maximiser of D' is B₀ ∖ S when D(B₀) − D(S) > 0, and empty (every
    count then fits: the last round) otherwise — no max-flow needed.

    Only round 1 can fail for lack of capacity, and only its blocking sets are named in the
    error: from round 2 on, the previous round's last flow fits at least one pair of every
    expert, so no blocking set has more unfrozen experts than room.
    """
    n, m = len(experts), len(cap)
    hl = [holder_lists[e] for e in experts]  # replaced when a rank leaves, never changed in place
    hor = experts_of_ranks(hl, m)
    cl = [c_l[e] for e in experts]
    cf = [float(x) for x in cl]

    # Round 1's first trial: every expert at q(1, c) = c (every count is below 2⁵²).
    fl = [[0] * m for _ in range(n)]  # rows of expert e on rank r (holders only)
    sl = list(cap)
    sup = list(cl)
    for e in range(n):
        sup[e] = fill_holders(fl[e], sup[e], hl[e], sl)
    blocked = max_flow(fl, sup, sl, hl, hor)
    if blocked is None:
        return []
    pl = [x - s for x, s in zip(cl, sup)]  # rows placed, per expert
    sup = [0] * n  # kept all zero between trials

    def search(short, target):
        """Move the ``short`` experts (ascending) up to their ``target``, the others being at
        theirs: rows that fit on a holder directly go there, a max-flow places the rest. Returns
        its blocking set (experts, ranks), or None once every target is placed."""
        left = []  # experts with rows still unplaced, ascending
        for e in short:
            t = target[e]
            s = fill_holders(fl[e], t - pl[e], hl[e], sl)
            if s:
                sup[e] = s
                left.append(e)
            pl[e] = t - s
        if not left:
            return None
        blocked = max_flow(fl, sup, sl, hl, hor, left)  # every expert with supply is in `left`
        for e in left:
            pl[e] = target[e] - sup[e]
            sup[e] = 0
        return blocked

    frozen = [False] * n
    gone = [False] * n  # experts of a saturated set, out of the problem
    target = list(cl)  # unfrozen experts stay at c
    domain, first_ranks = blocked  # A₁ and its holders: every trial stays inside
    deficit = sum([cl[e] for e in domain]) - sum([cap[r] for r in first_ranks])
    while True:
        tight = None
        trial = list(target)
        if blocked is None:
            # A round's first trial: its unfrozen experts back to c (frozen ones are at their
            # quotas, the others at c already), searching from the previous round's first set.
            blocked = search([e for e in domain if not frozen[e] and pl[e] < cl[e]], trial)
            if blocked is not None:
                deficit = sum([trial[e] for e in blocked[0]]) - sum([cap[r] for r in blocked[1]])
        first = True
        while blocked is not None:
            seen_e, seen_r = blocked
            if first:  # the next round's trials are bounded by this round's first set
                domain, first = seen_e, False
                first_r = seen_r
            active = [e for e in seen_e if not frozen[e]]
            room = sum([cap[r] for r in seen_r]) - sum([target[e] for e in seen_e if frozen[e]])
            if not active or len(active) > room:  # q(0, c) = 1: c > 0 here (round 1 only, see above)
                need = sum(target[e] if frozen[e] else quota_of(cl[e], 0.0) for e in seen_e)
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts "
                    f"{[experts[e] for e in seen_e]} need at least {need} kept rows, their holders "
                    f"{seen_r} can keep {sum(cap[r] for r in seen_r)}"
                )
            # active experts have pairs
            quotas = fair_quotas([cl[e] for e in active], [cf[e] for e in active], room)
            tight, last_e, last_r = active, seen_e, seen_r
            # The next trial: the active experts at q(ρ), searching from this blocking set.
            # Rows above a new quota go back first (highest rank first), so that the experts
            # below theirs can take the room directly.
            short = []
            for e, t in zip(active, quotas):
                trial[e] = t
                p = pl[e]
                if p > t:
                    excess, f = p - t, fl[e]
                    for r in reversed(hl[e]):
                        k = f[r]
                        if k:
                            d = k if k < excess else excess
                            f[r] = k - d
                            sl[r] += d
                            excess -= d
                            if not excess:
                                break
                    pl[e] = t
                elif p < t:
                    short.append(e)
            blocked = search(short, trial) if short else None
        if tight is None:
            target = trial
            break
        if any([sl[r] for r in last_r]):
            for e in tight:
                target[e] = trial[e]  # the quota at the round's ρ
                frozen[e] = True
            continue  # blocked is None: the next round starts with a trial
        # Saturated: S = the last blocking set leaves the problem. Its deficiency at this
        # round's first targets (its unfrozen experts at c), and so the next round's first set.
        deficit -= sum([target[e] for e in last_e]) - sum([cap[r] for r in last_r])
        for e in tight:
            target[e] = trial[e]  # the quota at the round's ρ
            frozen[e] = True
        for e in last_e:
            gone[e] = True
        for r in last_r:
            for e in hor[r]:
                if not gone[e]:
                    hl[e] = [h for h in hl[e] if h != r]
        domain = [e for e in domain if not gone[e]]
        if deficit > 0:
            dead = set(last_r)
            blocked = domain, [r for r in first_r if r not in dead]
        elif search([e for e in domain if not frozen[e] and pl[e] < cl[e]], target) is not None:
            raise AssertionError("unreachable: a round's first set without deficiency blocks")
        else:
            break
    # Leftover capacity for frozen experts: where none is reachable (the usual case) the
    # quotas are the targets; else the reference's flow decides who gets it. The search from
    # them stays on A₁'s holders: without slack there, there is none; saturated sets take none.
    if any([sl[r] for r in first_ranks]):
        wanted = [cl[e] - target[e] if not gone[e] else 0 for e in range(n)]
        left = list(wanted)
        short = [e for e in range(n) if left[e]]
        if short:
            max_flow(fl, left, sl, hl, hor, short)
            if left != wanted:
                return None
    return [(experts[e], t) for e, t in enumerate(target) if t != cl[e]]


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
