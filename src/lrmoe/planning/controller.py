"""Budgets → expert slots, forward chunking, and per-expert backward quotas.

Our formulation (the paper's exact one is not public), per rank r with memory budget M_r for
the layer's expert side and dtype size s:

- an expert slot (a copy's parameters plus its gradient buffer) costs ``2·3·D·F·s``;
- the complete forward holds every received row's x and y (``2·D·s`` per row, plus 8 bytes of
  ‖h‖² for the selective systems) and, per row being computed, gate, up, silu(gate) and h
  (``4·F·s``): where all rows do not fit, they are computed in chunks that do; where not even
  x and y of every row fit, the forward's rows move in rounds (nothing kept to the backward);
- a kept backward row holds dy, x and the recomputed gate, up, silu, h: ``(2·D + 4·F)·s``
  (recomputed ``n`` rows at a time, ``BackwardConfig.recompute_chunk``: ``3·D·s`` a row, dy's
  slot-major copy counted, beside one chunk's ``4·F·s·n``);
- with replicas, their gradients travel to owners through a buffer of one copy's parameters
  per replica, and the owned weights are copied once more into the concatenated slot weights.

So rank r can keep ``cap_r = (M_r − slots − replica buffers) / ((2D + 4F)·s)`` backward rows,
further bounded by the network budget N_r / (3·D·s) (dy and x in, dx out per kept row), N_r
in bytes or as a fraction of a mean-loaded rank's keep-nothing bytes in the call.

Quotas are max–min fair (:func:`lrmoe.planning.quotas.max_min_quotas`): the largest common retention
ratio whose kept pairs fit every rank's capacity, found by progressive filling, then leftover
capacity filled. Deterministic and identical on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from lrmoe.config import ClusterBudget, MoEConfig
from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.memory.bytes import ByteModel
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement
from lrmoe.planning.quotas import max_min_quotas


class ForwardFit(NamedTuple):
    """The controller's forward within the budget: where each pair is computed, rows computed at
    once per rank, and whether every exchange runs in rounds of those rows (nothing kept)."""

    assignment: PairAssignment
    chunks: list[int]
    rounds: bool = False


# Share of the memory left after owned experts that replicas may take at most: the ceiling of
# the cost search that chooses lrmoe's replicas every step (lrmoe.planning.replica_search).
REPLICA_MEMORY_SHARE = 0.25


class Controller:
    """Turns a :class:`ClusterBudget` into slots, forward chunks and backward quotas."""

    def __init__(self, config: MoEConfig, budget: ClusterBudget, world: int) -> None:
        self.config, self.budget, self.world = config, budget, world
        self.memory_R, self.network_R, self.fixed_slots_R = budget.per_rank(world)
        self.network_fraction = budget.network_fraction
        self.costs = ByteModel.of(config)

    # ------------------------------------------------------------------ slots
    def slots(self, base: Placement) -> list[int]:
        """Expert slots per rank: the budget's fixed slots, or owned experts plus a share of the
        remaining memory (the most the per-step cost search may use). Raises
        :class:`MemoryBudgetExceeded` if a rank cannot hold one copy of each expert it owns."""
        out = []
        for r in range(self.world):
            owned = len(base.owned(r))
            need = owned * self.costs.slot
            if self.memory_R[r] < need:
                raise MemoryBudgetExceeded(r, need, self.memory_R[r], f"its {owned} owned experts need "
                                           f"{self.costs.slot} bytes each (parameters + gradients)", "its experts")
            if self.fixed_slots_R is not None:
                slots = self.fixed_slots_R[r]
            else:
                spare = (self.memory_R[r] - need) * REPLICA_MEMORY_SHARE
                slots = owned + int(spare // self.costs.slot)
            out.append(min(max(slots, owned), self.config.num_experts))
        return out

    def _slot_bytes(self, placement: Placement, r: int) -> int:
        return self.costs.slots_reserved(len(placement.slots[r]), len(placement.owned(r)))

    def check_slots(self, placement: Placement) -> None:
        for r in range(self.world):
            used = self._slot_bytes(placement, r)
            if used > self.memory_R[r]:
                raise MemoryBudgetExceeded(r, used, self.memory_R[r], "fewer replica slots would help: "
                                           "ClusterBudget(slots=...)", f"its {len(placement.slots[r])} expert slots")

    # ------------------------------------------------------------------ forward
    def forward_chunk_rows(self, placement: Placement, rank: int, recv_rows: int) -> int:
        """Rows the complete forward may compute at once on ``rank`` within its budget; raises
        :class:`MemoryBudgetExceeded` where not even one row fits beside every received row's x, y."""
        slots = self._slot_bytes(placement, rank)
        room = self.memory_R[rank] - slots - recv_rows * self.costs.fwd_io
        chunk = room // self.costs.fwd_compute
        if recv_rows and chunk < 1:
            raise MemoryBudgetExceeded(
                rank, slots + recv_rows * self.costs.fwd_io + self.costs.fwd_compute, self.memory_R[rank],
                f"its slots take {slots} and its {recv_rows} received rows {recv_rows * self.costs.fwd_io} (x and y), "
                f"one row computed needs {self.costs.fwd_compute}; a larger cap or fewer tokens per call would help"
                + (", or fewer replica slots (ClusterBudget(slots=...))" if placement.replicas(rank) else ""),
                "the complete forward")
        return int(max(min(chunk, recv_rows), 1))

    def forward_rows_capacity(self, placement: Placement, rank: int) -> int:
        """Most received rows whose x and y fit on ``rank`` beside one row being computed (the
        bound :meth:`forward_chunk_rows` needs), for a forward assignment within the budget."""
        room = self.memory_R[rank] - self._slot_bytes(placement, rank) - self.costs.fwd_compute
        return int(max(room, 0) // self.costs.fwd_io)

    def fit_forward(self, forward_SE: torch.Tensor, placement: Placement, assignment: PairAssignment,
                    assign: Callable[[torch.Tensor, Placement, list[int]], PairAssignment]) -> ForwardFit:
        """The forward within the budget: :meth:`forward_chunk_rows` for every rank, on
        ``assignment``, or, where that leaves a rank no room to compute, on a min-peak one within
        each rank's :meth:`forward_rows_capacity` (``assign``: the system's rule with capacities),
        or, where not even that fits, ``assignment`` with every exchange in rounds
        (:meth:`forward_rounds`). Every rank checks every rank, so all raise together."""
        def chunks(a: PairAssignment) -> list[int]:
            return [self.forward_chunk_rows(placement, r, n) for r, n in enumerate(a.rows_R())]

        try:
            return ForwardFit(assignment, chunks(assignment))
        except MemoryBudgetExceeded as err:
            whole = err
        if not placement.owners_only:
            room_R = [self.forward_rows_capacity(placement, r) for r in range(self.world)]
            try:
                bounded = assign(forward_SE, placement, room_R)
                return ForwardFit(bounded, chunks(bounded))
            except (ValueError, MemoryBudgetExceeded):  # the copies cannot hold the rows within the rooms
                pass
        return ForwardFit(assignment, self.forward_rounds(placement, assignment, whole), rounds=True)

    def forward_rounds(self, placement: Placement, assignment: PairAssignment, err: MemoryBudgetExceeded
                       ) -> list[int]:
        """Rows a round brings each rank where the complete forward moves its rows in rounds
        (:mod:`lrmoe.parallel.rounds`): x received, y, ‖h‖² and one round's activations beside
        the slots, nothing kept to the backward, so a rank holds one round's rows at a time
        (:meth:`~lrmoe.memory.bytes.ByteModel.round_forward`), the same bound as an exact call in
        rounds. Raises ``err`` where not even a round of one row fits."""
        rounds = []
        for r, rows in enumerate(assignment.rows_R()):
            room = self.memory_R[r] - self._slot_bytes(placement, r)
            chunk = room // self.costs.round_forward(1)
            if rows and chunk < 1:
                raise err
            rounds.append(int(max(min(chunk, rows), 1)))
        return rounds

    # ------------------------------------------------------------------ backward
    def network_for(self, pairs: int | None) -> list[int] | None:
        """Each rank's backward bytes for a call of ``pairs`` token–expert pairs: the budget's
        ``network_bytes``, or its ``network_fraction`` × what a rank with the mean load,
        ``pairs`` / world rows, receives and returns keeping nothing (x and dy in, dx out)."""
        if self.network_fraction is None:
            return self.network_R
        if pairs is None:
            raise ValueError("a network_fraction budget needs the call's pairs")
        return [int(self.network_fraction * math.ceil(pairs / self.world) * self.costs.bwd_wire)] * self.world

    def kept_capacity(self, placement: Placement, pairs: int | None = None, recompute_chunk: int = 0) -> list[int]:
        """Backward rows each rank can keep within its memory (and network) budget, in a call of
        ``pairs`` pairs (needed by a ``network_fraction`` budget). ``recompute_chunk``: the
        backward recomputes at most that many rows' activations at once
        (``BackwardConfig.recompute_chunk``; 0: every kept row's at once)."""
        caps = []
        # a kept row's dy, x and recomputed activations; at least dy, x and x's slot-major copy
        per_row = max(self.costs.bwd_kept, 3 * self.costs.row) if not recompute_chunk else 3 * self.costs.row
        network_R = self.network_for(pairs)
        for r in range(self.world):
            room = self.memory_R[r] - self._slot_bytes(placement, r) - recompute_chunk * self.costs.fwd_compute
            cap = max(room, 0) // per_row
            if network_R is not None:
                cap = min(cap, network_R[r] // self.costs.bwd_wire)
            caps.append(int(cap))
        return caps

    def quotas(self, counts_E: torch.Tensor, placement: Placement, cap_R: list[int] | None = None,
               rows: PairAssignment | None = None) -> torch.Tensor:
        """Max–min fair quotas (int64, E) for the global per-expert counts of one call; raises
        :class:`MemoryBudgetExceeded` where the budget cannot keep one pair of every expert with
        pairs (its rank: the one holding the most such experts beyond its kept capacity).
        ``rows``: an assignment of every pair of ``counts_E`` to its expert's holders on
        ``placement`` (the call's forward); where it fits every rank's capacity it is a flow
        that keeps every pair, so the quotas are the counts and no flow is solved."""
        cap_R = self.kept_capacity(placement, int(counts_E.sum())) if cap_R is None else cap_R
        if rows is not None and keeps_every_pair(counts_E, rows, cap_R):
            return counts_E.to(torch.long).clone()
        try:
            return max_min_quotas(counts_E, placement.holder_lists, cap_R)
        except ValueError as e:
            busy = [sum(1 for e_ in placement.slots[r] if int(counts_E[e_]) > 0) for r in range(self.world)]
            r = max(range(self.world), key=lambda r: (busy[r] - cap_R[r], -r))
            per_row = max(self.costs.bwd_kept, 3 * self.costs.row)
            raise MemoryBudgetExceeded(
                r, self._slot_bytes(placement, r) + max(busy[r], cap_R[r] + 1) * per_row, self.memory_R[r],
                f"{e}; a larger cap or fewer replica slots would help", "one kept pair per expert") from None


def keeps_every_pair(counts_E: torch.Tensor, rows: PairAssignment, cap_R: list[int]) -> bool:
    """``rows`` computes exactly ``counts_E``'s pairs of each expert and no rank more than its
    capacity: every pair can be kept (the max–min fair ratio is 1, nothing is left to fill)."""
    per_expert = np.bincount(rows.expert_H, rows.rows_H, rows.num_experts).astype(np.int64)
    if not np.array_equal(per_expert, counts_E.to(torch.long).numpy()):
        return False
    return all(n <= c for n, c in zip(rows.rows_R(), cap_R))


__all__ = ["Controller", "ForwardFit", "REPLICA_MEMORY_SHARE", "keeps_every_pair", "max_min_quotas"]
