"""What each system does in one layer call, decided by the layer's own planner.

A :class:`SystemPlanner` drives the same :class:`lrmoe.planning.planner.LayerPlanner` object that
:class:`lrmoe.layer.MoELayer` drives — placement, replica planning (lrmoe: its per-step cost
search), forward assignment, forward chunks within the budget, kept capacities, quotas and the
keep mode of a compacting backward — on a step's global per-expert counts, and records the rows
each rank receives, keeps and computes. Nothing of the planning is re-implemented here; only
the split of kept pairs over source ranks is assumed (largest remainder, which is exact for the
``local`` and ``local-sampled`` selections and the expected split for the others), and, where
the expert side kept x, the split of each (expert, source)'s kept pairs over the ranks that
computed them in the forward (:meth:`PairAssignment.restricted`: exact for the local
selections, whose strata are that split, and the expected split of the others' samples).

Each rank's tokens are assumed to follow the global routing distribution (counts split evenly
over source ranks): the simulator has global counts only. Host planning time is the count of
the library's benchmarked planner calls times their recorded cost (:mod:`lrmoe.sim.host`), not
this machine's clock; the live wall time is kept only as a diagnostic. It is counted in two
parts, as the layer plans (:mod:`lrmoe.planning.backward_plan`): what the forward waits for (and
the step's re-plan, and a global selection's kept assignment in the backward), and the
backward's plan, which the layer computes while the forward's rows are exchanged and computed
(``deferred_host_s``; how much of it stays on the critical path: :func:`lrmoe.sim.cost.layer_seconds`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from lrmoe.config import LOCAL_SELECTIONS, BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.memory import KEEP_NOTHING, RankWork, RowSplit, expert_side_peak, kept_to_backward
from lrmoe.planning.planner import LayerPlanner
from lrmoe.selection.strata import largest_remainder
from lrmoe.sim.errors import SimError
from lrmoe.sim.host import PlannerCalls, PlanningReference, host_seconds
from lrmoe.sim.memory import kept_between_passes
from lrmoe.sim.trace import split_sources
from lrmoe.systems import spec_of

# What a selection exchanges besides the non-finite counts every global selection all-gathers:
# "candidates" (lrm, random: each rank's best min(q_e, c_e,r) keys per expert), "all" (sampled:
# every finite score), nothing (local, local-sampled: each rank draws its own strata, no
# exchange at all, lrmoe.selection.strata).
SCORE_EXCHANGE = {"lrm": "candidates", "random": "candidates", "sampled": "all", "local": None,
                  "local-sampled": None}


@dataclass(frozen=True)
class LayerCall:
    """One layer call of one system: rows per (source, destination) rank and what follows."""

    system: str
    fwd_SR: np.ndarray  # int64 (W, W) rows source s sends to expert rank r, forward
    bwd_SR: np.ndarray  # int64 (W, W) rows in the backward (lrmoe: kept pairs only)
    copies_R: np.ndarray  # expert copies per rank
    owned_R: np.ndarray
    chunks_R: np.ndarray  # forward chunks per rank (1: computed at once; in rounds: the rank's rounds)
    home_pairs_R: np.ndarray  # pairs each rank gathers/scatters at home, forward
    home_bwd_pairs_R: np.ndarray  # pairs each rank packs at home, backward
    score_pairs_R: np.ndarray  # scores each rank contributes to a global selection exchange
    score_in_forward: bool  # capacity selects in the forward, lrmoe in the backward
    refresh_SR: np.ndarray  # int64 (W, W) expert copies owner s sends holder r per step
    kept_pairs: int  # pairs whose expert backward is computed
    total_pairs: int
    host_s: float  # reference host time of the planning calls on the critical path (sim.host)
    peak_R: np.ndarray  # expert_side_peak per rank
    kept_bytes_R: np.ndarray  # bytes kept from forward to backward per rank
    tokens_per_rank: int
    keep: str | None = None  # a compacting backward's keep mode (lrmoe.memory.bytes.KEEP_MODES)
    recomputes: bool = False  # the backward recomputes gate/up/h (no saved activations)
    resends_x: bool = False  # home re-sends x of the kept pairs (a compacting backward that kept nothing)
    count_gather: bool = False  # the selection all-gathers its non-finite counts (the global selections)
    positions: bool = False  # a keep-x local selection: each kept dy row carries its position (no mask)
    host_live_s: float = 0.0  # the same planning's wall time on this machine (diagnostic only)
    once_host_s: float = 0.0  # one-time planning after this call, not in its time (lrmoe's first full search)
    planner_calls: dict = field(default_factory=dict)  # benchmarked planner -> calls in this call (both parts)
    deferred_host_s: float = 0.0  # the same of the backward's plan, planned during the forward's device work
    deferred_planner_calls: dict = field(default_factory=dict)  # the calls of that plan
    bwd_chunks_R: np.ndarray | None = None  # backward chunks per rank (None: computed at once)
    rounds: int = 1  # an exact call keeping nothing under a cap: every row exchange runs this many rounds
    split_R: list[RowSplit] | None = None  # a capped exact call keeping by the row: each rank's parts


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
    selection: str = "lrm"  # BackwardConfig.selection (the CPU calibration's layers use lrm)
    network_bytes: int | None = None  # per-rank backward network budget (ClusterBudget.network_bytes)
    backward: BackwardConfig | None = None  # the rest of BackwardConfig (objective, drop_cost, min_ratio)
    link_gbps: float | None = None  # inter-node link, for the planner's cost model (replica search)
    reference: PlanningReference | None = None  # host planning costs (default: the shipped reference)
    planner: LayerPlanner = field(init=False)

    def __post_init__(self) -> None:
        spec = spec_of(self.system)
        budget = None
        if spec.takes_budget and (self.memory_bytes is not None or self.slots is not None):
            budget = ClusterBudget(memory_bytes=None if self.memory_bytes is None else int(self.memory_bytes),
                                   network_bytes=None if self.network_bytes is None else int(self.network_bytes),
                                   slots=self.slots, inter_node_gbps=self.link_gbps)
        try:
            self.planner = LayerPlanner(spec, self.config, self.world, budget=budget,
                                        backward=replace(self.backward or BackwardConfig(),
                                                         selection=self.selection, ratio=self.ratio),
                                        capacity_factor=self.capacity_factor)
        except ValueError as e:
            raise SimError(f"{self.system}: {e}") from None
        reference = self.reference or PlanningReference.load()
        self.per_call_ms, self.reference_shape = reference.per_call_ms(self.config.num_experts, self.world)

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
        counts_SE = torch.from_numpy(np.asarray(split_sources(counts_E, W) if counts_SE is None else counts_SE,
                                                dtype=np.int64))
        calls, deferred = PlannerCalls(), PlannerCalls()  # in sequence, never nested
        t0 = time.perf_counter()
        with calls:  # what the forward waits for
            fwd_quota_E = planner.forward_quota(counts_SE)
            fwd_SE = None if fwd_quota_E is None else torch.from_numpy(split_sources(fwd_quota_E.numpy(), W))
            plan = planner.plan_forward(counts_SE, fwd_SE, training=True)
        with deferred:  # the backward's plan, issued after the forward's rows and experts
            plan = plan.with_backward(planner.plan_backward(plan), spec)
        live = time.perf_counter() - t0
        fwd_SR = plan.assignment.rows_SR().numpy()
        score_R = np.zeros(W, np.int64)
        if fwd_quota_E is not None:  # capacity: a global score exchange in the forward
            score_R = torch.minimum(counts_SE, fwd_quota_E.view(1, cfg.num_experts)).sum(1).numpy()
        keep = plan.keep  # None: what the system keeps
        local = spec.selective and self.selection in LOCAL_SELECTIONS
        bwd_SR, kept, live_bwd = fwd_SR, int(plan.forward_SE.sum()), 0.0
        if plan.quota_E is not None:  # (lrmoe-capacity: the backward's over the forward drop's exchange)
            score_R = score_R + self._score_pairs(plan.forward_SE, plan.quota_E)
            bwd_SR, kept, live_bwd = self._backward_rows(plan, plan.forward_SE, fwd_SR, keep, calls)
        call = LayerCall(
            system=self.system, fwd_SR=fwd_SR, bwd_SR=bwd_SR, copies_R=np.array([len(x) for x in plan.placement.slots]),
            owned_R=np.array(planner.base.owned_counts), chunks_R=_chunks(fwd_SR.sum(0), plan.chunk_rows_R),
            home_pairs_R=plan.forward_SE.sum(1).numpy(), home_bwd_pairs_R=bwd_SR.sum(1),
            score_pairs_R=np.asarray(score_R), score_in_forward=spec.forward_drop,
            refresh_SR=_refreshes(plan.placement), kept_pairs=kept, total_pairs=int(counts_SE.sum()), host_s=0.0,
            peak_R=np.zeros(W, np.int64), kept_bytes_R=np.zeros(W, np.int64),
            tokens_per_rank=int(counts_SE.sum()) // cfg.top_k // W, keep=keep,
            recomputes=kept_to_backward(spec, keep, chunked=False).recomputes, resends_x=keep == KEEP_NOTHING,
            split_R=plan.split_R,
            count_gather=spec.selective and not local, positions=local and keep not in (None, KEEP_NOTHING),
        )
        chunk_R = _chunks(fwd_SR.sum(0), plan.rounds_R)
        call = replace(call, bwd_chunks_R=_chunks(bwd_SR.sum(0), plan.bwd_chunk_rows_R),
                       rounds=int(chunk_R.max()) if plan.rounds_R is not None else 1,
                       **self._memory(call, plan.chunk_rows_R, plan.bwd_chunk_rows_R, s))
        return self._end_step(call, calls, deferred, live + live_bwd)

    def _backward_rows(self, plan, counts_SE: torch.Tensor, fwd_SR: np.ndarray, keep: str | None,
                       calls: PlannerCalls) -> tuple[np.ndarray, int, float]:
        """A selective backward's rows per (source, destination), its kept pairs, and the live
        time of its host planning (a local selection's strata and kept assignment were planned
        with the backward's plan; a global selection's kept pairs are assigned in the backward)."""
        kept, live = int(plan.quota_E.sum()), 0.0
        if not self.planner.spec.compacts:
            return fwd_SR, kept, live
        kept_SE = largest_remainder(plan.quota_E, counts_SE)
        if keep == KEEP_NOTHING:  # re-spread min-peak within the kept capacities (the layer's rows)
            t0 = time.perf_counter()
            with calls:  # a local selection's: planned with the backward's plan (CallPlan.kept_assignment)
                bwd_SR = plan.assign_kept(kept_SE).rows_SR().numpy()
            return bwd_SR, kept, time.perf_counter() - t0
        # computed where the forward computed them (the forward's assignment restricted)
        return plan.assignment.restricted(kept_SE).rows_SR().numpy(), kept, live

    def _memory(self, call: LayerCall, chunk_rows_R: list[int] | None, bwd_chunk_rows_R: list[int] | None,
                s: int) -> dict:
        """Every rank's expert-side peak and the bytes it keeps from forward to backward."""
        spec, cfg, W = self.planner.spec, self.config, self.world
        recv_R, chunk_rows = call.fwd_SR.sum(0), chunk_rows_R or [None] * W
        bwd_chunks = bwd_chunk_rows_R or [None] * W
        replicas_anywhere = int(call.copies_R.sum()) > cfg.num_experts
        peak_R = np.array([
            expert_side_peak(spec, cfg.dim, cfg.ffn_dim, s, RankWork(
                int(recv_R[r]), int(call.bwd_SR[:, r].sum()), int(call.copies_R[r]), int(call.owned_R[r]),
                chunk_rows[r], W, replicas_anywhere, keep=call.keep, bwd_chunk_rows=bwd_chunks[r],
                split=None if call.split_R is None else call.split_R[r]))
            for r in range(W)])
        kept_bytes_R = np.array([kept_between_passes(spec, cfg.dim, cfg.ffn_dim, s, int(recv_R[r]), call.keep,
                                                     chunk_rows[r] is not None and chunk_rows[r] < recv_R[r],
                                                     None if call.split_R is None else call.split_R[r])
                                 for r in range(W)])
        return {"peak_R": peak_R, "kept_bytes_R": kept_bytes_R}

    def _end_step(self, call: LayerCall, calls: PlannerCalls, deferred: PlannerCalls, live: float) -> LayerCall:
        """The optimizer step's end (replicas re-planned when due) and the call's host time.
        lrmoe's first replica-count search scores every candidate once per run (later ones walk
        from its choice): a one-time cost, reported apart, not in the step time."""
        planner = self.planner
        first_search = planner.controller is not None and planner.keeps_replicas and not planner.replica_count_chosen
        once = PlannerCalls() if first_search else calls
        t0 = time.perf_counter()
        with once:
            planner.step_end()  # re-plans replicas when due (symi every step; lrmoe's cost search every step)
        live += time.perf_counter() - t0
        return replace(call, host_s=host_seconds(calls.counts, self.per_call_ms), host_live_s=live,
                       planner_calls=dict(calls.counts + deferred.counts),
                       deferred_host_s=host_seconds(deferred.counts, self.per_call_ms),
                       deferred_planner_calls=dict(deferred.counts),
                       once_host_s=host_seconds(once.counts, self.per_call_ms) if first_search else 0.0)

    def _score_pairs(self, counts_SE: torch.Tensor, quota_E: torch.Tensor) -> np.ndarray:
        """Scores each rank sends in its selection's exchange (``SCORE_EXCHANGE``)."""
        how = SCORE_EXCHANGE[self.selection]
        if how == "candidates":
            return torch.minimum(counts_SE, quota_E.view(1, -1)).sum(1).numpy()
        if how == "all":
            return counts_SE.sum(1).numpy()
        return np.zeros(counts_SE.shape[0], np.int64)


def _chunks(recv_R: np.ndarray, chunk_rows_R: list[int] | None) -> np.ndarray:
    """Forward chunks per rank (1: computed at once)."""
    chunks_R = np.ones(len(recv_R), np.int64)
    for r, c in enumerate(chunk_rows_R or []):
        if c is not None and recv_R[r]:
            chunks_R[r] = -(-int(recv_R[r]) // c)
    return chunks_R


def _refreshes(placement) -> np.ndarray:
    """int64 (W, W): expert copies owner s sends holder r after every step."""
    W = placement.world
    refresh_SR = np.zeros((W, W), np.int64)
    for r in range(W):
        for e in placement.replicas(r):
            refresh_SR[int(placement.owner_E[e]), r] += 1
    return refresh_SR


__all__ = ["LayerCall", "SCORE_EXCHANGE", "SystemPlanner"]
