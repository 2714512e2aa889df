"""What one layer call does, decided before any row moves and identical on every rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.figures import PlanFigures
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.placement import Placement
from lrmoe.systems import Assignment


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

    @property
    def stats(self) -> dict:
        """:attr:`figures` as the ``last_stats`` keys they fill."""
        return self.figures.as_dict()

    def assign_kept(self, kept_SE: torch.Tensor) -> PairAssignment:
        """Where a compacting backward that kept nothing computes its kept pairs: the forward's
        rule on the kept counts, within the plan's kept capacities."""
        return assign_pairs(self.rule, kept_SE, self.placement, self.kept_capacity_R, self.node_of)
