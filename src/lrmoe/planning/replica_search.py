"""lrmoe's replica count, chosen by cost under its budget (docs/design.md "The paper's regime").

For k extra slots a rank (0, 1, 2, 3, 4, 6, 8, ... up to the controller's share of memory),
replicas ∝ the smoothed load; on the last training call's counts each plan whose forward fits
is scored by the pairs the controller's quotas keep and by a predicted time: the slowest rank's
forward rows and kept backward rows at the cost model's GEMM rate, plus every replica's refresh
and gradient bytes at its link rate. Among the plans that keep at least 99 % of the most kept
pairs, the fastest wins (ties: fewer replicas). A replica costs memory (its slot, its gradient
buffer and its gradient's send buffer) that would otherwise hold kept rows, so under a tight
cap replicas are taken only where the imbalance they remove is worth more.
"""

from __future__ import annotations

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
        search, and one inside a call, scores every candidate; later ones start at the last choice
        and its neighbours and walk on while the best lies at the edge of those scored (three plans
        under a steady load instead of 10–15)."""
        if last_SE is None:
            return self.base
        extra_R = [s - o for s, o in zip(slots_R, self.base.owned_counts)]
        if self.k is not None and steps % self.interval and not in_call:
            return self._placement(load_E, self.k, extra_R)
        candidates = replica_candidates(max(extra_R))
        if self.k in candidates and not in_call:
            scored = self._walk(load_E, last_SE, extra_R, candidates)
        else:
            scored = self._scan(load_E, last_SE, extra_R, candidates)
        if not scored:
            self.k = 0
            return self.base
        best = self._best(scored)
        self.k = best.k
        return best.placement

    def _score(self, load_E: torch.Tensor, counts_SE: torch.Tensor, extra_R: list[int], k: int) -> _Scored | None:
        """Plan k scored, or None where its forward does not fit."""
        placement = self._placement(load_E, k, extra_R)
        try:
            assignment, _ = self.controller.fit_forward(counts_SE, placement, self.assign(counts_SE, placement, None),
                                                        self.assign)
            quota_E = self.controller.quotas(counts_SE.sum(0), placement)
        except MemoryBudgetExceeded:
            return None
        rows_ER = assignment.rows_ER()
        fwd, bwd = rows_ER.sum(0).max(), torch.minimum(rows_ER, quota_E.view(-1, 1)).sum(0).max()
        replicas = placement.num_copies - self.base.num_experts
        row_s, byte_s = self.costs.row_s, self.costs.byte_s
        time = (int(fwd) + 2 * int(bwd)) * row_s / 3 + replicas * 2 * self.slot_param_bytes * byte_s
        return _Scored(int(quota_E.sum()), time, replicas, placement, k)

    @staticmethod
    def _best(scored: list[_Scored]) -> _Scored:
        most = max(s.kept for s in scored)
        return min((s for s in scored if s.kept >= KEPT_SHARE * most), key=lambda s: (s.time, s.replicas))

    def _scan(self, load_E: torch.Tensor, counts_SE: torch.Tensor, extra_R: list[int], candidates: list[int]
              ) -> list[_Scored]:
        """Every candidate: the first search, and a call whose forward did not fit."""
        scored = []
        for k in candidates:
            s = self._score(load_E, counts_SE, extra_R, k)
            if s is not None:
                scored.append(s)
                if s.replicas == 0 and k:
                    break  # no slot beyond the owned ones: larger k plans the same
        return scored

    def _walk(self, load_E: torch.Tensor, counts_SE: torch.Tensor, extra_R: list[int], candidates: list[int]
              ) -> list[_Scored]:
        """From the last choice, walk while the best plan lies at the edge of the ones scored (the
        cost is one-humped in k: a steady load costs three plans, not every candidate)."""
        at = candidates.index(self.k)
        lo, hi = max(at - 1, 0), min(at + 1, len(candidates) - 1)
        tried = {k: self._score(load_E, counts_SE, extra_R, k) for k in candidates[lo:hi + 1]}
        while any(tried.values()):
            win = self._best([t for t in tried.values() if t])
            if win.k == candidates[lo] and lo > 0:
                lo -= 1
                k = candidates[lo]
            elif win.k == candidates[hi] and hi + 1 < len(candidates) and (win.replicas or not win.k):
                hi += 1  # (a k > 0 with no slot beyond the owned ones: larger k plans the same)
                k = candidates[hi]
            else:
                break
            tried[k] = self._score(load_E, counts_SE, extra_R, k)
        return [t for t in tried.values() if t]
