"""Which copy computes which pairs: the assignment rule a :class:`~lrmoe.systems.SystemSpec`
names, as one pure function of the counts and the placement. The planner assigns a call's
forward with it; the backward re-assigns its kept pairs with the same function (it rides in the
:class:`~lrmoe.planning.call_plan.CallPlan`), so the backward never calls the planner."""

from __future__ import annotations

import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.balance import min_peak_assignment
from lrmoe.planning.placement import Placement
from lrmoe.planning.strategies import node_aware, shadow
from lrmoe.systems import Assignment


def assign_pairs(rule: Assignment, counts_SE: torch.Tensor, placement: Placement,
                 capacity_R: list[int] | None = None, node_of: list[int] | None = None) -> PairAssignment:
    """Where each pair is computed: single copies go to their owner; replicated experts are
    spread min-peak (within ``capacity_R`` rows a rank, if given); shadowed experts compute where
    their pairs are; node-aware systems then re-match sources to holders inside their node."""
    if rule is Assignment.LOCAL:
        return shadow.local_assignment(counts_SE, placement)
    if placement.owners_only:
        return placement.owner_assignment(counts_SE)
    assignment = min_peak_assignment(counts_SE.t(), placement.holder_index, capacity_R)
    if rule is Assignment.LOCALIZED:
        assignment = node_aware.localize(assignment, node_of)
    return assignment
