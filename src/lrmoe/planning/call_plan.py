"""What one layer call does, decided before any row moves and identical on every rank.

A training call's plan comes in two parts (:mod:`lrmoe.planning.backward_plan`): the forward's
(placement, assignment, chunks), which the forward waits for, and the backward's (quotas, kept
capacities, keep mode, strata, the kept pairs' assignment), planned while the forward's rows are
exchanged and computed and merged in by :meth:`CallPlan.with_backward` before the forward saves.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from lrmoe.memory.bytes import RowSplit, spec_keep
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.figures import PlanFigures
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.placement import Placement
from lrmoe.systems import Assignment, SystemSpec

if TYPE_CHECKING:
    from lrmoe.selection.strata import StrataCounts


@dataclass(frozen=True)
class BackwardPlan:
    """What a training call's backward needs and its forward does not (None: not this call's).
    Computed by :func:`lrmoe.planning.backward_plan.plan_backward`; defined here, beside the plan
    it is merged into (:meth:`CallPlan.with_backward`), so the plan needs nothing of its planning."""

    kept_capacity_R: list[int] | None = None  # backward rows each rank may keep (None: unbounded)
    quota_E: torch.Tensor | None = None  # selective backward: pairs each expert keeps
    keep: str | None = None  # what the expert side keeps (KEEP_MODES; None: its system's)
    strata: StrataCounts | None = None  # a local selection: this rank's kept counts per stratum
    kept_assignment: PairAssignment | None = None  # a local selection re-spread (keep nothing): where kept pairs go
    memory_trimmed: bool | None = None  # the noise objective: memory or the network kept fewer pairs than its ratio
    bwd_chunk_rows_R: list[int] | None = None  # a compacting backward's rows recomputed at once (recompute_chunk)
    bwd_chunk_rows: int | None = None  # this rank's of them (its figures')
    chunk_rows_R: list[int] | None = None  # keeping gate/up: rows each rank's forward computes silu, h, y of at once
    chunk_rows: int | None = None  # this rank's of them (its figures')


@dataclass(frozen=True)
class CallPlan:
    """What one layer call does, identical on every rank."""

    placement: Placement
    counts_SE: torch.Tensor  # int64 (W, E) routed pairs per source rank and expert
    forward_SE: torch.Tensor  # pairs the forward computes (a capacity factor drops the rest)
    assignment: PairAssignment  # forward pairs of expert e from source s computed at r
    chunk_rows_R: list[int] | None  # rows each rank may compute at once (None: every rank all at once)
    kept_capacity_R: list[int] | None  # backward rows each rank may keep (None: unbounded)
    quota_E: torch.Tensor | None  # selective backward: pairs each expert keeps
    fetch: bool  # the call placed new copies: fetch them before the forward (collective)
    figures: PlanFigures = field(default_factory=PlanFigures)
    peak_R: list[int] | None = None  # predicted expert-side peak per rank (a capped non-controller system)
    keep: str | None = None  # a training call: what its expert side keeps (KEEP_MODES; None: its system's)
    rule: Assignment = Assignment.OWNER  # the assignment rule, for the backward's kept pairs
    node_of: list[int] | None = None  # rank -> node, for a node-aware rule
    bwd_chunk_rows_R: list[int] | None = None  # rows each rank's backward recomputes at once (None: all at once)
    rounds_R: list[int] | None = None  # rows a round brings each rank, where the call's exchanges run in rounds
    split_R: list[RowSplit] | None = None  # a capped exact training call keeping by the row: each rank's parts
    # the backward's part (:meth:`with_backward`; before it, a training call's forward plan only)
    strata: StrataCounts | None = None  # a local selection: this rank's kept counts per stratum
    kept_assignment: PairAssignment | None = None  # a local selection re-spread: where its kept pairs go
    backward_planned: bool = False

    @property
    def stats(self) -> dict:
        """:attr:`figures` as the ``last_stats`` keys they fill."""
        return self.figures.as_dict()

    def with_backward(self, backward: BackwardPlan, spec: SystemSpec) -> CallPlan:
        """This forward plan with its backward's part: what a single planning pass gave."""
        figures = replace(self.figures, keep_mode=backward.keep or spec_keep(spec),
                          memory_trimmed=backward.memory_trimmed,
                          fwd_chunk_rows=backward.chunk_rows or self.figures.fwd_chunk_rows,
                          bwd_chunk_rows=backward.bwd_chunk_rows or self.figures.bwd_chunk_rows)
        return replace(self, kept_capacity_R=backward.kept_capacity_R, quota_E=backward.quota_E, keep=backward.keep,
                       figures=figures, strata=backward.strata, kept_assignment=backward.kept_assignment,
                       bwd_chunk_rows_R=backward.bwd_chunk_rows_R or self.bwd_chunk_rows_R,
                       chunk_rows_R=backward.chunk_rows_R or self.chunk_rows_R,
                       backward_planned=True)

    def assign_kept(self, kept_SE: torch.Tensor) -> PairAssignment:
        """Where a compacting backward that kept nothing computes its kept pairs: the forward's
        rule on the kept counts, within the plan's kept capacities. A local selection's kept
        counts are its strata's, known when the backward was planned: their assignment was
        computed then (:mod:`lrmoe.planning.backward_plan`), off the backward's path."""
        if self.kept_assignment is not None and torch.equal(kept_SE, self.strata.kept_SE):
            return self.kept_assignment
        return assign_pairs(self.rule, kept_SE, self.placement, self.kept_capacity_R, self.node_of)
