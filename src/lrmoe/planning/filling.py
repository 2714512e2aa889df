"""The rounds of :func:`lrmoe.planning.quotas.max_min_quotas` on its contested experts:
progressive filling, one max-flow carried through every trial.

A round tries ratios ρ from 1 down. Each trial's blocked flow names a blocking set A of experts
whose holders N(A) are full and serve A alone; the next ρ is the largest with Σ_A q ≤ cap(N(A))
less A's frozen quotas (:meth:`_Filling.quotas_at_ratio`), and the first ρ whose quotas fit is
the round's: its last blocking set is tight there and its unfrozen experts freeze
(:meth:`_Filling.freeze`). A frozen set that fills its holders exactly leaves the problem
(:meth:`_Filling.drop_saturated`), and the rounds end once every unfrozen count fits. Leftover
capacity is the caller's to hand out: where a frozen expert could take any, this says so
(:meth:`_Filling.leftover_fits`).
"""

from __future__ import annotations

from lrmoe.planning.flow import Blocked, max_flow
from lrmoe.planning.holders import experts_of_ranks, fill_holders
from lrmoe.planning.quota_ratio import fair_quotas, quota_of


def progressive_filling(experts: list[int], c_l: list[int], cap: list[int],
                        holder_lists: list[list[int]]) -> list[tuple[int, int]] | None:
    """The rounds of :func:`~lrmoe.planning.quotas.max_min_quotas` on the contested ``experts``
    (renumbered 0..n−1 in ascending order; ranks keep their numbers): (expert, quota) of every
    expert cut below its count, or None where leftover capacity would be handed out (the caller
    then runs the reference).

    Only round 1 can fail for lack of capacity, and only its blocking sets are named in the
    error: from round 2 on, the previous round's last flow fits at least one pair of every
    expert, so no blocking set has more unfrozen experts than room.
    """
    state = _Filling(experts, c_l, cap, holder_lists)
    blocked = state.first_trial()
    if blocked is None:
        return []
    while True:
        trial = list(state.target)
        if blocked is None:
            blocked = state.round_start(trial)
        last = state.trials(blocked, trial)
        if last is None:  # the round's first trial fits every count: the last round
            state.target = trial
            break
        tight, last_e, last_r = last
        if any([state.sl[r] for r in last_r]):  # room left on its holders: it stays in the problem
            state.freeze(tight, trial)
            blocked = None  # the next round starts with a trial
            continue
        blocked = state.drop_saturated(tight, trial, last_e, last_r)
        if blocked is None:
            break
    if not state.leftover_fits():
        return None
    return [(experts[e], t) for e, t in enumerate(state.target) if t != state.cl[e]]


class _Filling:
    """The state of :func:`progressive_filling`: the flow (``fl[e][r]`` rows of expert e on rank
    r, holders only; ``sl``: each rank's slack; ``pl``: rows placed per expert), each expert's
    target, which are frozen and which have left, and the bounds the next trial stays inside.

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
    """

    __slots__ = ("experts", "cap", "hl", "hor", "cl", "cf", "fl", "sl", "sup", "pl", "frozen", "gone", "target",
                 "domain", "first_r", "first_ranks", "deficit")

    def __init__(self, experts: list[int], c_l: list[int], cap: list[int], holder_lists: list[list[int]]) -> None:
        n, m = len(experts), len(cap)
        self.experts, self.cap = experts, cap
        self.hl = [holder_lists[e] for e in experts]  # replaced when a rank leaves, never changed in place
        self.hor = experts_of_ranks(self.hl, m)
        self.cl = [c_l[e] for e in experts]
        self.cf = [float(x) for x in self.cl]
        self.fl = [[0] * m for _ in range(n)]
        self.sl = list(cap)
        self.sup = [0] * n  # supply of the running max-flow: all zero between trials
        self.pl = [0] * n
        self.frozen = [False] * n
        self.gone = [False] * n  # experts of a saturated set, out of the problem
        self.target = list(self.cl)  # unfrozen experts stay at c
        self.domain: list[int] = []  # the blocking set bounding the next round's first trial
        self.first_r: list[int] = []  # this round's first blocking set's ranks
        self.first_ranks: list[int] = []  # A₁'s holders: the leftover search stays on them
        self.deficit = 0  # deficiency of this round's first set at its first targets

    def first_trial(self) -> Blocked | None:
        """Round 1's first trial: every expert at q(1, c) = c (every count is below 2⁵²), rows
        that fit on a holder directly placed first. Its blocking set A₁ bounds every later trial."""
        fl, sl, hl, cl = self.fl, self.sl, self.hl, self.cl
        sup = list(cl)
        for e in range(len(cl)):
            sup[e] = fill_holders(fl[e], sup[e], hl[e], sl)
        blocked = max_flow(fl, sup, sl, hl, self.hor)
        if blocked is not None:
            self.pl = [x - s for x, s in zip(cl, sup)]
            self.domain, self.first_ranks = blocked
            self.deficit = sum([cl[e] for e in self.domain]) - sum([self.cap[r] for r in self.first_ranks])
        return blocked

    def search(self, short: list[int], target: list[int]) -> Blocked | None:
        """Move the ``short`` experts (ascending) up to their ``target``, the others being at
        theirs: rows that fit on a holder directly go there, a max-flow places the rest. Returns
        its blocking set (experts, ranks), or None once every target is placed."""
        fl, sl, hl, pl, sup = self.fl, self.sl, self.hl, self.pl, self.sup
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
        blocked = max_flow(fl, sup, sl, hl, self.hor, left)  # every expert with supply is in `left`
        for e in left:
            pl[e] = target[e] - sup[e]
            sup[e] = 0
        return blocked

    def round_start(self, trial: list[int]) -> Blocked | None:
        """A round's first trial: its unfrozen experts back to c (frozen ones are at their quotas,
        the others at c already), searching from the previous round's first set; its blocking
        set's deficiency is the round's."""
        frozen, pl, cl = self.frozen, self.pl, self.cl
        blocked = self.search([e for e in self.domain if not frozen[e] and pl[e] < cl[e]], trial)
        if blocked is not None:
            self.deficit = sum([trial[e] for e in blocked[0]]) - sum([self.cap[r] for r in blocked[1]])
        return blocked

    def trials(self, blocked: Blocked | None, trial: list[int]) -> tuple[list[int], list[int], list[int]] | None:
        """The trials of one round from its first blocking set ``blocked`` (None: the first trial
        fitted), ``trial`` holding the targets tried: each blocking set's unfrozen experts go to
        the quotas of the largest ratio it allows, until a trial fits. Returns the last blocking
        set as (its unfrozen experts, its experts, its ranks), or None where no trial blocked."""
        last = None
        if blocked is not None:  # the next round's trials are bounded by this round's first set
            self.domain, self.first_r = blocked
        while blocked is not None:
            seen_e, seen_r = blocked
            active, quotas = self.quotas_at_ratio(seen_e, seen_r)
            last = active, seen_e, seen_r
            short = self.move_to(active, quotas, trial)
            blocked = self.search(short, trial) if short else None
        return last

    def quotas_at_ratio(self, seen_e: list[int], seen_r: list[int]) -> tuple[list[int], list[int]]:
        """The blocking set's unfrozen experts and their quotas at the largest ratio its room
        (capacity less frozen quotas) allows; ``ValueError`` where even one pair each does not fit.
        (One plain loop rather than comprehensions: this runs once a trial on a few experts, where
        building the comprehensions cost more than the loop.)"""
        frozen, target, cl, cf = self.frozen, self.target, self.cl, self.cf
        room = sum(map(self.cap.__getitem__, seen_r))
        active, counts, floats = [], [], []
        for e in seen_e:
            if frozen[e]:
                room -= target[e]
            else:
                active.append(e)
                counts.append(cl[e])
                floats.append(cf[e])
        if not active or len(active) > room:  # q(0, c) = 1: c > 0 here (round 1 only)
            self.too_small(seen_e, seen_r)
        return active, fair_quotas(counts, floats, room)  # active experts have pairs

    def too_small(self, seen_e: list[int], seen_r: list[int]) -> None:
        """Raise the ``ValueError`` of a blocking set whose room cannot keep one pair of each of its
        unfrozen experts."""
        frozen, target, cap, cl = self.frozen, self.target, self.cap, self.cl
        need = sum(target[e] if frozen[e] else quota_of(cl[e], 0.0) for e in seen_e)
        raise ValueError(
            f"budget too small to keep one pair of every expert with tokens: experts "
            f"{[self.experts[e] for e in seen_e]} need at least {need} kept rows, their holders "
            f"{seen_r} can keep {sum(cap[r] for r in seen_r)}"
        )

    def move_to(self, active: list[int], quotas: list[int], trial: list[int]) -> list[int]:
        """The next trial's targets: the active experts at their quotas. Rows above a new quota go
        back first (highest rank first), so that the experts below theirs can take the room
        directly; returns those below (ascending), for :meth:`search` to move up."""
        fl, sl, hl, pl = self.fl, self.sl, self.hl, self.pl
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
        return short

    def freeze(self, tight: list[int], trial: list[int]) -> None:
        """The round's tight experts keep their quotas at the round's ρ from now on."""
        target, frozen = self.target, self.frozen
        for e in tight:
            target[e] = trial[e]
            frozen[e] = True

    def drop_saturated(self, tight: list[int], trial: list[int], last_e: list[int], last_r: list[int]
                       ) -> Blocked | None:
        """Freeze a last blocking set S that fills its holders N(S) exactly and take it out of the
        problem; returns the next round's first blocking set, or None where every count fits.

        *Saturated sets leave.* Once S is frozen with quotas that fill N(S) exactly, some maximum
        flow of any later trial keeps S on N(S); from an expert outside, the search then reaches
        ranks of N(S) that are full and carry rows of S alone, then experts of S whose rows all
        lie on ranks reached with them: the part of S reached adds no unfrozen expert and as much
        capacity as frozen quota. So blocking sets keep their unfrozen experts and room, no row
        can ever be added to S, and S's experts leave every search and N(S) the holders of
        everyone else.

        *The next round's first set.* For X outside S, N(X ∪ S) is N'(X) (its holders without
        N(S)) and N(S) apart, so the next round's deficiency is D'(X) = D(X ∪ S) − D(S), D this
        round's at its first targets (S's unfrozen experts at c). This round's first set B₀ is
        the minimal maximiser of D and contains S, and maximisers of D (a supermodular function)
        are closed under ∩ and ∪, so the minimal maximiser of D' is B₀ ∖ S when D(B₀) − D(S) > 0,
        and empty (every count then fits: the last round) otherwise — no max-flow needed."""
        target, gone, hl = self.target, self.gone, self.hl
        self.deficit -= sum([target[e] for e in last_e]) - sum([self.cap[r] for r in last_r])
        self.freeze(tight, trial)
        for e in last_e:
            gone[e] = True
        for r in last_r:
            for e in self.hor[r]:
                if not gone[e]:
                    hl[e] = [h for h in hl[e] if h != r]
        self.domain = [e for e in self.domain if not gone[e]]
        if self.deficit > 0:
            dead = set(last_r)
            return self.domain, [r for r in self.first_r if r not in dead]
        frozen, pl, cl = self.frozen, self.pl, self.cl
        if self.search([e for e in self.domain if not frozen[e] and pl[e] < cl[e]], target) is not None:
            raise AssertionError("unreachable: a round's first set without deficiency blocks")
        return None

    def leftover_fits(self) -> bool:
        """Whether no leftover capacity reaches a frozen expert, so that the quotas are the
        targets (the usual case); else the reference's flow decides who gets it. The search from
        them stays on A₁'s holders: without slack there, there is none; saturated sets take none."""
        sl, cl, target, gone = self.sl, self.cl, self.target, self.gone
        if not any([sl[r] for r in self.first_ranks]):
            return True
        n = len(cl)
        wanted = [cl[e] - target[e] if not gone[e] else 0 for e in range(n)]
        left = list(wanted)
        short = [e for e in range(n) if left[e]]
        if short:
            max_flow(self.fl, left, self.sl, self.hl, self.hor, short)
            return left == wanted
        return True
