"""What each system does in one layer call, decided by the library's own code.

For a step's global per-expert counts this module asks the library — not a re-implementation —
where experts live and how many rows each rank receives, keeps and computes:

- ``static`` / ``static-recompute``: :meth:`Placement.static` and its owner assignment;
- ``capacity``: static placement, per-expert cap ``ceil(C·pairs/E)`` as in the layer's
  ``_capacity_keep``, the cap itself a :func:`fixed_ratio_quota`-free clamp;
- ``symi``: :func:`plan_replicas` from the smoothed load every step, forward rows spread over
  replicas by :func:`assign_min_peak`;
- ``lrmoe``: a :class:`Controller` on a :class:`ClusterBudget` (slots, replica plan every
  ``replan_interval`` steps, forward chunk rows, kept capacities, max–min fair quotas capped by
  :func:`fixed_ratio_quota` at the configured ratio), kept rows spread by :func:`assign_min_peak`
  within the kept capacities.

Each rank's tokens are assumed to follow the global routing distribution (counts split evenly
over source ranks): the simulator has global counts only. The wall time of the library's
planning calls (assignment, quotas, replica planning) is measured here and charged to the
system as host time, since the layer runs them on the critical path.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from lrmoe.balance import assign_min_peak
from lrmoe.config import ClusterBudget, MoEConfig
from lrmoe.controller import Controller
from lrmoe.placement import Placement, plan_replicas
from lrmoe.selection import fixed_ratio_quota
from lrmoe.sim.errors import SimError
from lrmoe.sim.memory import RankWork, expert_side_peak, kept_between_passes
from lrmoe.sim.trace import split_sources

# MoELayer's defaults (lrmoe.layer.MoELayer.__init__): load EMA and lrmoe's re-planning interval.
LOAD_EMA = 0.9
REPLAN_INTERVAL = 10
CAPACITY_FACTOR = 1.25


@dataclass(frozen=True)
class LayerCall:
    """One layer call of one system: rows per (source, destination) rank and what follows."""

    system: str
    fwd_SR: np.ndarray  # int64 (W, W) rows source s sends to expert rank r, forward
    bwd_SR: np.ndarray  # int64 (W, W) rows in the backward (lrmoe: kept pairs only)
    copies_R: np.ndarray  # expert copies per rank
    owned_R: np.ndarray
    chunks_R: np.ndarray  # forward chunks per rank (1: computed at once)
    home_pairs_R: np.ndarray  # pairs each rank gathers/scatters at home, forward
    home_bwd_pairs_R: np.ndarray  # pairs each rank packs at home, backward
    score_pairs_R: np.ndarray  # scores each rank contributes to a global selection exchange
    score_in_forward: bool  # capacity selects in the forward, lrmoe in the backward
    refresh_SR: np.ndarray  # int64 (W, W) expert copies owner s sends holder r per step
    kept_pairs: int  # pairs whose expert backward is computed
    total_pairs: int
    host_s: float  # measured wall time of the library's planning calls for this call
    peak_R: np.ndarray  # expert_side_peak per rank
    kept_bytes_R: np.ndarray  # bytes kept from forward to backward per rank
    tokens_per_rank: int


@dataclass
class SystemPlanner:
    """A system's placement state across steps of one layer (replicas follow smoothed load)."""

    system: str
    config: MoEConfig
    world: int
    ratio: float = 1.0  # lrmoe: cap on the quota (BackwardConfig.ratio)
    memory_bytes: int | None = None  # lrmoe: per-rank expert-side budget
    slots: int | None = None  # symi / lrmoe: fixed slots per rank (None: library default)
    capacity_factor: float = CAPACITY_FACTOR
    steps: int = 0
    load_E: torch.Tensor = field(init=False)
    placement: Placement = field(init=False)
    controller: Controller | None = field(init=False, default=None)
    slots_R: list[int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        E, W = self.config.num_experts, self.world
        self.base = Placement.static(E, W)
        self.placement = self.base
        self.load_E = torch.ones(E, dtype=torch.float64)
        try:
            if self.system == "lrmoe" and self.memory_bytes is not None:
                budget = ClusterBudget(memory_bytes=int(self.memory_bytes), slots=self.slots)
                self.controller = Controller(self.config, budget, W)
                self.slots_R = self.controller.slots(self.base)
            elif self.system == "symi":
                owned = [len(self.base.owned(r)) for r in range(W)]
                self.slots_R = [self.slots if self.slots is not None else o + max(1, math.ceil(o / 2))
                                for o in owned]
            if self.slots_R is not None:
                self._replan()
        except ValueError as e:
            raise SimError(f"{self.system}: {e}") from None

    def _replan(self) -> None:
        self.placement = plan_replicas(self.base, self.load_E, self.slots_R)
        if self.controller is not None:
            self.controller.check_slots(self.placement)

    def _assign(self, counts_SE: torch.Tensor, capacity_R: list[int] | None = None) -> torch.Tensor:
        if self.placement.num_copies == self.config.num_experts:
            return self.placement.owner_assignment(counts_SE)
        return assign_min_peak(counts_SE.t(), self.placement.holder_lists, capacity_R)

    def call(self, counts_E: np.ndarray, dtype_bytes: int, counts_SE: np.ndarray | None = None) -> LayerCall:
        """Plan one training call (forward + backward) and end the step. ``counts_SE`` (source
        rank × expert), when known (calibration), replaces the even split of ``counts_E``."""
        try:
            return self._call(counts_E, dtype_bytes, counts_SE)
        except ValueError as e:
            raise SimError(f"{self.system}: {e}") from None

    def _call(self, counts_E: np.ndarray, s: int, counts_SE: np.ndarray | None) -> LayerCall:
        cfg, W, system = self.config, self.world, self.system
        E, K, D, F = cfg.num_experts, cfg.top_k, cfg.dim, cfg.ffn_dim
        counts_SE = torch.from_numpy(np.asarray(split_sources(counts_E, W) if counts_SE is None else counts_SE,
                                                dtype=np.int64))
        total = int(counts_SE.sum())
        tokens = total // K // W
        c_E = counts_SE.sum(0)
        self.load_E = LOAD_EMA * self.load_E + (1 - LOAD_EMA) * c_E.to(torch.float64)
        host = 0.0
        score_R = np.zeros(W, np.int64)

        fwd_SE = counts_SE
        if system == "capacity":
            cap = math.ceil(self.capacity_factor * total / E)
            fwd_SE = torch.from_numpy(split_sources(torch.clamp(c_E, max=cap).numpy(), W))
            score_R = torch.minimum(counts_SE, torch.clamp(c_E, max=cap)).sum(1).numpy()
        t0 = time.perf_counter()
        fwd_ESR = self._assign(fwd_SE)
        host += time.perf_counter() - t0
        fwd_SR = fwd_ESR.sum(0).numpy()
        recv_R = fwd_SR.sum(0)

        chunks_R = np.ones(W, np.int64)
        chunk_rows: list[int | None] = [None] * W
        bwd_SR = fwd_SR
        kept = int(fwd_SE.sum())
        if self.controller is not None:
            for r in range(W):
                c = self.controller.forward_chunk_rows(self.placement, r, int(recv_R[r]))
                chunk_rows[r] = c
                chunks_R[r] = max(1, math.ceil(int(recv_R[r]) / c)) if recv_R[r] else 1
        if system == "lrmoe":
            t0 = time.perf_counter()
            cap_R = self.controller.kept_capacity(self.placement) if self.controller is not None else None
            quota_E = fixed_ratio_quota(c_E, self.ratio)
            if self.controller is not None:
                quota_E = torch.minimum(quota_E, self.controller.quotas(c_E, self.placement, cap_R))
            kept_SE = _split_like(quota_E, counts_SE)
            bwd_ESR = self._assign(kept_SE, cap_R)
            host += time.perf_counter() - t0
            bwd_SR = bwd_ESR.sum(0).numpy()
            kept = int(quota_E.sum())
            score_R = torch.minimum(counts_SE, quota_E.view(1, E)).sum(1).numpy()

        owned_R = np.array([len(self.base.owned(r)) for r in range(W)])
        copies_R = np.array([len(self.placement.slots[r]) for r in range(W)])
        refresh_SR = np.zeros((W, W), np.int64)
        for r in range(W):
            for e in self.placement.replicas(r):
                refresh_SR[int(self.placement.owner_E[e]), r] += 1
        replicas_anywhere = self.placement.num_copies > E
        peak_R = np.array([
            expert_side_peak(system, D, F, s, RankWork(
                int(recv_R[r]), int(bwd_SR[:, r].sum()), int(copies_R[r]), int(owned_R[r]), chunk_rows[r], W,
                replicas_anywhere))
            for r in range(W)])
        kept_bytes_R = np.array([kept_between_passes(system, D, F, s, int(recv_R[r])) for r in range(W)])
        home_R = fwd_SE.sum(1).numpy()
        call = LayerCall(
            system=system, fwd_SR=fwd_SR, bwd_SR=bwd_SR, copies_R=copies_R, owned_R=owned_R, chunks_R=chunks_R,
            home_pairs_R=home_R, home_bwd_pairs_R=bwd_SR.sum(1), score_pairs_R=np.asarray(score_R),
            score_in_forward=system == "capacity", refresh_SR=refresh_SR, kept_pairs=kept, total_pairs=total,
            host_s=0.0, peak_R=peak_R, kept_bytes_R=kept_bytes_R, tokens_per_rank=tokens,
        )
        # step end: re-plan replicas when due (symi every step, lrmoe every REPLAN_INTERVAL)
        self.steps += 1
        if self.slots_R is not None and self.steps % (1 if system == "symi" else REPLAN_INTERVAL) == 0:
            t0 = time.perf_counter()
            self._replan()
            host += time.perf_counter() - t0
        return replace(call, host_s=host)


def _split_like(total_E: torch.Tensor, counts_SE: torch.Tensor) -> torch.Tensor:
    """Split ``total_E`` over source ranks in proportion to ``counts_SE`` (largest remainder),
    never above a source's own count: where kept pairs come from when scores are alike."""
    c = counts_SE.to(torch.float64)
    share = c / c.sum(0).clamp(min=1) * total_E.to(torch.float64)
    out = share.floor().to(torch.long)
    short = total_E - out.sum(0)
    rem = share - out
    order = torch.argsort(-rem, dim=0, stable=True)
    rank_of = torch.empty_like(order)
    rank_of.scatter_(0, order, torch.arange(c.shape[0]).view(-1, 1).expand_as(order))
    out += (rank_of < short.view(1, -1)).to(torch.long)
    return torch.minimum(out, counts_SE)
