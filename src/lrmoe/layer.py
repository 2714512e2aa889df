"""MoELayer: router → count exchange → placement plan → dispatch → grouped experts → combine.

The routed-expert path is one hand-written autograd function (:class:`_RoutedExperts`): its
forward and backward exchange rows with separate split plans, so a backward may carry fewer
rows (LRMoE compaction) or send them to other replicas than the forward did. The router and the
shared expert stay on ordinary autograd; the router gradient arrives through the combine
weights and is exact for every pair (it needs only ⟨g_t, y_te⟩, with y kept at home).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from lrmoe import comm, experts
from lrmoe.balance import assign_min_peak
from lrmoe.comm import Group, WireCounter
from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.controller import Controller
from lrmoe.dispatch import RowPlan, build_row_plan
from lrmoe.experts import GroupedExperts, SwiGLU
from lrmoe.placement import Placement, plan_replicas
from lrmoe.replicas import Replicas
from lrmoe.router import Router, aux_losses
from lrmoe.selection import Selection, fixed_ratio_quota, lrm_scores, select, squared_norms

SYSTEMS = ("static", "static-recompute", "lrmoe", "masked", "symi", "capacity")
SELECTIVE = ("lrmoe", "masked")  # systems whose backward keeps only selected pairs
SAVES_ACTIVATIONS = ("static", "symi", "capacity")  # the others recompute gate/up and h
ADAM_STATES = 2  # optimizer_bytes assumes Adam(W): two moments per owned parameter


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class MemoryMeter:
    """Bytes a rank holds for the experts during one layer call, and their peak.

    Follows the lifetimes of the tensors the routed path allocates (DESIGN.md "Expert-side
    memory"): parameters and gradient buffers, received rows, intermediates, send/receive
    buffers of the backward.
    """

    def __init__(self, base: int) -> None:
        self.now = self.peak = base

    def hold(self, *tensors: torch.Tensor | None) -> None:
        self.now += _nbytes(*tensors)
        self.peak = max(self.peak, self.now)

    def drop(self, *tensors: torch.Tensor | None) -> None:
        self.now -= _nbytes(*tensors)


@dataclass
class _Call:
    """State of one layer call, shared by the routed function's forward and backward."""

    layer: MoELayer
    ids_TK: torch.Tensor
    stats: dict = field(default_factory=dict)
    plan: RowPlan | None = None
    counts_SE: torch.Tensor | None = None
    meter: MemoryMeter | None = None
    saved: dict = field(default_factory=dict)
    training: bool = False  # a grad-enabled call: it may update the load statistics


def _to_experts(
    send_ND: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter, meter: MemoryMeter
) -> torch.Tensor:
    """Send home rows to the experts; returns them received and regrouped slot-major."""
    recv_RD = comm.all_to_all(send_ND, plan.send_splits, plan.recv_splits, group, wire)
    meter.hold(recv_RD)
    if plan.regroup_idx is None:
        return recv_RD
    rows_RD = recv_RD[plan.regroup_idx.to(recv_RD.device)]
    meter.hold(rows_RD)
    meter.drop(recv_RD)
    return rows_RD


def _to_home(rows_RX: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter) -> torch.Tensor:
    """Inverse of :func:`_to_experts`: slot-major expert rows back to their home ranks."""
    if plan.regroup_idx is not None:
        back = torch.empty_like(rows_RX)
        back[plan.regroup_idx.to(rows_RX.device)] = rows_RX
        rows_RX = back
    return comm.all_to_all(rows_RX, plan.recv_splits, plan.send_splits, group, wire)


def _slot_weights(layer: MoELayer, gate_up: torch.Tensor, down: torch.Tensor):
    """Weights of every local slot: owned experts, then replicas."""
    if not len(layer.replicas.experts):
        return gate_up, down
    return (torch.cat([gate_up, layer.replicas.gate_up_proj]), torch.cat([down, layer.replicas.down_proj]))


def _assignment(layer: MoELayer, counts_SE: torch.Tensor, capacity_R: list[int] | None = None
                ) -> torch.Tensor:
    """assign_ESR: single copies go to their owner; replicated experts are spread min-peak."""
    if layer.placement.num_copies == layer.config.num_experts:
        return layer.placement.owner_assignment(counts_SE)
    return assign_min_peak(counts_SE.t(), layer.placement.holder_lists, capacity_R)


def _capacity_keep(layer: MoELayer, weights_TK: torch.Tensor, ids_P: torch.Tensor, counts_SE: torch.Tensor,
                   wire: WireCounter) -> Selection:
    """Capacity-factor dropping (GShard/Switch), global per call: each expert keeps its
    ceil(C · pairs / E) pairs of highest routing probability, ties to lower (rank, token, k)."""
    E = layer.config.num_experts
    capacity = math.ceil(layer.capacity_factor * int(counts_SE.sum()) / E)
    quota_E = torch.clamp(counts_SE.sum(0), max=capacity)
    return select(weights_TK.detach().reshape(-1).to(torch.float64), ids_P, counts_SE, quota_E,
                  BackwardConfig(), layer.group, wire)


def _expert_forward_chunked(rows_RD, gate_up, down, counts_L, chunk: int, want_h_sq: bool):
    """Complete forward computed ``chunk`` rows at a time (activations dropped after each
    chunk): the budgeted LRMoE expert side keeps nothing and never holds more than a chunk."""
    R = rows_RD.shape[0]
    y_RD = rows_RD.new_empty(R, down.shape[1])
    h_sq = torch.empty(R, dtype=torch.float64, device=rows_RD.device) if want_h_sq else None
    ends = counts_L.cumsum(0)
    for a in range(0, R, chunk):
        b = min(a + chunk, R)
        part_L = (ends.clamp(max=b) - (ends - counts_L).clamp(min=a)).clamp(min=0)
        y, acts = experts.expert_forward(rows_RD[a:b], gate_up, down, part_L)
        y_RD[a:b] = y
        if want_h_sq:
            h_sq[a:b] = squared_norms(acts["h"])
    return y_RD, h_sq


def _routed_forward(
    call: _Call, x_TD: torch.Tensor, weights_TK: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Complete forward of the routed experts (``capacity`` drops its overflow first).

    Returns (out_TD, y_PD expert outputs per pair, h_sq_P ‖h‖² per pair or None): the last two
    stay at home for the backward (router gradient, LRM scores).
    """
    layer = call.layer
    t0 = time.perf_counter()
    T, K = call.ids_TK.shape
    E, group, system = layer.config.num_experts, layer.group, layer.system
    wire = WireCounter()
    ids_P = call.ids_TK.reshape(-1)

    counts_E = torch.bincount(ids_P, minlength=E).cpu()
    counts_SE = comm.all_gather(counts_E.view(1, E), [1] * layer.world, group, wire)
    call.counts_SE = counts_SE
    if call.training:
        layer._observe_load(counts_SE.sum(0))
    keep_P = None
    if system == "capacity":
        sel = _capacity_keep(layer, weights_TK, ids_P, counts_SE, wire)
        keep_P, counts_SE_kept = sel.keep_P, sel.kept_SE
        call.stats["forward_kept_E"] = counts_SE_kept.sum(0)
        layer.last_kept = sel.keep_P.view(T, K)
    else:
        counts_SE_kept = counts_SE
    assign_ESR = _assignment(layer, counts_SE_kept)
    plan = build_row_plan(ids_P, assign_ESR, layer.placement, layer.rank, keep_P=keep_P)
    call.plan = plan
    chunk = plan.recv_rows
    if layer.controller is not None:  # every rank checks every rank, so all raise together
        recv_R = assign_ESR.sum((0, 1))
        for r in range(layer.world):
            c = layer.controller.forward_chunk_rows(layer.placement, r, int(recv_R[r]))
            if r == layer.rank:
                chunk = c

    w_gu, w_down = _slot_weights(layer, gate_up, down)
    # every local copy and its gradient buffer, plus the owned weights' second copy inside the
    # concatenated slot weights when this rank holds replicas
    meter = MemoryMeter(2 * _nbytes(w_gu, w_down) + (_nbytes(gate_up, down) if w_gu is not gate_up else 0))
    rows_RD = _to_experts(x_TD[plan.pair_idx // K], plan, group, wire, meter)
    want_h_sq = system in SELECTIVE
    acts = None
    if chunk < plan.recv_rows:
        y_RD, h_sq_R = _expert_forward_chunked(rows_RD, w_gu, w_down, plan.slot_counts, chunk, want_h_sq)
        F_ = down.shape[2]
        meter.hold(y_RD, h_sq_R)
        meter.peak = max(meter.peak, meter.now + chunk * 4 * F_ * y_RD.element_size())
    else:
        y_RD, acts = experts.expert_forward(rows_RD, w_gu, w_down, plan.slot_counts)
        meter.hold(y_RD, *acts.values())
        h_sq_R = squared_norms(acts["h"]) if want_h_sq else None
        meter.hold(h_sq_R)
    h_sq_P = None
    if want_h_sq:  # ‖h‖² of every pair goes home with y, for the LRM scores
        h_sq_P = torch.empty(T * K, dtype=torch.float64, device=x_TD.device)
        h_sq_P[plan.pair_idx] = _to_home(h_sq_R, plan, group, wire)
        meter.drop(h_sq_R)
    y_home_ND = _to_home(y_RD, plan, group, wire)
    meter.drop(y_RD)
    del y_RD

    # Pairs a plan does not carry (dropped by a capacity factor) contribute zero.
    full = len(plan.pair_idx) == T * K
    y_PD = (x_TD.new_empty if full else x_TD.new_zeros)(T * K, x_TD.shape[1])
    y_PD[plan.pair_idx] = y_home_ND
    out_TD = torch.bmm(weights_TK.unsqueeze(1), y_PD.view(T, K, x_TD.shape[1])).squeeze(1)

    # What the expert side keeps for the backward (DESIGN.md "Recompute"): static-like systems
    # keep rows and activations, the recompute systems rows only, lrmoe nothing (home re-sends
    # the x rows of kept pairs).
    if w_gu is not gate_up:  # the concatenated slot weights serve the backward too (counted above)
        call.saved["slot_weights"] = (w_gu, w_down)
    if system in SAVES_ACTIVATIONS:
        call.saved.update(rows_RD=rows_RD, acts=acts)
    else:
        if acts is not None:
            meter.drop(*acts.values())
        if system == "lrmoe":
            meter.drop(rows_RD)
        else:
            call.saved["rows_RD"] = rows_RD
    del acts, rows_RD
    call.meter = meter
    call.stats.update(
        counts_E=counts_SE.sum(0),
        recv_rows=plan.recv_rows,
        forward_pairs_computed=plan.recv_rows,
        fwd_a2a_bytes=wire.sent,
        fwd_a2a_recv_bytes=wire.received,
        home_bytes=_nbytes(y_PD, weights_TK, call.ids_TK, plan.pair_idx, h_sq_P),
        peak_expert_side_bytes=meter.peak,  # the backward raises it to the whole call's peak
        placement_bytes=layer._take_placement_bytes(),
        optimizer_bytes=ADAM_STATES * _nbytes(gate_up, down),
        fwd_ms=(time.perf_counter() - t0) * 1e3,
    )
    return out_TD, y_PD, h_sq_P


def _quotas(layer: MoELayer, counts_E: torch.Tensor, cap_R: list[int] | None) -> torch.Tensor:
    """The controller's max–min fair quotas capped by the ratio's, or the ratio's alone."""
    quota_E = fixed_ratio_quota(counts_E, layer.backward_config.ratio)
    if layer.controller is not None:
        quota_E = torch.minimum(quota_E, layer.controller.quotas(counts_E, layer.placement, cap_R))
    return quota_E


def _select(call: _Call, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor,
            cap_R: list[int] | None, wire: WireCounter) -> Selection:
    """LRM scores of this rank's pairs and the kept set (collective)."""
    layer = call.layer
    K = call.ids_TK.shape[1]
    ids_P = call.ids_TK.reshape(-1)
    g_sq_P = squared_norms(g_TD).repeat_interleave(K)
    scores_P = lrm_scores(weights_TK.reshape(-1), g_sq_P, h_sq_P)
    quota_E = _quotas(layer, call.counts_SE.sum(0), cap_R)
    return select(scores_P, ids_P, call.counts_SE, quota_E, layer.backward_config, layer.group, wire,
                  layer._selection_generator())


def _routed_backward(
    call: _Call, g_TD: torch.Tensor, x_TD: torch.Tensor, weights_TK: torch.Tensor, y_PD: torch.Tensor,
    h_sq_P: torch.Tensor | None, gate_up: torch.Tensor, down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the routed experts. Returns (dx_TD, dweights_TK, dgate_up, ddown).

    Full-backward systems reuse the forward's plan. ``masked`` uses it too, with the rows of
    dropped pairs zeroed. ``lrmoe`` builds a compacted plan over the kept pairs only (spread
    min-peak over replicas within the controller's capacities) and re-sends their x rows,
    since its expert side kept none. Replica weight gradients are reduced to their owners.
    """
    layer, meter, saved = call.layer, call.meter, call.saved
    t0 = time.perf_counter()
    T, K = call.ids_TK.shape
    ids_P = call.ids_TK.reshape(-1)
    wire = WireCounter()
    g_TD = g_TD.contiguous()

    # Router gradient, exact for every pair: d out_t / d w_tk = ⟨g_t, y_tk⟩.
    dweights_TK = torch.bmm(y_PD.view(T, K, x_TD.shape[1]), g_TD.unsqueeze(-1)).squeeze(-1)

    t_select = time.perf_counter()  # scoring, selection exchange and packing
    # Per-row factor of dy = factor · g_t: the routing weight, times 1/p for sampled pairs,
    # times 0 for pairs the masked ablation drops.
    factor_P = weights_TK.reshape(-1)
    plan = call.plan
    if layer.system in SELECTIVE:
        # backward rows each rank may keep within its budget (None: unbounded)
        cap_R = layer.controller.kept_capacity(layer.placement) if layer.controller is not None else None
        sel = _select(call, g_TD, weights_TK, h_sq_P, cap_R, wire)
        if sel.scale_P is not None:
            factor_P = factor_P * sel.scale_P.to(factor_P.dtype)
        if layer.system == "masked":
            factor_P = factor_P * sel.keep_P
        else:
            assign_ESR = _assignment(layer, sel.kept_SE, cap_R)
            plan = build_row_plan(ids_P, assign_ESR, layer.placement, layer.rank, keep_P=sel.keep_P)
        keep_TK, quota_E, kept_E = sel.keep_P.view(T, K), sel.quota_E, sel.kept_SE.sum(0)
        call.stats["nonfinite"] = sel.nonfinite
    else:
        kept_E = call.stats.get("forward_kept_E", call.counts_SE.sum(0))
        all_kept = torch.ones_like(call.ids_TK, dtype=torch.bool)
        keep_TK = layer.last_kept if layer.system == "capacity" else all_kept
        quota_E = kept_E
    tok_N = plan.pair_idx // K
    dy_ND = g_TD[tok_N].mul_(factor_P[plan.pair_idx].unsqueeze(1))
    x_ND = x_TD[tok_N] if layer.system == "lrmoe" else None
    select_ms = (time.perf_counter() - t_select) * 1e3

    dy_RD = _to_experts(dy_ND, plan, layer.group, wire, meter)
    rows_RD = saved.pop("rows_RD") if x_ND is None else _to_experts(x_ND, plan, layer.group, wire, meter)
    del dy_ND, x_ND
    acts = saved.pop("acts", None)
    # The expert backward works in place (dh over h, d up over silu, d gate over gate, dx over
    # dy), so its peak is the four (R, F) activations beside dy and x: already counted when
    # saved, recomputed otherwise.
    rf = dy_RD.shape[0] * down.shape[2] * dy_RD.element_size()
    meter.peak = max(meter.peak, meter.now + (0 if acts is not None else 4 * rf))
    if acts is not None:
        meter.drop(*acts.values())
    bwd_rows = dy_RD.shape[0]
    w_gu, w_down = saved.pop("slot_weights", (gate_up, down))
    dx_RD, dgate_up, ddown = experts.expert_backward(dy_RD, rows_RD, w_gu, w_down, plan.slot_counts, acts)
    del rows_RD, dy_RD
    dx_home_ND = _to_home(dx_RD, plan, layer.group, wire)
    dx_TD = torch.zeros_like(x_TD)
    dx_TD.index_add_(0, tok_N, dx_home_ND)
    L = gate_up.shape[0]
    if layer.placement.num_copies > layer.config.num_experts:  # replica gradients go to owners (collective)
        meter.hold(dgate_up[L:], ddown[L:])  # the send buffer
        add_gu, add_down = layer.replicas.reduce_grads(dgate_up[L:], ddown[L:], layer.placement, layer.rank,
                                                       layer.group, wire)
        dgate_up, ddown = dgate_up[:L] + add_gu, ddown[:L] + add_down

    layer.last_kept = keep_TK
    layer.last_stats = call.stats  # a forward-only call in between must not hide this call's stats
    call.stats.update(
        quota_E=quota_E,
        kept_E=kept_E,
        bwd_gemm_rows=bwd_rows,
        select_ms=select_ms if layer.system in SELECTIVE else 0.0,
        bwd_a2a_bytes=wire.sent,
        bwd_a2a_recv_bytes=wire.received,
        peak_expert_side_bytes=meter.peak,
        bwd_ms=(time.perf_counter() - t0) * 1e3,
    )
    if x_TD.is_cuda:  # the allocator's view, for the whole process since the last reset
        call.stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(x_TD.device)
    return dx_TD, dweights_TK, dgate_up, ddown


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weights_TK, gate_up, down, call: _Call):
        out_TD, y_PD, h_sq_P = _routed_forward(call, x_TD, weights_TK, gate_up, down)
        ctx.call = call
        ctx.save_for_backward(x_TD, weights_TK, y_PD, h_sq_P, gate_up, down)
        return out_TD

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, weights_TK, y_PD, h_sq_P, gate_up, down = ctx.saved_tensors
        grads = _routed_backward(ctx.call, g_TD, x_TD, weights_TK, y_PD, h_sq_P, gate_up, down)
        return (*grads, None)


class MoELayer(nn.Module):
    """An expert-parallel MoE layer over ``group`` (``None``: world size 1, same code).

    ``forward(x)`` takes (T, D) or (B, S, D). ``system`` selects placement and backward
    (see DESIGN.md): ``static``, ``static-recompute``, ``lrmoe`` (``backward`` picks the
    selection and ratio; a ``budget`` adds the controller's quotas and replicas), ``masked``,
    ``symi`` (replicas re-planned every optimizer step), ``capacity`` (``capacity_factor``).
    ``last_stats`` is refreshed by each forward and backward. Call :meth:`step_end` after every
    optimizer step when the layer has replicas (``symi``, budgeted ``lrmoe``).
    """

    def __init__(
        self,
        config: MoEConfig,
        system: str = "static",
        group: Group = None,
        backward: BackwardConfig | None = None,
        budget: ClusterBudget | None = None,
        capacity_factor: float = 1.25,
        replan_interval: int = 10,
        load_ema: float = 0.9,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be an MoEConfig, got {type(config).__name__}")
        if system not in SYSTEMS:
            raise ValueError(f"system={system!r} is invalid: expected one of {SYSTEMS}")
        if backward is not None and not isinstance(backward, BackwardConfig):
            raise TypeError(f"backward must be a BackwardConfig, got {type(backward).__name__}")
        if budget is not None and not isinstance(budget, ClusterBudget):
            raise TypeError(f"budget must be a ClusterBudget, got {type(budget).__name__}")
        if budget is not None and system not in ("lrmoe", "symi"):
            raise ValueError(f"budget is used by system='lrmoe' (quotas, replicas) or 'symi' (slots), "
                             f"not system={system!r}")
        if not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor={capacity_factor!r} is invalid: expected a number > 0")
        if isinstance(replan_interval, bool) or not isinstance(replan_interval, int) or replan_interval < 1:
            raise ValueError(f"replan_interval={replan_interval!r} is invalid: expected an integer >= 1")
        if not (isinstance(load_ema, (int, float)) and 0 <= load_ema < 1):
            raise ValueError(f"load_ema={load_ema!r} is invalid: expected a number in [0, 1)")
        self.config, self.system, self.group = config, system, group
        self.backward_config = backward or BackwardConfig()
        self.capacity_factor = float(capacity_factor)
        self.replan_interval = 1 if system == "symi" else replan_interval
        self.load_ema = load_ema
        self._backward_calls = 0  # seeds random/sampled selection: one stream per backward
        self.world, self.rank = comm.world_size(group), comm.rank_of(group)
        self.base_placement = Placement.static(config.num_experts, self.world)
        self.placement = self.base_placement
        dtype = config.torch_dtype
        self.router = Router(config)
        n_owned = len(self.base_placement.owned(self.rank))
        self.experts = GroupedExperts(n_owned, config.dim, config.ffn_dim, dtype)
        self.replicas = Replicas(config.dim, config.ffn_dim, dtype)
        self.shared_experts = (
            SwiGLU(config.dim, config.shared_hidden, dtype) if config.num_shared_experts else None
        )
        budgeted = budget is not None and system == "lrmoe"
        self.controller = Controller(config, budget, self.world) if budgeted else None
        self._slots_R = self._plan_slots(budget)
        self._load_E = torch.ones(config.num_experts, dtype=torch.float64)
        self._steps = 0
        self._placement_bytes = 0
        if self._slots_R is not None:
            self._replan()
        self.last_stats: dict = {}
        self.last_kept: torch.Tensor | None = None  # (T, K) bool after a backward
        self.aux_loss: torch.Tensor = torch.zeros(())

    # ---------------------------------------------------------------- placement
    def _plan_slots(self, budget: ClusterBudget | None) -> list[int] | None:
        """Expert slots per rank for the replicated systems; None: single copies."""
        base = self.base_placement
        if self.controller is not None:
            return self.controller.slots(base)
        if self.system != "symi":
            return None
        fixed = budget.per_rank(self.world)[2] if budget is not None else None
        if fixed is not None:
            return fixed
        # SYMI default: half as many replica slots as owned experts (at least one)
        return [len(base.owned(r)) + max(1, math.ceil(len(base.owned(r)) / 2)) for r in range(self.world)]

    def _replan(self) -> None:
        """Re-plan replicas from the smoothed load; the new copies are fetched at the next
        forward (or :meth:`step_end`), every byte counted."""
        self.placement = plan_replicas(self.base_placement, self._load_E, self._slots_R)
        if self.controller is not None:
            self.controller.check_slots(self.placement)
        self._stale = True

    def _refresh_replicas(self) -> None:
        self._placement_bytes += self.replicas.refresh(
            self.experts.gate_up_proj.detach(), self.experts.down_proj.detach(), self.placement, self.rank,
            self.group)
        self._stale = False

    def _take_placement_bytes(self) -> int:
        moved, self._placement_bytes = self._placement_bytes, 0
        return moved

    def _observe_load(self, counts_E: torch.Tensor) -> None:
        self._load_E = self.load_ema * self._load_E + (1 - self.load_ema) * counts_E.to(torch.float64)

    @torch.no_grad()
    def step_end(self) -> None:
        """Call after every optimizer step (collective): re-plans replicas when due and
        refreshes every replica from its owner's updated parameters. A no-op without replicas."""
        self._steps += 1
        if self._slots_R is None:
            return
        if self._steps % self.replan_interval == 0:
            self._replan()
        self._refresh_replicas()

    def train_state(self) -> dict:
        """What a checkpoint needs beyond the state dict to resume exactly: load statistics,
        step and selection counters, and the replica placement."""
        return {"load_E": self._load_E.clone(), "steps": self._steps, "backward_calls": self._backward_calls,
                "slots": [list(s) for s in self.placement.slots]}

    def load_train_state(self, state: dict) -> None:
        self._load_E = state["load_E"].clone()
        self._steps, self._backward_calls = int(state["steps"]), int(state["backward_calls"])
        slots = [tuple(s) for s in state["slots"]]
        if self._slots_R is not None:
            replicas = [[e for e in s if int(self.base_placement.owner_E[e]) != r] for r, s in enumerate(slots)]
            self.placement = self.base_placement.with_replicas(replicas)
            self._stale = True  # refetched from the owners at the next forward

    def _selection_generator(self) -> torch.Generator:
        """A fresh stream per backward call and rank, reproducible from the config's seed."""
        self._backward_calls += 1
        seed = (self.backward_config.seed * 1_000_003 + self._backward_calls) * 65_537 + self.rank
        return torch.Generator().manual_seed(seed % (2**63))

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = self.config.dim
        if x.dim() not in (2, 3) or x.shape[-1] != D:
            raise ValueError(f"MoELayer expects input of shape (T, {D}) or (B, S, {D}), got {tuple(x.shape)}")
        if self._slots_R is not None and self._stale:
            self._refresh_replicas()
        x_TD = x.reshape(-1, D)
        routing = self.router(x_TD)
        self.aux_loss = aux_losses(routing, self.config)
        call = _Call(self, routing.ids_TK, training=torch.is_grad_enabled())
        self.last_stats = call.stats
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if torch.is_grad_enabled():
            out_TD = _RoutedExperts.apply(x_TD, routing.weights_TK, gate_up, down, call)
        else:  # forward only: nothing is kept for a backward
            out_TD = _routed_forward(call, x_TD, routing.weights_TK, gate_up, down)[0]
            call.saved.clear()
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(x.shape)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; replicas are then refetched at the next forward."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._stale = self._slots_R is not None
        return result

    # ---------------------------------------------------------------- full-shape views
    def _local_expert_rows(self) -> list[int]:
        return list(self.placement.owned(self.rank))

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the state dict of the world-size-1 layer, keeping what this rank holds."""
        local = dict(state_dict)
        idx = torch.tensor(self._local_expert_rows(), dtype=torch.long)
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            if name not in local:
                raise KeyError(f"full state dict lacks {name!r}")
            full = local[name]
            if full.shape[0] != self.config.num_experts:
                raise ValueError(
                    f"{name} has {full.shape[0]} experts, the layer's config has {self.config.num_experts}"
                )
            local[name] = full.index_select(0, idx)
        self.load_state_dict(local)
        if self._slots_R is not None:  # every rank has the full tensors: no exchange needed
            self.replicas.load_from_full(state_dict["experts.gate_up_proj"], state_dict["experts.down_proj"],
                                         self.placement, self.rank)
            self._stale = False

    def _gather_experts(self, local_LXY: torch.Tensor) -> torch.Tensor:
        """Expert tensors of all owners, in expert order, on every rank."""
        owned = [self.placement.owned(r) for r in range(self.world)]
        stacked = comm.all_gather(local_LXY.detach(), [len(o) for o in owned], self.group)
        order = torch.tensor([e for o in owned for e in o], dtype=torch.long)
        full = torch.empty_like(stacked)
        full[order] = stacked
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the world-size-1 layer's state dict, on every rank."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            sd[name] = self._gather_experts(sd[name])
        return sd

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Collective: gradients of the world-size-1 layer fed with all ranks' tokens.

        Replicated parameters (router, shared expert): summed over ranks. Experts: from owners.
        """
        grads = {}
        for name, p in self.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            if name.startswith("experts."):
                grads[name] = self._gather_experts(g)
            else:
                grads[name] = comm.all_reduce_sum(g.detach(), self.group)
        return grads

    # ---------------------------------------------------------------- training hooks
    @torch.no_grad()
    def update_router_bias(self, counts_E: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (sigmoid router), once per optimizer step, global counts."""
        self.router.update_bias(counts_E, rate)
