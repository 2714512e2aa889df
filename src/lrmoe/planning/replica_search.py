"""lrmoe's replica count, chosen by cost under its budget: the part of
:class:`lrmoe.planning.planner.LayerPlanner` that searches how many replica slots a rank gets (a mixin: it
reads the planner's base placement, smoothed load, controller, costs and byte model). The rule is
in :meth:`ReplicaSearch._controller_replicas` and docs/design.md "The paper's regime".
"""

from __future__ import annotations

import torch

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.planning.placement import Placement, plan_replicas


def replica_candidates(most: int) -> list[int]:
    """Extra slots per rank a cost search tries: 0..3, then powers of two and their 1.5×, up to
    ``most`` (a few plans to score at any scale, dense where one replica matters most)."""
    out, k = {0, 1, 2, 3}, 4
    while k < most:
        out.update((k, k + k // 2))
        k *= 2
    return sorted(c for c in out | {most} if c <= most)


class ReplicaSearch:
    """lrmoe's replica-count search (mixin of :class:`lrmoe.planning.planner.LayerPlanner`)."""

    def _controller_replicas(self, in_call: bool = False) -> Placement:
        """lrmoe's replicas under its budget: re-planned every step, their number chosen by cost
        (docs/design.md "The paper's regime"). For k extra slots per rank (0, 1, 2, 3, 4, 6, 8, ... up to the
        controller's share of memory), replicas ∝ the smoothed load; on the last training call's
        counts each plan whose forward fits is scored by the pairs the controller's quotas keep
        and by a predicted time: the slowest rank's forward rows and kept backward rows at the
        cost model's GEMM rate, plus every replica's refresh and gradient bytes at its link rate.
        Among the plans that keep at least 99 % of the most kept pairs, the fastest wins (ties:
        fewer replicas). A replica costs memory (its slot, its gradient buffer, and, for a rank's
        first, a second copy of the owned weights) that would otherwise hold kept rows, so under
        a tight cap replicas are taken only where the imbalance they remove is worth more.
        Before any call: owned experts only. The search runs every ``replan_interval`` steps (and
        when a call's forward does not fit); in between, the replicas follow the load with the
        number it chose. The first search, and one inside a call, scores every candidate; later
        ones start at the last choice and its neighbours and walk on while the best lies at the
        edge of those scored (three plans under a steady load instead of 10–15)."""
        if self._last_SE is None:
            return self.base
        owned_R = [len(self.base.owned(r)) for r in range(self.world)]
        extra_R = [s - o for s, o in zip(self.default_slots_R, owned_R)]
        if self._replica_k is not None and self.steps % self.search_interval and not in_call:
            k = self._replica_k
            return plan_replicas(self.base, self.load_E, [o + min(k, x) for o, x in zip(owned_R, extra_R)]) \
                if k else self.base
        counts_SE, counts_E = self._last_SE, self._last_SE.sum(0)
        row_s, byte_s = self.costs.row_s, self.costs.byte_s

        def score(k: int) -> tuple | None:
            """(kept pairs, predicted time, replicas, placement, k), or None where the forward does not fit."""
            slots_R = [o + min(k, x) for o, x in zip(owned_R, extra_R)]
            placement = plan_replicas(self.base, self.load_E, slots_R) if k else self.base
            try:
                assignment, _ = self._controller_forward(counts_SE, placement, self.assign(counts_SE, placement))
                quota_E = self.controller.quotas(counts_E, placement)
            except MemoryBudgetExceeded:
                return None
            rows_ER = assignment.rows_ER()
            fwd, bwd = rows_ER.sum(0).max(), torch.minimum(rows_ER, quota_E.view(-1, 1)).sum(0).max()
            replicas = placement.num_copies - self.config.num_experts
            time = (int(fwd) + 2 * int(bwd)) * row_s / 3 + replicas * 2 * self.bytes.slot_params * byte_s
            return int(quota_E.sum()), time, replicas, placement, k

        def best(scored: list[tuple]) -> tuple:
            most = max(kept for kept, *_ in scored)
            return min((s for s in scored if s[0] >= 0.99 * most), key=lambda s: (s[1], s[2]))

        candidates = replica_candidates(max(extra_R))
        if self._replica_k in candidates and not in_call:
            # from the last choice, walk while the best plan lies at the edge of the ones scored
            # (the cost is one-humped in k: a steady load costs three plans, not every candidate)
            at = candidates.index(self._replica_k)
            lo, hi = max(at - 1, 0), min(at + 1, len(candidates) - 1)
            tried = {k: score(k) for k in candidates[lo:hi + 1]}
            while any(tried.values()):
                win = best([t for t in tried.values() if t])
                if win[4] == candidates[lo] and lo > 0:
                    lo -= 1
                    k = candidates[lo]
                elif win[4] == candidates[hi] and hi + 1 < len(candidates) and (win[2] or not win[4]):
                    hi += 1  # (a k > 0 with no slot beyond the owned ones: larger k plans the same)
                    k = candidates[hi]
                else:
                    break
                tried[k] = score(k)
            scored = [t for t in tried.values() if t]
        else:  # every candidate: the first search, and a call whose forward did not fit
            scored = []
            for k in candidates:
                t = score(k)
                if t is not None:
                    scored.append(t)
                    if t[2] == 0 and k:
                        break  # no slot beyond the owned ones: larger k plans the same
        if not scored:
            self._replica_k = 0
            return self.base
        *_, placement, self._replica_k = best(scored)
        return placement

    @property
    def replica_count_chosen(self) -> bool:
        """lrmoe: its replica-count search has run once (the first scores every candidate)."""
        return self._replica_k is not None


__all__ = ["ReplicaSearch", "replica_candidates"]
