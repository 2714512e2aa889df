"""What every placement strategy shares: its inputs, the interface the layer planner drives, and
the default — one copy per expert, computed by its owner (systems whose spec names no planner).

A strategy decides where expert copies live; the :class:`~lrmoe.planning.planner.LayerPlanner`
decides when (between steps or per call, from the :class:`~lrmoe.systems.SystemSpec`), keeps the
load statistics, and fits every decision within a memory cap. Strategies are pure given their
inputs, so every rank plans the same placement without an exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lrmoe.config import MoEConfig
from lrmoe.planning.cost import CostModel
from lrmoe.planning.figures import PlanFigures
from lrmoe.planning.placement import Placement, replica_room

if TYPE_CHECKING:  # the fitter calls strategies back; only its type is needed here
    from lrmoe.planning.cap_fit import CapFitter, Fit


@dataclass(frozen=True)
class StrategyInputs:
    """What a strategy may read: fixed for the layer's life."""

    base: Placement  # static placement: each expert on its owner
    config: MoEConfig
    rank: int
    costs: CostModel
    node_of: list[int] | None  # rank -> node (ClusterBudget.ranks_per_node)
    default_slots_R: list[int] | None  # expert slots a rank may hold unless a cap takes some
    routing_trace: torch.Tensor | None  # (steps, E) loads for an offline placement pool


def predicted_rank_load(placement: Placement, load_E: list[float]) -> list[float]:
    """Each expert's load split evenly over its copies (what a min-peak spread approaches)."""
    out = [0.0] * placement.world
    for e, hs in enumerate(placement.holder_lists):
        for r in hs:
            out[r] += load_E[e] / len(hs)
    return out


def trim_replicas(placement: Placement, base: Placement, load_E: torch.Tensor, slots_R: list[int]) -> Placement:
    """``placement`` with, on every rank over its slots, its coldest replicas (least smoothed
    load per copy) dropped."""
    load = load_E.tolist()
    keep = []
    for r in range(base.world):
        room = max(slots_R[r] - len(base.owned(r)), 0)
        mine = sorted(placement.replicas(r), key=lambda e: (-load[e] / len(placement.holders(e)), e))
        keep.append(mine[:room])
    return base.with_replicas(keep)


class PlacementStrategy:
    """The default: no placement of its own; every expert is computed by its owner.

    Per-step systems are asked :meth:`step_placement` between optimizer steps (and inside a call
    whose forward does not fit); per-call systems :meth:`place_call` for each call, or, under a
    memory cap, :meth:`fit_call`."""

    varies_copies = False  # under a cap it tries plans with fewer copies even without replica slots
    replicas_beside_owned = False  # its slots hold every owned expert, replicas in what is left

    def __init__(self, inputs: StrategyInputs) -> None:
        self.inputs = inputs
        self.base = inputs.base
        if self.replicas_beside_owned and inputs.default_slots_R is not None:  # fewer slots than owned: one error
            replica_room(list(self.base.owned_counts), inputs.default_slots_R)

    # -------------------------------------------------------------- between steps
    def step_placement(self, current: Placement, load_E: torch.Tensor, slots_R: list[int]) -> Placement:
        """Replicas within ``slots_R`` from the smoothed load (``current``: the placement now)."""
        raise NotImplementedError(f"{type(self).__name__} places no copies between steps")

    def before_replan(self) -> None:
        """Called once before the placement is re-planned between steps."""

    def adopted(self, old: Placement, new: Placement) -> None:
        """``new`` replaces ``old`` as the layer's replica plan."""

    def take_bound_optimizer_bytes(self) -> int | None:
        """Optimizer bytes bound to new copies since the last take (modelled, not moved); None:
        a system that moves no optimizer state."""
        return None

    # -------------------------------------------------------------- per call
    def call_placement(self, counts_SE: torch.Tensor, slots_R: list[int]) -> Placement:
        """This call's copies within ``slots_R`` from its own counts."""
        raise NotImplementedError(f"{type(self).__name__} places no copies per call")

    def figures(self, placement: Placement) -> PlanFigures:
        """A per-call plan's own figures for ``last_stats``."""
        return PlanFigures(replicas=placement.num_copies - self.base.num_experts)

    def place_call(self, counts_SE: torch.Tensor, slots_R: list[int] | None) -> tuple[Placement, PlanFigures]:
        """An uncapped call's placement and its figures."""
        placement = self.call_placement(counts_SE, slots_R)
        return placement, self.figures(placement)

    def fit_call(self, counts_SE: torch.Tensor, slots_R: list[int], fitter: CapFitter, forward_SE: torch.Tensor,
                 training: bool) -> tuple[Fit, PlanFigures]:
        """A capped call's placement: the most slots whose plan fits (:meth:`CapFitter.search_slots`).
        Raises :class:`~lrmoe.errors.MemoryBudgetExceeded` where none does."""
        found = fitter.search_slots(lambda s: self.call_placement(counts_SE, s), slots_R, forward_SE, training)
        if found.fit is None:
            raise fitter.exceeded(found.failed)
        return found.fit, self.figures(found.fit.placement)

    # -------------------------------------------------------------- observation, checkpoints
    def observe(self, counts_E: torch.Tensor) -> None:
        """A training call's global load (after the layer's smoothed load took it)."""

    @property
    def trace(self) -> list[torch.Tensor]:
        """Loads the strategy recorded for itself (a checkpoint keeps them)."""
        return []

    def load_trace(self, trace: list[torch.Tensor]) -> None:
        """Resume with the loads :attr:`trace` gave."""
