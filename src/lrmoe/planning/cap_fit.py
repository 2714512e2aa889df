"""Fitting a call's plan within a memory cap: the part of :class:`lrmoe.planning.planner.LayerPlanner` that
predicts every rank's expert-side peak from a plan before any row moves and searches for a plan
that fits (docs/design.md "The paper's regime"). The rules are in :mod:`lrmoe.planning.planner`'s docstring.

The predictions replay the layer's meter on numbers (:func:`lrmoe.memory.bytes.expert_side_peak`), so
what is predicted here is what the layer then measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.memory.bytes import KEEP_MODES, KEEP_NOTHING, KEEP_X_ACTS, RankWork, expert_side_peak, position_bytes
from lrmoe.planning import replication as planners
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement
from lrmoe.systems import Assignment, PlacementKind, Planner


@dataclass(frozen=True)
class _Fit:
    """One candidate plan of a call under a memory cap, with every rank's predicted peak."""

    placement: Placement
    assignment: PairAssignment
    chunk_rows_R: list[int]
    peak_R: list[int]
    ok: bool  # every rank within its cap


class CapFitting:
    """Memory-cap methods of :class:`lrmoe.planning.planner.LayerPlanner` (a mixin: they read the planner's
    spec, config, placement state and byte model)."""

    def _work(self, placement: Placement, r: int, rows: int, training: bool, chunk: int | None = None) -> RankWork:
        """What rank r's expert side handles computing ``rows`` rows under ``placement`` (the
        backward of these systems carries the forward's rows)."""
        sharded = self.spec.placement is PlacementKind.SHARDED
        E = self.config.num_experts
        owned = 0 if sharded else len(placement.owned(r))
        return RankWork(rows, rows if training else 0, len(placement.slots[r]), owned, chunk, self.world,
                        sharded or placement.num_copies > E, E if sharded else 0, training)

    def _peak(self, work: RankWork) -> int:
        return expert_side_peak(self.spec, self.config.dim, self.config.ffn_dim, self.bytes.dtype_bytes, work)

    @property
    def _chunks(self) -> bool:
        """The forward may be chunked: the system keeps no activations to the backward."""
        return not self.spec.saves_activations

    def keep_mode(self, placement: Placement, assignment: PairAssignment, chunk_rows_R: list[int] | None,
                  quota_E: torch.Tensor) -> str:
        """What a compacting backward's expert side keeps from forward to backward, identical on
        every rank (decided from the plan alone): without a cap the fastest, x and activations
        (no re-sent x, no recompute); under a cap the richest mode whose predicted peak fits
        every rank and, with a network budget, whose backward bytes fit it too. Kept pairs are then
        computed where the forward computed them, so rank r's backward rows are at most
        Σ_e min(its forward rows of e, q_e); x and activations need an unchunked forward."""
        if self.memory_R is None:
            return KEEP_X_ACTS
        rows_ER = assignment.rows_ER()
        fwd_R = rows_ER.sum(0).tolist()
        bwd_R = torch.minimum(rows_ER, quota_E.view(-1, 1)).sum(0).tolist()
        chunk_R = chunk_rows_R or [None] * self.world
        network_R = self.controller.network_R if self.controller is not None else None
        # kept rows' dy in and dx out, plus a local selection's kept positions or a global one's
        # kept byte per forward row
        position = position_bytes(self.bytes.dtype_bytes) if self.backward.local else 0
        mask = 0 if self.backward.local else 1
        if network_R is not None and any(
                (2 * self.bytes.row + position) * int(bwd_R[r]) + mask * int(fwd_R[r]) > network_R[r]
                for r in range(self.world)):
            return KEEP_NOTHING  # only a re-spread of the kept pairs keeps every rank within its network
        for mode in KEEP_MODES[:-1]:
            if mode == KEEP_X_ACTS and any(c is not None and c < n for c, n in zip(chunk_R, fwd_R)):
                continue
            if all(self._peak(replace(self._work(placement, r, int(fwd_R[r]), True, chunk_R[r]),
                                      bwd_rows=int(bwd_R[r]), keep=mode)) <= self.memory_R[r]
                   for r in range(self.world)):
                return mode
        return KEEP_NOTHING

    def _rank_fit(self, placement: Placement, r: int, rows: int, training: bool) -> tuple[int, int]:
        """(chunk rows, predicted peak) of rank r computing ``rows`` rows: all at once where that
        fits, else the largest chunk that does; the peak is over the cap where nothing fits."""
        cap = self.memory_R[r]
        peak = self._peak(self._work(placement, r, rows, training))
        if peak <= cap or not self._chunks or rows <= 1:
            return max(rows, 1), peak
        lo, hi = 1, rows - 1  # the largest chunk within the cap, if chunks of one row are
        if self._peak(self._work(placement, r, rows, training, lo)) > cap:
            return lo, self._peak(self._work(placement, r, rows, training, lo))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._peak(self._work(placement, r, rows, training, mid)) <= cap:
                lo = mid
            else:
                hi = mid - 1
        return lo, self._peak(self._work(placement, r, rows, training, lo))

    def _rows_within(self, placement: Placement, r: int, training: bool) -> int:
        """Most rows rank r can compute within its cap under ``placement`` (chunked if need be)."""
        chunk = 1 if self._chunks else None

        def fits(n: int) -> bool:
            return self._peak(self._work(placement, r, n, training, chunk)) <= self.memory_R[r]

        if not fits(0):
            return 0
        lo, hi = 0, self.memory_R[r] // self.bytes.row + 1  # fits(lo), not fits(hi): a row is ≥ D·s bytes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def _measure(self, placement: Placement, assignment: PairAssignment, training: bool) -> _Fit:
        recv_R = assignment.rows_R()
        chunk_R, peak_R = zip(*(self._rank_fit(placement, r, int(n), training) for r, n in enumerate(recv_R)))
        ok = all(p <= m for p, m in zip(peak_R, self.memory_R))
        return _Fit(placement, assignment, list(chunk_R), list(peak_R), ok)

    def _fit(self, forward_SE: torch.Tensor, placement: Placement, training: bool) -> _Fit:
        """The call under ``placement``: the system's own assignment, or, where that does not
        fit and copies can share an expert's pairs, a min-peak one within every rank's room."""
        fit = self._measure(placement, self.assign(forward_SE, placement), training)
        if fit.ok or self.spec.assignment is Assignment.LOCAL or placement.owners_only:
            return fit
        room_R = [self._rows_within(placement, r, training) for r in range(self.world)]
        try:
            bounded = self._measure(placement, self.assign(forward_SE, placement, room_R), training)
        except ValueError:  # the copies cannot hold the pairs within the rooms
            return fit
        return bounded if bounded.ok else fit

    def _search_slots(self, make: Callable[[list[int]], Placement], slots_R: list[int], forward_SE: torch.Tensor,
                      training: bool) -> tuple[_Fit | None, list[int], list[_Fit]]:
        """The most slots, from ``slots_R`` down, whose placement fits: one slot at a time is taken
        from the rank furthest over its cap (lowest rank on ties) among those above their floor,
        re-planning each time. Fixed ``ClusterBudget.slots`` are tried as given only.
        Returns (the fitting plan or None, the slots it used, the plans that did not fit)."""
        sharded = self.spec.placement is PlacementKind.SHARDED
        floor = [0 if sharded else len(self.base.owned(r)) for r in range(self.world)]
        slots, failed = list(slots_R), []
        while True:
            try:
                placement = make(slots)
            except ValueError:  # laer: too few slots to assemble every expert with pairs
                if not failed:  # the given slots themselves: not a question of memory
                    raise
                break
            fit = self._fit(forward_SE, placement, training)
            if fit.ok:
                return fit, slots, failed
            failed.append(fit)
            slots = [min(s, len(placement.slots[r])) for r, s in enumerate(slots)]
            lower = [r for r in range(self.world) if slots[r] > floor[r]]
            if not lower or self.fixed_slots_R is not None:
                break
            slots[max(lower, key=lambda r: (fit.peak_R[r] - self.memory_R[r], -r))] -= 1
        return None, slots, failed

    def _fit_call(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor, training: bool
                  ) -> tuple[_Fit, dict, bool]:
        """A capped call's plan within the cap: (plan, its stats, whether a per-step placement
        was re-planned inside the call). Raises :class:`MemoryBudgetExceeded` where none fits."""
        kind, planner = self.spec.placement, self.spec.planner
        if kind in (PlacementKind.PER_CALL, PlacementKind.SHARDED):
            if planner is Planner.SHADOW:  # the most shadows that fit, least-loaded dropped first
                load = counts_SE.sum(0).tolist()
                shadow = sorted(planners.shadow_experts(counts_SE, self.base, self.costs), key=lambda e: (-load[e], e))
                failed = []
                for k in range(len(shadow), -1, -1):
                    fit = self._fit(forward_SE, self._shadow_placement(shadow[:k]), training)
                    if fit.ok:
                        break
                    failed.append(fit)
                else:
                    raise self._exceeded(failed)
                stats = self._call_stats(fit.placement, k)
            else:
                fit, _, failed = self._search_slots(lambda s: self._call_placement(counts_SE, s), self.slots_R,
                                                    forward_SE, training)
                if fit is None:
                    raise self._exceeded(failed)
                stats = self._call_stats(fit.placement)
            self.placement = fit.placement
            return fit, stats, False
        fit = self._fit(forward_SE, self.placement, training)
        if fit.ok:
            return fit, {}, False
        failed = [fit]
        if training and self.keeps_replicas and self.fixed_slots_R is None:
            # re-plan inside the call; the new copies are fetched before any row moves
            refit, slots, more = self._search_slots(self._step_placement, self.default_slots_R, forward_SE, training)
            if refit is not None:
                self.slots_R = slots
                self._adopt(refit.placement)
                return refit, {"replanned_in_call": True}, True
            failed += more
        raise self._exceeded(failed)

    def _exceeded(self, failed: list[_Fit]) -> MemoryBudgetExceeded:
        """The error for the plan that came closest (smallest overflow), at its worst rank."""
        M = self.memory_R
        best = min(failed, key=lambda f: max(p - m for p, m in zip(f.peak_R, M)))
        r = max(range(self.world), key=lambda r: (best.peak_R[r] - M[r], -r))
        rows = best.assignment.rows_R()[r]
        kept = ("x and activations of every row kept to the backward" if self.spec.saves_activations
                else "x of every row kept to the backward")
        helps = "a larger cap or fewer tokens per call would help"
        if self.spec.saves_activations:
            helps += ", or a system that keeps less to the backward (static-recompute: rows only; lrmoe: nothing)"
        tried = ""
        if self.default_slots_R is not None or self.spec.planner is Planner.SHADOW:
            tried = "no plan with fewer expert copies fits either; "
        return MemoryBudgetExceeded(
            r, best.peak_R[r], M[r],
            f"it receives {rows} rows and holds {len(best.placement.slots[r])} expert copies, {kept}; {tried}{helps}")

    def _check_owned(self) -> None:
        """A cap must hold what a rank holds whatever the call: its owned experts (laer: slices)."""
        sharded = self.spec.placement is PlacementKind.SHARDED
        for r in range(self.world):
            owned = 0 if sharded else len(self.base.owned(r))
            need = self._peak(RankWork(0, 0, owned, owned, None, self.world, sharded,
                                       self.config.num_experts if sharded else 0))
            if need > self.memory_R[r]:
                raise MemoryBudgetExceeded(r, need, self.memory_R[r], "a larger cap or more ranks would help",
                                           "the experts it owns (parameters and gradients)")

    def _controller_forward(self, forward_SE: torch.Tensor, placement: Placement, assignment: PairAssignment
                            ) -> tuple[PairAssignment, list[int]]:
        """lrmoe's forward within its budget: the controller's chunks, on a min-peak assignment
        within each rank's forward room where the unbounded one leaves a rank no room to compute.
        Every rank checks every rank, so all raise together."""
        c = self.controller

        def chunks(a: PairAssignment) -> list[int]:
            return [c.forward_chunk_rows(placement, r, n) for r, n in enumerate(a.rows_R())]

        try:
            return assignment, chunks(assignment)
        except MemoryBudgetExceeded as err:
            if placement.owners_only:
                raise
            room_R = [c.forward_rows_capacity(placement, r) for r in range(self.world)]
            try:
                bounded = self.assign(forward_SE, placement, room_R)
            except ValueError:
                raise err from None
            return bounded, chunks(bounded)
