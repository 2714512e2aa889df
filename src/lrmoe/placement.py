"""Where experts live: expert → owner rank, and the experts (slots) each rank holds.

Static placement spreads experts over ranks in contiguous blocks; when ``num_experts`` is not a
multiple of the world size the first ``E mod W`` ranks hold one expert more (uneven ownership).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Placement:
    """``slots[r]``: experts rank r computes, in its local slot order; ``owner_E[e]`` the rank
    that owns expert e's parameters (and its optimizer state)."""

    num_experts: int
    slots: tuple[tuple[int, ...], ...]
    owner_E: torch.Tensor  # int64 (E,)

    @staticmethod
    def static(num_experts: int, world: int) -> Placement:
        base, extra = divmod(num_experts, world)
        slots, start = [], 0
        for r in range(world):
            n = base + (1 if r < extra else 0)
            slots.append(tuple(range(start, start + n)))
            start += n
        owner_E = torch.empty(num_experts, dtype=torch.long)
        for r, experts in enumerate(slots):
            owner_E[list(experts)] = r
        return Placement(num_experts, tuple(slots), owner_E)

    @property
    def world(self) -> int:
        return len(self.slots)

    def owned(self, rank: int) -> tuple[int, ...]:
        """Experts whose parameters ``rank`` owns, ascending."""
        return tuple(e for e in self.slots[rank] if int(self.owner_E[e]) == rank)

    @cached_property
    def slot_index(self) -> torch.Tensor:
        """int64 (W, E): position of expert e among rank r's slots, -1 where r does not hold e."""
        idx = torch.full((self.world, self.num_experts), -1, dtype=torch.long)
        for r, experts in enumerate(self.slots):
            idx[r, list(experts)] = torch.arange(len(experts))
        return idx

    @cached_property
    def expert_ordered(self) -> bool:
        """One copy per expert, and expert order is (owner rank, slot) order, as in static
        placement: then pairs sorted by expert are already in send order."""
        flat = [e for experts in self.slots for e in experts]
        return flat == list(range(self.num_experts))

    def owner_assignment(self, counts_SE: torch.Tensor) -> torch.Tensor:
        """assign_ESR for single-copy placement: every pair of expert e goes to its owner."""
        S, E = counts_SE.shape
        assign_ESR = torch.zeros(E, S, self.world, dtype=torch.long)
        assign_ESR.scatter_(2, self.owner_E.view(E, 1, 1).expand(E, S, 1), counts_SE.t().unsqueeze(-1))
        return assign_ESR
