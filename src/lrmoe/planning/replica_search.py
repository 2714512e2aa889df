"""lrmoe's replica count, chosen by cost under its budget (docs/design.md "The paper's regime").

For k extra slots a rank (0, 1, 2, 3, 4, 6, 8, ... up to the controller's share of memory),
replicas ∝ the smoothed load; on the last training call's counts each plan whose forward fits
is scored by the pairs the controller's quotas keep and by a predicted time: the slowest rank's
forward rows and kept backward rows at the cost model's GEMM rate, plus every replica's refresh
and gradient bytes at its link rate. Among the plans that keep at least 99 % of the most kept
pairs, the fastest wins (ties: fewer replicas). A replica costs memory (its slot, its gradient
buffer and its gradient's send buffer) that would otherwise hold kept rows, so under a tight
cap replicas are taken only where the imbalance they remove is worth more.

Scoring a plan costs a min-peak assignment and a quota solve; most candidates need neither.
Before scoring, a plan is bounded from the counts alone (:class:`_Trials`): where a plan already
scored keeps at least as many pairs as it can and is faster than it can be, it cannot win, and
it is not scored — the search's choice is the one scoring every candidate would give.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.controller import Controller
from lrmoe.planning.cost import CostModel
from lrmoe.planning.placement import Placement, plan_replicas

KEPT_SHARE = 0.99  # plans keeping at least this share of the most kept pairs compete on time


def replica_candidates(most: int) -> list[int]:
    """Extra slots per rank a cost search tries: 0..3, then powers of two and their 1.5×, up to
    ``most`` (a few plans to score at any scale, dense where one replica matters most)."""
    out, k = {0, 1, 2, 3}, 4
    while k < most:
        out.update((k, k + k // 2))
        k *= 2
    return sorted(c for c in out | {most} if c <= most)


@dataclass(frozen=True)
class _Scored:
    kept: int  # pairs the controller's quotas keep
    time: float  # predicted seconds
    replicas: int
    placement: Placement
    k: int  # extra slots a rank


class ReplicaCountSearch:
    """How many replica slots lrmoe's ranks get, searched every ``interval`` steps (and inside a
    call whose forward does not fit); in between, the replicas follow the load with the number it
    chose. Before any call: owned experts only."""

    def __init__(self, base: Placement, controller: Controller, costs: CostModel, slot_param_bytes: int,
                 interval: int, assign: Callable[[torch.Tensor, Placement, list[int] | None], PairAssignment]
                 ) -> None:
        self.base, self.controller, self.costs = base, controller, costs
        self.slot_param_bytes = slot_param_bytes
        self.interval = interval
        self.assign = assign
        self.k: int | None = None  # the extra slots the last search chose

    @property
    def chosen(self) -> bool:
        """The search has run once (the first scores every candidate)."""
        return self.k is not None

    def _placement(self, load_E: torch.Tensor, k: int, extra_R: list[int]) -> Placement:
        slots_R = [o + min(k, x) for o, x in zip(self.base.owned_counts, extra_R)]
        return plan_replicas(self.base, load_E, slots_R) if k else self.base

    def choose(self, load_E: torch.Tensor, last_SE: torch.Tensor | None, steps: int, slots_R: list[int],
               in_call: bool = False) -> Placement:
        """The replica placement for the next calls, after ``steps`` optimizer steps, with at
        most ``slots_R`` expert slots a rank (the controller's share of memory). The first
        search, and one inside a call, looks at every candidate; later ones start at the last
        choice and its neighbours and walk on while the best lies at the edge of those looked at
        (three plans under a steady load instead of 10–15, one of them scored)."""
        if last_SE is None:
            return self.base
        extra_R = [s - o for s, o in zip(slots_R, self.base.owned_counts)]
        if self.k is not None and steps % self.interval and not in_call:
            return self._placement(load_E, self.k, extra_R)
        candidates = replica_candidates(max(extra_R))
        trials = _Trials(self, load_E, last_SE, extra_R)
        if self.k in candidates and not in_call:
            self._walk(trials, candidates)
        else:
            self._scan(trials, candidates)
        best = trials.best()
        if best is None:
            self.k = 0
            return self.base
        self.k = best.k
        return best.placement

    def time(self, fwd_rows: int, bwd_rows: int, replicas: int) -> float:
        """Predicted seconds of a plan: its slowest rank's forward and kept backward rows, and
        its replicas' refresh and gradient bytes (non-decreasing in each argument)."""
        row_s, byte_s = self.costs.row_s, self.costs.byte_s
        return (fwd_rows + 2 * bwd_rows) * row_s / 3 + replicas * 2 * self.slot_param_bytes * byte_s

    def score(self, placement: Placement, counts_SE: torch.Tensor, k: int) -> _Scored | None:
        """Plan k scored, or None where its forward does not fit (or, with replicas, only in
        rounds). Its forward assignment is the
        quota solve's certificate where every rank's rows fit its kept capacity."""
        replicas = placement.num_copies - self.base.num_experts
        try:
            forward = self.controller.fit_forward(counts_SE, placement, self.assign(counts_SE, placement, None),
                                                  self.assign)
            if forward.rounds and replicas:  # no replica is worth moving the forward's rows in rounds
                return None
            assignment = forward.assignment
            quota_E = self.controller.quotas(counts_SE.sum(0), placement, rows=assignment)
        except MemoryBudgetExceeded:
            return None
        rows_ER = assignment.rows_ER()
        fwd, bwd = rows_ER.sum(0).max(), torch.minimum(rows_ER, quota_E.view(-1, 1)).sum(0).max()
        return _Scored(int(quota_E.sum()), self.time(int(fwd), int(bwd), replicas), replicas, placement, k)

    @staticmethod
    def _best(scored: list[_Scored]) -> _Scored:
        most = max(s.kept for s in scored)
        # ties: fewer replicas, then fewer slots (the same choice in whatever order plans were scored)
        return min((s for s in scored if s.kept >= KEPT_SHARE * most), key=lambda s: (s.time, s.replicas, s.k))

    @staticmethod
    def _scan(trials: _Trials, candidates: list[int]) -> None:
        """Every candidate: the first search, and a call whose forward did not fit."""
        for k in candidates:
            trials.look(k)
            if k and not trials.replicas[k]:
                break  # no slot beyond the owned ones: larger k plans the same

    def _walk(self, trials: _Trials, candidates: list[int]) -> None:
        """From the last choice, walk while the best plan lies at the edge of the ones looked at
        (the cost is one-humped in k: a steady load looks at three plans, not every candidate).
        The last choice is looked at first, so that its neighbours are bounded against it."""
        at = candidates.index(self.k)
        lo, hi = max(at - 1, 0), min(at + 1, len(candidates) - 1)
        for k in [candidates[at], *candidates[lo:at], *candidates[at + 1:hi + 1]]:
            trials.look(k)
        while (win := trials.best()) is not None:
            if win.k == candidates[lo] and lo > 0:
                lo -= 1
                k = candidates[lo]
            elif win.k == candidates[hi] and hi + 1 < len(candidates) and (win.replicas or not win.k):
                hi += 1  # (a k > 0 with no slot beyond the owned ones: larger k plans the same)
                k = candidates[hi]
            else:
                break
            trials.look(k)


@dataclass(frozen=True)
class _Bound:
    """What no assignment or quota solve on a plan can beat: its most kept pairs, its slowest
    rank's fewest forward rows, and its replicas (exact)."""

    kept: int
    least: int  # fewest pairs its quotas keep: every pair where each rank can keep all of its experts'
    fwd: int
    replicas: int
    placement: Placement
    k: int


class _Trials:
    """The candidates of one search: each planned and bounded from the counts alone, and scored
    (an assignment and a quota solve) only where the bound leaves it a chance against the best
    plan scored so far. A plan left unscored cannot change the choice: the best scored plan is
    faster than it can be, and keeps at least 99 % of the most pairs even if it kept all it can
    (so that best stays eligible whatever it keeps, and beats it where it is). Every decision
    of the search (:meth:`best`) checks that again for every plan left unscored, and scores any
    for which it no longer holds: the choices are the ones scoring every plan looked at gives.
    The bounds:

    - kept pairs ≤ every pair, and ≤ Σ over ranks of min(kept capacity, pairs of the experts
      the rank holds);
    - forward rows of the slowest rank ≥ the balanced share, and ≥ the pairs of the experts a
      rank holds alone (with owned experts only: exactly the owners' rows);
    - kept pairs ≥ every pair where each rank can keep all of its experts' pairs;
    - kept backward rows of the slowest rank ≥ the balanced share of its kept pairs, and of the
      pairs a plan must keep to compete (99 % of the most any plan scored keeps)."""

    def __init__(self, search: ReplicaCountSearch, load_E: torch.Tensor, counts_SE: torch.Tensor,
                 extra_R: list[int]) -> None:
        self.search, self.load_E, self.counts_SE, self.extra_R = search, load_E, counts_SE, extra_R
        self.counts_E = counts_SE.sum(0).tolist()
        self.pairs = sum(self.counts_E)
        self.scored: dict[int, _Scored] = {}  # k -> its plan scored (those whose forward fits)
        self.unscored: dict[int, _Bound] = {}  # k -> the bounds of a plan not scored
        self.replicas: dict[int, int] = {}  # k -> replicas of its plan, every candidate looked at

    def look(self, k: int) -> None:
        """Plan k extra slots a rank; score the plan unless its bounds rule it out."""
        if k in self.replicas:
            return
        placement = self.search._placement(self.load_E, k, self.extra_R)
        kept, least = self._kept_bounds(placement)
        bound = _Bound(kept, least, self._forward_bound(placement), placement.num_copies - self.search.base.num_experts,
                       placement, k)
        self.replicas[k] = bound.replicas
        if self.scored and self._beaten(bound, self._best()):
            self.unscored[k] = bound
        else:
            self._score(bound)

    def best(self) -> _Scored | None:
        """The best plan scored (None: none fits), once every plan left unscored is beaten by it."""
        while self.scored:
            best = self._best()
            doubtful = [b for b in self.unscored.values() if not self._beaten(b, best)]
            if not doubtful:
                return best
            for bound in doubtful:
                del self.unscored[bound.k]
                self._score(bound)
        return None

    def _best(self) -> _Scored:
        return self.search._best(list(self.scored.values()))

    def _score(self, bound: _Bound) -> None:
        scored = self.search.score(bound.placement, self.counts_SE, bound.k)
        if scored is not None:
            self.scored[bound.k] = scored

    def _beaten(self, bound: _Bound, best: _Scored) -> bool:
        """``best`` stays eligible whatever the plan keeps, and is faster than it can be (ties:
        fewer replicas)."""
        most = max(s.kept for s in self.scored.values())
        if best.kept < KEPT_SHARE * max(most, bound.kept):
            return False
        bwd = -(-max(bound.least, math.ceil(KEPT_SHARE * most)) // bound.placement.world)
        return (best.time, best.replicas) < (self.search.time(bound.fwd, bwd, bound.replicas), bound.replicas)

    def _kept_bounds(self, placement: Placement) -> tuple[int, int]:
        """Most and fewest pairs the quotas on ``placement`` keep: each rank keeps at most its
        kept capacity and the pairs of the experts it holds; where every rank can keep all of
        them, the quotas keep every pair."""
        cap_R = self.search.controller.kept_capacity(placement, self.pairs)
        held_R = [sum(self.counts_E[e] for e in experts) for experts in placement.slots]
        most = min(self.pairs, sum(min(c, h) for c, h in zip(cap_R, held_R)))
        return most, self.pairs if all(h <= c for c, h in zip(cap_R, held_R)) else 0

    def _forward_bound(self, placement: Placement) -> int:
        """Fewest forward rows the slowest rank of any assignment on ``placement`` computes."""
        alone = [0] * placement.world
        for e, holders in enumerate(placement.holder_lists):
            if len(holders) == 1:
                alone[holders[0]] += self.counts_E[e]
        return max(-(-self.pairs // placement.world), *alone)
