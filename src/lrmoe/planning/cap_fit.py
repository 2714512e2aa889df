"""Fitting a call's plan within a memory cap, for every system but lrmoe's controller (which
plans within its budget itself): each candidate plan's per-rank peak is predicted
(:class:`~lrmoe.planning.peaks.RankPeaks`) before any row moves, and the planner adopts what
the fitter returns (docs/design.md "The paper's regime"; the rules in :mod:`lrmoe.planning.planner`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.memory.bytes import KEEP_NOTHING, KEEP_X, KEEP_X_ACTS, spec_keep
from lrmoe.memory.replay import RankWork
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.peaks import Fit, RankPeaks
from lrmoe.planning.placement import Placement
from lrmoe.systems import TRIMMING_SYSTEM, Assignment, PlacementKind

Assign = Callable[[torch.Tensor, Placement, "list[int] | None"], PairAssignment]
T = TypeVar("T")


@dataclass(frozen=True)
class SlotSearch:
    """What :meth:`CapFitter.search_slots` found."""

    fit: Fit | None  # the fitting plan, or None
    slots: list[int]  # the slots a rank it tried last
    failed: list[Fit]  # the plans that did not fit


@dataclass(frozen=True)
class CapFitter:
    """Searches the plans of one layer's calls for one that fits every rank's cap."""

    peaks: RankPeaks
    assign: Assign  # the system's assignment rule (counts, placement, rows a rank may take)
    base: Placement
    fixed_slots: bool  # ClusterBudget.slots given: tried as given only
    varies_copies: bool  # the system tries plans with fewer expert copies (the error says so)

    @property
    def memory_R(self) -> list[int]:
        return self.peaks.memory_R

    def keeping(self, keep: str, by_row: bool = False) -> CapFitter:
        """This fitter for plans that keep ``keep`` from forward to backward (``by_row``: by the row)."""
        return replace(self, peaks=replace(self.peaks, keep=keep, by_row=by_row))

    def with_fallbacks(self) -> list[CapFitter]:
        """The fit ladder (docs/design.md "Keep by the row"), one rung a fitter: a system that keeps
        x and the activations keeps by the row instead, each rank as much as its cap allows beside
        the expert copies its placement asks for (:mod:`lrmoe.planning.row_split`: activations,
        gate/up, x alone, recomputing the rest in chunks); an exact (non-selective) system may
        then keep nothing and move its rows in rounds, x re-sent with dy
        (:mod:`lrmoe.parallel.rounds`). Richest first: a cap a richer plan fits never pays for
        recomputation, nor rounds for re-sending."""
        spec = self.peaks.spec
        first = self
        if spec_keep(spec) == KEEP_X_ACTS and not spec.compacts:
            first = self.keeping(KEEP_X, by_row=True)
        return [first] + ([] if spec.selective else [self.keeping(KEEP_NOTHING)])

    def fit(self, forward_SE: torch.Tensor, placement: Placement, training: bool) -> Fit:
        """The call under ``placement``: the system's own assignment, or, where that does not
        fit and copies can share an expert's pairs, a min-peak one within every rank's room."""
        peaks = self.peaks
        fit = peaks.measure(placement, self.assign(forward_SE, placement, None), training)
        if fit.ok or peaks.spec.assignment is Assignment.LOCAL or placement.owners_only:
            return fit
        room_R = [peaks.rows_within(placement, r, training) for r in range(peaks.world)]
        try:
            bounded = peaks.measure(placement, self.assign(forward_SE, placement, room_R), training)
        except ValueError:  # the copies cannot hold the pairs within the rooms
            return fit
        return bounded if bounded.ok else fit

    def longest_prefix(self, make: Callable[[int], Placement], n: int, forward_SE: torch.Tensor,
                       training: bool) -> tuple[int, Fit]:
        """(k, fit) for the largest k ≤ ``n`` whose placement ``make(k)`` fits (per-call copies
        dropped from the end of their list, down to none). Raises :class:`MemoryBudgetExceeded`
        where not even ``make(0)`` fits."""
        failed = []
        for k in range(n, -1, -1):
            fit = self.fit(forward_SE, make(k), training)
            if fit.ok:
                return k, fit
            failed.append(fit)
        raise self.exceeded(failed)

    def search_slots(self, make: Callable[[list[int]], Placement], slots_R: list[int], forward_SE: torch.Tensor,
                     training: bool) -> SlotSearch:
        """The most slots, from ``slots_R`` down, whose placement (``make(slots)``) fits: one slot
        at a time is taken from the rank furthest over its cap (lowest rank on ties) among those
        above their floor, re-planning each time. Fixed ``ClusterBudget.slots`` are tried as given only."""
        world = self.peaks.world
        sharded = self.peaks.spec.placement is PlacementKind.SHARDED
        floor = [0 if sharded else n for n in self.base.owned_counts]
        slots, failed = list(slots_R), []
        while True:
            try:
                placement = make(slots)
            except ValueError:  # laer: too few slots to assemble every expert with pairs
                if not failed:  # the given slots themselves: not a question of memory
                    raise
                break
            fit = self.fit(forward_SE, placement, training)
            if fit.ok:
                return SlotSearch(fit, slots, failed)
            failed.append(fit)
            slots = [min(s, len(placement.slots[r])) for r, s in enumerate(slots)]
            lower = [r for r in range(world) if slots[r] > floor[r]]
            if not lower or self.fixed_slots:
                break
            slots[max(lower, key=lambda r: (fit.peak_R[r] - self.memory_R[r], -r))] -= 1
        return SlotSearch(None, slots, failed)

    def exceeded(self, failed: list[Fit]) -> MemoryBudgetExceeded:
        """The error for the plan that came closest (smallest overflow), at its worst rank."""
        M = self.memory_R
        best = min(failed, key=lambda f: max(p - m for p, m in zip(f.peak_R, M)))
        r = max(range(self.peaks.world), key=lambda r: (best.peak_R[r] - M[r], -r))
        rows = best.assignment.rows_R()[r]
        # the error a call raises is its leanest fitter's (first_that_fits)
        kept = ("nothing kept to the backward and every exchange in rounds of one row" if self.peaks.rounds
                else "x of every row kept to the backward, its forward and backward chunked")
        helps = ("a larger cap or fewer tokens per call would help, or a system that trims its backward "
                 f"({TRIMMING_SYSTEM})")
        tried = "no plan with fewer expert copies fits either; " if self.varies_copies else ""
        return MemoryBudgetExceeded(
            r, best.peak_R[r], M[r],
            f"it receives {rows} rows and holds {len(best.placement.slots[r])} expert copies, {kept}; {tried}{helps}")

    def check_owned(self) -> None:
        """A cap must hold what a rank holds whatever the call: its owned experts (laer: slices)."""
        peaks = self.peaks
        sharded = peaks.spec.placement is PlacementKind.SHARDED
        E = peaks.config.num_experts
        for r, owned_r in enumerate(self.base.owned_counts):
            owned = 0 if sharded else owned_r
            need = peaks.peak(RankWork(0, 0, owned, owned, None, peaks.world, sharded, E if sharded else 0))
            if need > self.memory_R[r]:
                raise MemoryBudgetExceeded(r, need, self.memory_R[r], "a larger cap or more ranks would help",
                                           "the experts it owns (parameters and gradients)")


def first_that_fits(fitters: list[CapFitter], attempt: Callable[[CapFitter], T]) -> T:
    """``attempt`` by each fitter in turn (:meth:`CapFitter.with_fallbacks`: richest keep first):
    the first result that does not raise :class:`MemoryBudgetExceeded`, else the last one's error."""
    for fitter in fitters[:-1]:
        try:
            return attempt(fitter)
        except MemoryBudgetExceeded:
            pass
    return attempt(fitters[-1])
