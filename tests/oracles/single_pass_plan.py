"""Frozen: a training call's plan as ``LayerPlanner.plan_call`` made it in one pass before the
backward's part moved off the forward's critical path (dd9407d), the reference the split plan is
checked against (tests/planning/test_backward_plan.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from lrmoe.memory.bytes import KEEP_NOTHING, KEEP_X_GATE_UP, in_rounds, spec_keep
from lrmoe.planning import chunks
from lrmoe.planning import peaks as peak_model
from lrmoe.planning.figures import cap_figures
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.planner import LayerPlanner
from lrmoe.planning.quota_ratio import fixed_ratio_quota
from lrmoe.selection.strata import plan_strata
from lrmoe.systems import PlacementKind


def single_pass(planner: LayerPlanner, counts_SE: torch.Tensor) -> dict:
    """A training call planned as ``LayerPlanner.plan_call`` did before the split (dd9407d), in
    one pass before the forward, with the strata ``StrataSelector.select`` then planned in the
    backward and the assignment ``ResentRows.rows`` then made there."""
    self = planner
    self.observe(counts_SE.sum(0))
    if self.peaks is not None:
        self._last_SE = counts_SE.clone()
    if self.fitter is not None:
        fit, figures, replanned = self._fit_call(counts_SE, counts_SE, True)
    else:
        fit, figures, replanned = self._free_call(counts_SE, counts_SE, True)
    placement = fit.placement
    kept_capacity_R = quota_E = None
    if self.spec.selective:
        kept_capacity_R = self.controller.kept_capacity(placement) if self.controller is not None else None
        quota_E = fixed_ratio_quota(counts_SE.sum(0), self.backward.ratio)
        if self.controller is not None:
            quota_E = torch.minimum(quota_E, self.controller.quotas(counts_SE.sum(0), placement, kept_capacity_R))
    if self.spec.compacts:
        network_R = self.controller.network_R if self.controller is not None else None
        keep = peak_model.keep_mode(self.peaks, placement, fit.assignment, fit.chunk_rows_R, quota_E, network_R,
                                    self.backward.local)
    else:
        keep = fit.keep
    if keep == KEEP_X_GATE_UP:  # (a mode added after the split) its forward's chunks, that it leaves room for
        bwd_R = peak_model.kept_rows_bound(fit.assignment, quota_E)
        fit = replace(fit, chunk_rows_R=chunks.gate_up_chunks(self.peaks, placement, fit.assignment,
                                                                  fit.chunk_rows_R, bwd_R))
    capped = cap_figures(fit, self.memory_R, self.rank, not self.spec.compacts)
    figures = replace(figures, keep_mode=keep or spec_keep(self.spec), replica_slots=len(placement.slots[self.rank]),
                      **capped)
    strata = kept = None
    if self.spec.selective and self.backward.local:
        strata = plan_strata(fit.assignment, placement, counts_SE, quota_E, self.rank)
        if self.spec.compacts and keep == KEEP_NOTHING:
            kept = assign_pairs(self.spec.assignment, strata.kept_SE, placement, kept_capacity_R, self.node_of)
    return {"placement": placement.slots, "assignment": fit.assignment.rows_HS, "chunks": fit.chunk_rows_R,
            "kept_capacity_R": kept_capacity_R, "quota_E": quota_E, "keep": keep, "figures": figures,
            "fetch": self.spec.placement is PlacementKind.PER_CALL or replanned,
            "rounds": fit.chunk_rows_R if in_rounds(self.spec, fit.keep) else None, "strata": strata, "kept": kept}
