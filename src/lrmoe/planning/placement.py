"""Where experts live: expert → owner rank, and the experts (slots) each rank holds.

Static placement spreads experts over ranks in contiguous blocks; when ``num_experts`` is not a
multiple of the world size the first ``E mod W`` ranks hold one expert more (uneven ownership).
Ownership never changes: the owner keeps the expert's parameters and optimizer state (SYMI's
decoupling). Replicas are extra copies on other ranks, planned from smoothed load by
:func:`plan_replicas`, refreshed from the owner after every optimizer step; their weight
gradients are reduced to the owner. A rank's slots are its owned experts (ascending), then its
replicas (ascending).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.holders import HolderIndex, holder_index


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

    def holders(self, expert: int) -> list[int]:
        """Ranks holding a copy of ``expert``, ascending."""
        return self.holder_lists[expert]

    @cached_property
    def holder_lists(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for r, experts in enumerate(self.slots):
            for e in experts:
                out[e].append(r)
        return out

    def replicas(self, rank: int) -> tuple[int, ...]:
        """Experts ``rank`` holds a copy of without owning them, in slot order."""
        owned = set(self._owned_R[rank])
        return tuple(e for e in self.slots[rank] if e not in owned)

    @cached_property
    def num_copies(self) -> int:
        """Expert copies over all ranks (computed once: a cap's fitter asks per rank and plan)."""
        return sum(len(s) for s in self.slots)

    def with_replicas(self, replicas: list[list[int]]) -> Placement:
        """This placement's owners plus ``replicas[r]`` (experts) on each rank r."""
        slots = tuple(self.owned(r) + tuple(sorted(replicas[r])) for r in range(self.world))
        return Placement(self.num_experts, slots, self.owner_E)

    def owned(self, rank: int) -> tuple[int, ...]:
        """Experts whose parameters ``rank`` owns, ascending."""
        return self._owned_R[rank]

    @cached_property
    def owned_counts(self) -> tuple[int, ...]:
        """How many experts each rank owns."""
        return tuple(len(o) for o in self._owned_R)

    @cached_property
    def _owned_R(self) -> tuple[tuple[int, ...], ...]:
        """:meth:`owned` of every rank, computed once (the planners ask per rank, per call)."""
        owner = self.owner_E.tolist()
        return tuple(tuple(e for e in experts if owner[e] == r) for r, experts in enumerate(self.slots))

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

    @cached_property
    def owners_only(self) -> bool:
        """Every expert computed by its owner alone (no replicas)."""
        return all(hs == [int(self.owner_E[e])] or not hs for e, hs in enumerate(self.holder_lists))

    @cached_property
    def holder_index(self) -> HolderIndex:
        """:attr:`holder_lists` indexed for the planners (built once per placement)."""
        return holder_index(self.holder_lists, self.world)

    def owner_assignment(self, counts_SE: torch.Tensor) -> PairAssignment:
        """Single-copy placement: every pair of expert e goes to its owner."""
        E = self.num_experts
        rows_HS = counts_SE.t().to(torch.long).numpy().copy()
        return PairAssignment(np.arange(E), self.owner_E.numpy().astype(np.int64), rows_HS, E)


def copies_by_load(load: list[float], copies: list[int], free_slots: int, world: int) -> list[int]:
    """Hand ``free_slots`` more copies out one at a time, each to the expert with the largest
    load per copy (D'Hondt; ties to the lower expert id), never more copies than ranks and none
    to an expert without load. ``copies`` gives the starting counts. A heap of (−load per copy,
    expert) gives the same choices as scanning every expert each time."""
    copies = list(copies)
    if free_slots <= 0:
        return copies
    if any(x != x for x in load):  # NaN has no order: scan as the definition says
        E = len(load)
        for _ in range(free_slots):
            e = max(range(E), key=lambda e: (load[e] / max(copies[e], 1) if copies[e] < world else -1.0, -e))
            if copies[e] >= world or load[e] <= 0:
                break
            copies[e] += 1
        return copies
    heap = [(-(load[e] / max(k, 1)), e) for e, k in enumerate(copies) if k < world]
    heapq.heapify(heap)
    for _ in range(free_slots):
        if not heap:  # every expert on every rank
            break
        e = heap[0][1]
        if load[e] <= 0:  # the largest load per copy is none: the rest have no load
            break
        copies[e] += 1
        if copies[e] < world:
            heapq.heapreplace(heap, (-(load[e] / copies[e]), e))
        else:
            heapq.heappop(heap)
    return copies


def place_copies(units: list[tuple[float, int]], rank_load: list[float], free: list[int],
                 holds: list[set[int]], node_of: list[int] | None = None) -> list[list[int]]:
    """LPT: copies (share of load, expert), heaviest first, each to the least-loaded rank with a
    free slot that does not hold the expert yet. With ``node_of`` (rank → node) the peak comes
    first, to within one row, and a node that lacks the expert second, so that more pairs can
    stay inside their node. Updates ``rank_load``, ``free`` and ``holds``; returns the experts
    placed on each rank."""
    placed: list[list[int]] = [[] for _ in rank_load]
    order = sorted(units, key=lambda u: (-u[0], u[1]))
    if node_of is None and not any(x != x for x in rank_load) and not any(u[0] != u[0] for u in units):
        # the least-loaded rank with a free slot: a heap of (load, rank), skipping those that hold
        # the expert already (few: an expert has few copies)
        heap = [(load, r) for r, load in enumerate(rank_load) if free[r] > 0]
        heapq.heapify(heap)
        for share, e in order:
            skipped = []
            while heap and e in holds[heap[0][1]]:
                skipped.append(heapq.heappop(heap))
            if heap:
                r = heapq.heappop(heap)[1]
                placed[r].append(e)
                holds[r].add(e)
                free[r] -= 1
                rank_load[r] += share
                if free[r] > 0:
                    heapq.heappush(heap, (rank_load[r], r))
            for item in skipped:
                heapq.heappush(heap, item)
        return placed
    for share, e in order:
        options = [r for r in range(len(rank_load)) if free[r] > 0 and e not in holds[r]]
        if not options:
            continue
        if node_of is None:
            r = min(options, key=lambda r: (rank_load[r], r))
        else:
            nodes_with_e = {node_of[q] for q in range(len(rank_load)) if e in holds[q]}
            r = min(options, key=lambda r: (round(rank_load[r]), node_of[r] in nodes_with_e, rank_load[r], r))
        placed[r].append(e)
        holds[r].add(e)
        free[r] -= 1
        rank_load[r] += share
    return placed


def replica_room(owned_R: list[int], slots_R: list[int]) -> list[int]:
    """Each rank's slots left for replicas beside the ``owned_R`` experts it owns; a ValueError
    where ``slots_R`` leaves a rank fewer slots than it owns experts."""
    free = [s - o for s, o in zip(slots_R, owned_R)]
    if any(f < 0 for f in free):
        r = min(range(len(free)), key=lambda r: free[r])
        raise ValueError(f"rank {r} has {slots_R[r]} expert slots but owns {owned_R[r]} experts")
    return free


def plan_replicas(base: Placement, load_E: torch.Tensor, slots_R: list[int],
                  node_of: list[int] | None = None) -> Placement:
    """Replica placement from (smoothed) expert load: copies ∝ load, at least one per expert
    (the owner's), at most ``slots_R[r]`` experts on rank r, min-peak.

    Copies: :func:`copies_by_load`. Placement: :func:`place_copies`, rank loads starting from
    the owners' shares (``node_of``: topology-aware tie-breaking). Deterministic.
    """
    E, W = base.num_experts, base.world
    load = [max(float(v), 0.0) for v in load_E.tolist()]
    owner = base.owner_E.tolist()
    owned = [tuple(e for e in base.slots[r] if owner[e] == r) for r in range(W)]  # base.owned(r)
    free = replica_room([len(o) for o in owned], slots_R)
    copies = copies_by_load(load, [1] * E, sum(free), W)
    rank_load = [sum(load[e] / copies[e] for e in owned[r]) for r in range(W)]
    units = [(load[e] / copies[e], e) for e in range(E) for _ in range(copies[e] - 1)]
    replicas = place_copies(units, rank_load, free, [set(o) for o in owned], node_of)
    # base.with_replicas(replicas), with the owned experts already at hand
    return Placement(E, tuple(owned[r] + tuple(sorted(replicas[r])) for r in range(W)), base.owner_E)
