"""The backward's part of a training call's plan, computed off the forward's critical path.

The forward needs only the placement, its assignment and its chunks; the quotas, the kept
capacities, a compacting backward's keep mode, a local selection's strata and, where the kept
pairs are re-spread, their assignment are needed first by the forward's ``save`` (the keep
mode) and then by the backward. So the layer plans them after the forward's rows and expert
work have been issued (:func:`lrmoe.passes.forward.plan_backward`): on a GPU the host computes
them while the device exchanges and computes the forward's rows; on the CPU they run in the
outputs' exchange. A rank whose forward the plan chunks plans them before its compute instead
(keeping gate/up, it computes every row's gate/up first, then silu, h and y in chunks). Every
input is in the forward's plan, so the result is the one a single planning pass gave, bit for
bit (tests/planning/test_backward_plan.py); nothing here changes planner state.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from lrmoe.config import BackwardConfig
from lrmoe.memory.bytes import KEEP_NOTHING, KEEP_X_ACTS, KEEP_X_GATE_UP
from lrmoe.planning import controller as controller_module
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.call_plan import BackwardPlan, CallPlan
from lrmoe.planning.chunks import gate_up_chunks, recompute_chunks
from lrmoe.planning.noise_control import NoiseController
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.peaks import RankPeaks, kept_rows_bound
from lrmoe.planning.placement import Placement
from lrmoe.planning.quota_ratio import fixed_ratio_quota
from lrmoe.planning.time_objective import fastest_quotas
from lrmoe.selection.strata import plan_strata
from lrmoe.systems import SystemSpec


class BackwardPlanner(Protocol):
    """What backward planning reads of its :class:`~lrmoe.planning.planner.LayerPlanner`, which
    drives this module (a protocol, so that this module needs nothing of the planner's)."""

    spec: SystemSpec
    controller: controller_module.Controller | None
    backward: BackwardConfig
    steps: int
    rank: int
    noise: NoiseController | None
    peaks: RankPeaks | None

    def keep_mode(self, placement: Placement, assignment: PairAssignment, chunk_rows_R: list[int] | None,
                   quota_E: torch.Tensor) -> str: ...


def plan_backward(planner: BackwardPlanner, plan: CallPlan) -> BackwardPlan:
    """The backward's plan of a training call from its forward ``plan`` (pure): the controller's
    kept capacities and quotas (trimmed further where the time objective predicts it pays), the
    keep mode (keeping gate/up, the forward's chunks that leaves room for), and for a local
    selection this rank's strata and, where a compacting backward keeps nothing, the min-peak
    assignment of its kept pairs — the strata fix the kept counts per source from the plan alone,
    so that assignment is known now (a global selection's depends on its scores: its backward
    assigns them)."""
    spec = planner.spec
    if not spec.selective:  # an exact backward: what the forward's fit keeps, nothing else
        return BackwardPlan(keep=plan.keep)
    placement = plan.placement
    counts_SE = plan.forward_SE  # the pairs the forward computed: a forward drop's overflow has no backward
    counts_E = counts_SE.sum(0)
    cfg = planner.backward.at_step(planner.steps)  # the warm phase's within trim_after steps
    least = cfg.recompute_chunk if spec.compacts else 0  # (a masked backward recomputes every row)
    kept_capacity_R = None if planner.controller is None else \
        planner.controller.kept_capacity(placement, int(counts_E.sum()), least)
    quota_E, trimmed = quotas(planner, cfg, counts_E, placement, kept_capacity_R, plan.assignment)
    keep = plan.keep
    if spec.compacts:  # through the planner's method, which tests replace to force a mode
        def keep_of(q_E: torch.Tensor) -> str:
            if plan.rounds_R is not None:  # the forward's rows went in rounds: nothing was kept
                return KEEP_NOTHING
            return planner.keep_mode(placement, plan.assignment, plan.chunk_rows_R, q_E)

        if cfg.objective == "time":
            quota_E, keep = fastest_quotas(counts_E, plan.assignment.rows_ER(), quota_E, keep_of, cfg)
        else:
            keep = keep_of(quota_E)
    strata = kept_assignment = None
    if planner.backward.local:
        strata = plan_strata(plan.assignment, placement, counts_SE, quota_E, planner.rank)
        if spec.compacts and keep == KEEP_NOTHING:
            kept_assignment = assign_pairs(plan.rule, strata.kept_SE, placement, kept_capacity_R, plan.node_of)
    bwd_chunk_rows_R = chunk_rows_R = None
    if keep == KEEP_X_GATE_UP:  # its forward's silu, h and y in chunks where they do not fit at once
        chunk_rows_R = gate_up_chunks(planner.peaks, placement, plan.assignment, plan.chunk_rows_R,
                                      kept_rows_bound(plan.assignment, quota_E))
    elif least and keep != KEEP_X_ACTS:  # kept rows recomputed, in chunks where they do not fit at once
        bwd_R = kept_rows_bound(plan.assignment, quota_E)
        if keep == KEEP_NOTHING:  # re-spread within the kept capacities
            bwd_R = kept_assignment.rows_R() if kept_assignment is not None else kept_capacity_R or bwd_R
        bwd_chunk_rows_R = recompute_chunks(planner.peaks, placement, plan.assignment, plan.chunk_rows_R, keep,
                                            bwd_R, least)
    return BackwardPlan(kept_capacity_R, quota_E, keep, strata, kept_assignment,
                        None if planner.noise is None else trimmed, bwd_chunk_rows_R,
                        None if bwd_chunk_rows_R is None else bwd_chunk_rows_R[planner.rank], chunk_rows_R,
                        None if chunk_rows_R is None else chunk_rows_R[planner.rank])


def quotas(planner: BackwardPlanner, cfg: BackwardConfig, counts_E: torch.Tensor, placement: Placement,
           cap_R: list[int] | None, rows: PairAssignment | None = None) -> tuple[torch.Tensor, bool]:
    """The controller's max–min fair quotas capped by ``cfg``'s ratio (the noise objective's, if
    lower; and the demand-side balance), or the ratio's alone (``rows``: the forward's assignment,
    which spares the solve where it keeps every pair); and whether the controller or the balance
    kept fewer pairs than the ratio."""
    ratio = cfg.ratio if planner.noise is None else min(cfg.ratio, planner.noise.ratio)
    ratio_E = quota_E = fixed_ratio_quota(counts_E, ratio)
    if planner.controller is not None:
        quota_E = torch.minimum(quota_E, planner.controller.quotas(counts_E, placement, cap_R, rows))
    if cfg.balance is not None:
        quota_E = torch.minimum(quota_E, demand_balanced(counts_E, placement, cfg))
    return quota_E, bool((quota_E < ratio_E).any())


def demand_balanced(counts_E: torch.Tensor, placement: Placement, cfg: BackwardConfig) -> torch.Tensor:
    """Demand-side balance: quotas with which no rank's backward keeps more than
    (1 + ``cfg.balance``) × the call's balanced mean of pairs a rank — the overload of hot experts
    trimmed max–min fair (the controller's quota solve, those capacities), never below
    ``cfg.min_ratio`` of an expert's pairs. Kept pairs are taken to spread over their expert's
    holders, as a re-spread backward does; one that computes them where the forward did keeps
    the forward's split of each expert, close to it under min-peak forward assignments.
    Where a rank holds more experts with pairs than the cap has rows, nothing is trimmed."""
    world = len(placement.slots)
    cap = math.ceil((1 + cfg.balance) * float(counts_E.sum()) / world)
    try:  # (through the controller module, where the simulator counts the planner's calls)
        balanced_E = controller_module.max_min_quotas(counts_E, placement.holder_lists, [cap] * world)
    except ValueError:
        return counts_E.to(torch.long).clone()
    return torch.maximum(balanced_E, fixed_ratio_quota(counts_E, cfg.min_ratio))


__all__ = ["BackwardPlan", "BackwardPlanner", "demand_balanced", "plan_backward", "quotas"]
