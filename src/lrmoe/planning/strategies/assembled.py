"""LAER-MoE-style assembled experts, per call: every expert is sharded over all ranks, so any
rank can assemble any expert; each call places one copy of every expert with pairs, more for
heavy ones, where its load puts them (the parameter slices: lrmoe.parallel.sharding)."""

from __future__ import annotations

import torch

from lrmoe.planning.figures import PlanFigures
from lrmoe.planning.placement import Placement, copies_by_load, place_copies
from lrmoe.planning.strategies.base import PlacementStrategy


class AssembledLayout(PlacementStrategy):
    """Per call: :func:`laer_layout` within the ranks' assembly slots."""

    def __init__(self, inputs) -> None:
        super().__init__(inputs)
        E, slots = inputs.config.num_experts, inputs.default_slots_R
        if slots is not None and sum(slots) < E:  # (else the first call routing to every expert fails)
            raise ValueError(f"its ranks assemble at most {sum(slots)} experts at once (budget.slots), fewer than "
                             f"the {E} a call may route to")

    def call_placement(self, counts_SE: torch.Tensor, slots_R: list[int]) -> Placement:
        return laer_layout(counts_SE.sum(0), self.base, slots_R)

    def figures(self, placement: Placement) -> PlanFigures:
        return PlanFigures(assembled_experts=placement.num_copies)


def laer_layout(counts_E: torch.Tensor, base: Placement, slots_R: list[int]) -> Placement:
    """LAER-MoE's per-call layout: with every expert sharded over all ranks any rank can
    assemble any expert, so the planner starts from nothing — one copy of each expert that has
    pairs, more for heavy ones (D'Hondt within the ranks' assembly slots), placed LPT.
    ``owner_E`` of the result is each expert's first holder (experts without pairs keep the
    static owner, and no rank assembles them)."""
    E, W = base.num_experts, base.world
    load = [float(v) for v in counts_E.tolist()]
    needed = [e for e in range(E) if load[e] > 0]
    if len(needed) > sum(slots_R):
        raise ValueError(f"{len(needed)} experts have pairs but the ranks can assemble only {sum(slots_R)}")
    copies = copies_by_load(load, [1 if load[e] > 0 else 0 for e in range(E)], sum(slots_R) - len(needed), W)
    units = [(load[e] / copies[e], e) for e in needed for _ in range(copies[e])]
    slots = place_copies(units, [0.0] * W, list(slots_R), [set() for _ in range(W)])
    owner = base.owner_E.tolist()
    for r in reversed(range(W)):
        for e in slots[r]:
            owner[e] = r
    owner_E = torch.tensor(owner, dtype=base.owner_E.dtype)
    return Placement(E, tuple(tuple(sorted(s)) for s in slots), owner_E)
