"""Which copy computes which pairs: the assignment rule a :class:`~lrmoe.systems.SystemSpec`
names, as one pure function of the counts and the placement. The planner assigns a call's
forward with it; the backward re-assigns its kept pairs with the same function (it rides in the
:class:`~lrmoe.planning.call_plan.CallPlan`), so the backward never calls the planner."""

from __future__ import annotations

import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.balance import min_peak_assignment
from lrmoe.planning.placement import Placement
from lrmoe.planning.strategies import least_loaded, node_aware, shadow
from lrmoe.systems import Assignment


def assign_pairs(rule: Assignment, counts_SE: torch.Tensor, placement: Placement,
                 capacity_R: list[int] | None = None, node_of: list[int] | None = None) -> PairAssignment:
    """Where each pair is computed: single copies go to their owner; replicated experts are
    spread min-peak (within ``capacity_R`` rows a rank, if given); shadowed experts compute where
    their pairs are; node-aware systems then re-match sources to holders inside their node;
    least-loaded spilling (:func:`least_loaded_assignment`) gives each copy the rows LLEP's
    decision gives it (min-peak instead where ``capacity_R`` bounds the ranks: a memory cap's
    fallback)."""
    if rule is Assignment.LOCAL:
        return shadow.local_assignment(counts_SE, placement)
    if placement.owners_only:
        return placement.owner_assignment(counts_SE)
    if rule is Assignment.LEAST_LOADED and capacity_R is None:
        return least_loaded_assignment(counts_SE, placement, node_of)
    assignment = min_peak_assignment(counts_SE.t(), placement.holder_index, capacity_R)
    if rule is Assignment.LOCALIZED:
        assignment = node_aware.localize(assignment, node_of)
    return assignment


def least_loaded_assignment(counts_SE: torch.Tensor, placement: Placement,
                            node_of: list[int] | None = None) -> PairAssignment:
    """LLEP's rule: the rows each copy computes are :func:`~lrmoe.planning.strategies.least_loaded.holder_rows`'s
    (the owner up to the row cap, the overflow in chunks to the least-loaded holders), and each
    holder's rows are taken from the sources by :func:`~lrmoe.planning.strategies.node_aware.match_sources`:
    its own source's pairs first (they never cross the wire), then (with a topology) its node's,
    then the other sources' in rank order. Integers only: the same on every rank."""
    counts_ES = counts_SE.t().to(torch.long).numpy()
    rows_EW = least_loaded.holder_rows(counts_SE.sum(0), placement)
    index = placement.holder_index
    return node_aware.match_sources(index.expert_H, index.rank_H, counts_ES, rows_EW, node_of)
