"""Replicas in proportion to load, placed min-peak: between steps from the smoothed load (SYMI;
lrmoe's controller chooses how many), or per call from the call's own counts (UltraEP, whose
per-replica token quotas are then :func:`~lrmoe.planning.balance.assign_min_peak`'s)."""

from __future__ import annotations

import torch

from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.strategies.base import PlacementStrategy


class LoadReplicas(PlacementStrategy):
    """Copies ∝ load (D'Hondt), at least one per expert, LPT within the slots."""

    replicas_beside_owned = True

    def step_placement(self, current: Placement, load_E: torch.Tensor, slots_R: list[int]) -> Placement:
        return plan_replicas(self.base, load_E, slots_R)

    def call_placement(self, counts_SE: torch.Tensor, slots_R: list[int]) -> Placement:
        return plan_replicas(self.base, counts_SE.sum(0).to(torch.float64), slots_R)
