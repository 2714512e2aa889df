"""What each system does in one layer call, decided by the layer's own planner.

A :class:`SystemPlanner` drives the same :class:`lrmoe.plan.LayerPlanner` object that
:class:`lrmoe.layer.MoELayer` drives — placement, replica planning, forward assignment, forward
chunks within the budget, kept capacities and quotas — on a step's global per-expert counts,
and records the rows each rank receives, keeps and computes. Nothing of the planning is
re-implemented here; only the split of kept pairs over source ranks is assumed (largest
remainder, as when scores are alike), since the simulator has no scores.

Each rank's tokens are assumed to follow the global routing distribution (counts split evenly
over source ranks): the simulator has global counts only. The wall time of the planner's calls
is measured here and charged to the system as host time, since the layer runs them on the
critical path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.meter import RankWork, expert_side_peak
from lrmoe.plan import LayerPlanner
from lrmoe.selection import largest_remainder
from lrmoe.sim.errors import SimError
from lrmoe.sim.memory import kept_between_passes
from lrmoe.sim.trace import split_sources
from lrmoe.systems import spec_of


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
    """A system's :class:`LayerPlanner` for one layer across steps (replicas follow the load)."""

    system: str
    config: MoEConfig
    world: int
    ratio: float = 1.0  # cap on the quota (BackwardConfig.ratio)
    memory_bytes: int | None = None  # per-rank expert-side budget (systems that take one)
    slots: int | None = None  # fixed slots per rank (None: the layer's default)
    capacity_factor: float = 1.25
    planner: LayerPlanner = field(init=False)

    def __post_init__(self) -> None:
        spec = spec_of(self.system)
        budget = None
        if spec.takes_budget and (self.memory_bytes is not None or self.slots is not None):
            budget = ClusterBudget(memory_bytes=None if self.memory_bytes is None else int(self.memory_bytes),
                                   slots=self.slots)
        try:
            self.planner = LayerPlanner(spec, self.config, self.world, budget=budget,
                                        backward=BackwardConfig(ratio=self.ratio),
                                        capacity_factor=self.capacity_factor)
        except ValueError as e:
            raise SimError(f"{self.system}: {e}") from None

    @property
    def base(self):
        return self.planner.base

    def call(self, counts_E: np.ndarray, dtype_bytes: int, counts_SE: np.ndarray | None = None) -> LayerCall:
        """Plan one training call (forward + backward) and end the step. ``counts_SE`` (source
        rank × expert), when known (calibration), replaces the even split of ``counts_E``."""
        try:
            return self._call(counts_E, dtype_bytes, counts_SE)
        except ValueError as e:
            raise SimError(f"{self.system}: {e}") from None

    def _call(self, counts_E: np.ndarray, s: int, counts_SE: np.ndarray | None) -> LayerCall:
        cfg, W, planner = self.config, self.world, self.planner
        spec = planner.spec
        E, K, D, F = cfg.num_experts, cfg.top_k, cfg.dim, cfg.ffn_dim
        counts_SE = torch.from_numpy(np.asarray(split_sources(counts_E, W) if counts_SE is None else counts_SE,
                                                dtype=np.int64))
        total = int(counts_SE.sum())
        tokens = total // K // W

        t0 = time.perf_counter()
        fwd_quota_E = planner.forward_quota(counts_SE)
        fwd_SE = None if fwd_quota_E is None else torch.from_numpy(split_sources(fwd_quota_E.numpy(), W))
        plan = planner.plan_call(counts_SE, fwd_SE, training=True)
        host = time.perf_counter() - t0
        fwd_SR = plan.assign_ESR.sum(0).numpy()
        recv_R = fwd_SR.sum(0)
        score_R = np.zeros(W, np.int64)
        if fwd_quota_E is not None:
            score_R = torch.minimum(counts_SE, fwd_quota_E.view(1, E)).sum(1).numpy()

        chunks_R = np.ones(W, np.int64)
        chunk_rows: list[int | None] = plan.chunk_rows_R or [None] * W
        for r, c in enumerate(chunk_rows):
            if c is not None and recv_R[r]:
                chunks_R[r] = -(-int(recv_R[r]) // c)
        bwd_SR = fwd_SR
        kept = int(plan.forward_SE.sum())
        if plan.quota_E is not None:
            kept = int(plan.quota_E.sum())
            score_R = torch.minimum(counts_SE, plan.quota_E.view(1, E)).sum(1).numpy()
            if spec.compacts:
                t0 = time.perf_counter()
                kept_SE = largest_remainder(plan.quota_E, counts_SE)
                bwd_SR = planner.assign(kept_SE, plan.placement, plan.kept_capacity_R).sum(0).numpy()
                host += time.perf_counter() - t0

        placement = plan.placement
        owned_R = np.array([len(planner.base.owned(r)) for r in range(W)])
        copies_R = np.array([len(placement.slots[r]) for r in range(W)])
        refresh_SR = np.zeros((W, W), np.int64)
        for r in range(W):
            for e in placement.replicas(r):
                refresh_SR[int(placement.owner_E[e]), r] += 1
        replicas_anywhere = placement.num_copies > E
        peak_R = np.array([
            expert_side_peak(spec, D, F, s, RankWork(
                int(recv_R[r]), int(bwd_SR[:, r].sum()), int(copies_R[r]), int(owned_R[r]), chunk_rows[r], W,
                replicas_anywhere))
            for r in range(W)])
        kept_bytes_R = np.array([kept_between_passes(spec, D, F, s, int(recv_R[r])) for r in range(W)])
        home_R = plan.forward_SE.sum(1).numpy()
        call = LayerCall(
            system=self.system, fwd_SR=fwd_SR, bwd_SR=bwd_SR, copies_R=copies_R, owned_R=owned_R, chunks_R=chunks_R,
            home_pairs_R=home_R, home_bwd_pairs_R=bwd_SR.sum(1), score_pairs_R=np.asarray(score_R),
            score_in_forward=spec.forward_drop, refresh_SR=refresh_SR, kept_pairs=kept, total_pairs=total,
            host_s=0.0, peak_R=peak_R, kept_bytes_R=kept_bytes_R, tokens_per_rank=tokens,
        )
        t0 = time.perf_counter()
        planner.step_end()  # re-plans replicas when due (symi every step, lrmoe every replan_interval)
        host += time.perf_counter() - t0
        return replace(call, host_s=host)
