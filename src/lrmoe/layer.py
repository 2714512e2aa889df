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

from lrmoe import comm, experts, planners, sharding
from lrmoe.balance import assign_min_peak
from lrmoe.comm import Group, WireCounter
from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.controller import Controller
from lrmoe.dispatch import RowPlan, build_row_plan
from lrmoe.experts import GroupedExperts, SwiGLU
from lrmoe.placement import Placement, plan_replicas
from lrmoe.planners import CostModel
from lrmoe.replicas import Replicas
from lrmoe.router import Router, aux_losses
from lrmoe.selection import Selection, fixed_ratio_quota, lrm_scores, select, squared_norms

REPLICATION_FAMILY = ("fastermoe", "flexmoe", "smartmoe", "laer", "ultraep", "topoep")
SYSTEMS = ("static", "static-recompute", "lrmoe", "masked", "symi", "capacity", *REPLICATION_FAMILY)
SELECTIVE = ("lrmoe", "masked")  # systems whose backward keeps only selected pairs
SAVES_ACTIVATIONS = ("static", "symi", "capacity", *REPLICATION_FAMILY)  # the others recompute gate/up and h
PER_CALL = ("fastermoe", "ultraep", "laer")  # placement planned from each call's own counts
PER_STEP = ("symi", "flexmoe", "smartmoe", "topoep")  # replicas re-planned between optimizer steps
TAKES_BUDGET = ("lrmoe", "symi", *REPLICATION_FAMILY)
ADAM_STATES = planners.ADAM_STATES  # optimizer_bytes assumes Adam(W): two moments per owned parameter
SMARTMOE_POOL = 4  # placements in SmartMoE's offline pool
SMARTMOE_WARMUP = 20  # without a given trace, SmartMoE records this many calls' loads first
EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")
FLEXMOE_HORIZON = 10  # steps a FlexMoE re-placement is expected to last when weighing its cost


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
    placement: Placement | None = None  # this call's (per-call planners change the layer's between calls)
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


def _slot_weights(call: _Call, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of every local slot: owned experts, then replicas; for ``laer`` the experts this
    call placed here, assembled from every rank's slices (parameter bytes moved, counted)."""
    layer = call.layer
    if layer.system == "laer":
        wire = layer._wire()
        weights = sharding.assemble(gate_up.detach(), down.detach(), call.placement, layer.rank, layer.group, wire)
        layer._placement_bytes += wire.sent
        return weights
    if not len(layer.replicas.experts):
        return gate_up, down
    return (torch.cat([gate_up, layer.replicas.gate_up_proj]), torch.cat([down, layer.replicas.down_proj]))


def _assignment(layer: MoELayer, placement: Placement, counts_SE: torch.Tensor,
                capacity_R: list[int] | None = None) -> torch.Tensor:
    """assign_ESR: single copies go to their owner; replicated experts are spread min-peak
    (``fastermoe``: shadowed experts compute where their pairs are; ``topoep``: then sources
    re-matched to holders to keep pairs inside their node)."""
    if layer.system == "fastermoe":
        return planners.local_assignment(counts_SE, placement)
    if placement.owners_only:
        return placement.owner_assignment(counts_SE)
    assign_ESR = assign_min_peak(counts_SE.t(), placement.holder_lists, capacity_R)
    if layer.system == "topoep":
        assign_ESR = planners.localize(assign_ESR, layer.node_of)
    return assign_ESR


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
    wire = layer._wire()
    ids_P = call.ids_TK.reshape(-1)
    pending_bytes = layer._placement_bytes  # moved since the last training call (step_end refreshes)

    counts_E = torch.bincount(ids_P, minlength=E).cpu()
    counts_SE = comm.all_gather(counts_E.view(1, E), [1] * layer.world, group, wire)
    call.counts_SE = counts_SE
    if call.training:
        layer._observe_load(counts_SE.sum(0))
    if system in PER_CALL:
        call.stats.update(layer._place_call(counts_SE))
    call.placement = placement = layer.placement
    keep_P = None
    if system == "capacity":
        sel = _capacity_keep(layer, weights_TK, ids_P, counts_SE, wire)
        keep_P, counts_SE_kept = sel.keep_P, sel.kept_SE
        call.stats["forward_kept_E"] = counts_SE_kept.sum(0)
        layer.last_kept = sel.keep_P.view(T, K)
    else:
        counts_SE_kept = counts_SE
    assign_ESR = _assignment(layer, placement, counts_SE_kept)
    plan = build_row_plan(ids_P, assign_ESR, placement, layer.rank, keep_P=keep_P)
    call.plan = plan
    chunk = plan.recv_rows
    if layer.controller is not None:  # every rank checks every rank, so all raise together
        recv_R = assign_ESR.sum((0, 1))
        for r in range(layer.world):
            c = layer.controller.forward_chunk_rows(placement, r, int(recv_R[r]))
            if r == layer.rank:
                chunk = c

    w_gu, w_down = _slot_weights(call, gate_up, down)
    if system == "laer":  # slices and their gradients, assembled experts and theirs
        meter = MemoryMeter(2 * (_nbytes(gate_up, down) + _nbytes(w_gu, w_down)))
    else:  # every local copy and its gradient buffer, plus the owned weights' second copy inside
        # the concatenated slot weights when this rank holds replicas
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
        **({"fwd_a2a_inter_bytes": wire.inter_sent} if wire.node_of else {}),
        home_bytes=_nbytes(y_PD, weights_TK, call.ids_TK, plan.pair_idx, h_sq_P),
        peak_expert_side_bytes=meter.peak,  # the backward raises it to the whole call's peak
        placement_bytes=layer._take_placement_bytes(pending_bytes if not call.training else 0),
        optimizer_bytes=ADAM_STATES * _nbytes(gate_up, down),
        fwd_ms=(time.perf_counter() - t0) * 1e3,
    )
    if system == "flexmoe" and call.training:  # modelled, not moved: see docs/systems.md
        call.stats["bound_optimizer_bytes"], layer._bound_optimizer_bytes = layer._bound_optimizer_bytes, 0
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
    wire = layer._wire()
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
        cap_R = layer.controller.kept_capacity(call.placement) if layer.controller is not None else None
        sel = _select(call, g_TD, weights_TK, h_sq_P, cap_R, wire)
        if sel.scale_P is not None:
            factor_P = factor_P * sel.scale_P.to(factor_P.dtype)
        if layer.system == "masked":
            factor_P = factor_P * sel.keep_P
        else:
            assign_ESR = _assignment(layer, call.placement, sel.kept_SE, cap_R)
            plan = build_row_plan(ids_P, assign_ESR, call.placement, layer.rank, keep_P=sel.keep_P)
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
    if layer.system == "laer":  # slot gradients summed into the slices' owners (collective)
        meter.hold(dgate_up, ddown)  # the send buffer
        dgate_up, ddown = sharding.reduce_grads(dgate_up, ddown, call.placement, layer.rank, layer.group, wire, L)
    elif call.placement.num_copies > layer.config.num_experts:  # replica gradients go to owners (collective)
        meter.hold(dgate_up[L:], ddown[L:])  # the send buffer
        add_gu, add_down = layer.replicas.reduce_grads(dgate_up[L:], ddown[L:], call.placement, layer.rank,
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
        **({"bwd_a2a_inter_bytes": wire.inter_sent} if wire.node_of else {}),
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
    ``symi`` (replicas re-planned every optimizer step), ``capacity`` (``capacity_factor``), and
    the replication family (docs/systems.md): ``fastermoe``, ``flexmoe``, ``smartmoe``
    (``routing_trace``: (steps, E) loads for its offline pool), ``laer``, ``ultraep``, ``topoep``
    (``budget.ranks_per_node``). ``last_stats`` is refreshed by each forward and backward. Call
    :meth:`step_end` after every optimizer step (a no-op for systems without replicas).
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
        routing_trace: torch.Tensor | None = None,
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
        if budget is not None and system not in TAKES_BUDGET:
            raise ValueError(f"budget is used by system='lrmoe' (quotas, replicas) and the replicated systems "
                             f"{TAKES_BUDGET[1:]} (slots, topology), not system={system!r}")
        if system == "topoep" and (budget is None or budget.ranks_per_node is None):
            raise ValueError("system='topoep' needs the topology: budget=ClusterBudget(ranks_per_node=...)")
        if routing_trace is not None and system != "smartmoe":
            raise ValueError(f"routing_trace is used by system='smartmoe', not system={system!r}")
        if not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor={capacity_factor!r} is invalid: expected a number > 0")
        if isinstance(replan_interval, bool) or not isinstance(replan_interval, int) or replan_interval < 1:
            raise ValueError(f"replan_interval={replan_interval!r} is invalid: expected an integer >= 1")
        if not (isinstance(load_ema, (int, float)) and 0 <= load_ema < 1):
            raise ValueError(f"load_ema={load_ema!r} is invalid: expected a number in [0, 1)")
        self.config, self.system, self.group = config, system, group
        self.backward_config = backward or BackwardConfig()
        self.capacity_factor = float(capacity_factor)
        self.replan_interval = 1 if system in PER_STEP else replan_interval
        self.load_ema = load_ema
        self._backward_calls = 0  # seeds random/sampled selection: one stream per backward
        self.world, self.rank = comm.world_size(group), comm.rank_of(group)
        self.node_of = budget.node_of(self.world) if budget is not None else None
        self.base_placement = Placement.static(config.num_experts, self.world)
        self.placement = self.base_placement
        dtype = config.torch_dtype
        self.router = Router(config)
        if system == "laer":  # a slice of every expert (sharding.py)
            sharding.check_shardable(config.ffn_dim, self.world)
            self.experts = GroupedExperts(config.num_experts, config.dim, config.ffn_dim // self.world, dtype)
        else:
            n_owned = len(self.base_placement.owned(self.rank))
            self.experts = GroupedExperts(n_owned, config.dim, config.ffn_dim, dtype)
        self.replicas = Replicas(config.dim, config.ffn_dim, dtype)
        self.shared_experts = (
            SwiGLU(config.dim, config.shared_hidden, dtype) if config.num_shared_experts else None
        )
        budgeted = budget is not None and budget.memory_bytes is not None and system == "lrmoe"
        self.controller = Controller(config, budget, self.world) if budgeted else None
        link = budget.inter_node_gbps if budget is not None and budget.inter_node_gbps else CostModel.link_gbps
        self.costs = CostModel(config.dim, config.ffn_dim, dtype.itemsize, link_gbps=link)
        self._slots_R = self._plan_slots(budget)
        self._load_E = torch.ones(config.num_experts, dtype=torch.float64)
        self._steps = 0
        self._placement_bytes = 0
        self._bound_optimizer_bytes = 0
        self._trace: list[torch.Tensor] = []  # smartmoe without a given trace: its own first steps
        self._pool = None
        if routing_trace is not None:
            self._pool = planners.placement_pool(torch.as_tensor(routing_trace), self.base_placement,
                                                 self._slots_R, SMARTMOE_POOL)
        if self._slots_R is not None and system not in PER_CALL:
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
        if self.system not in (*PER_STEP, "ultraep", "laer"):  # fastermoe shadows on every rank
            return None
        fixed = budget.per_rank(self.world)[2] if budget is not None else None
        if fixed is not None:
            return fixed
        # SYMI default: half as many replica slots as owned experts (at least one); for laer the
        # experts a rank may assemble in one call
        return [len(base.owned(r)) + max(1, math.ceil(len(base.owned(r)) / 2)) for r in range(self.world)]

    def _replan(self) -> None:
        """Re-plan replicas from the smoothed load; the new copies are fetched at the next
        forward (or :meth:`step_end`), every byte counted."""
        if self.system == "flexmoe":
            old = self.placement
            self.placement, _ = planners.flexmoe_replan(old, self._load_E, self._slots_R, self.costs, FLEXMOE_HORIZON)
            # the optimizer state this rank, as owner, would send along with its experts' new copies
            owner_E = self.base_placement.owner_E
            sent = sum(int(owner_E[e]) == self.rank for new, was in zip(self.placement.slots, old.slots)
                       for e in set(new) - set(was))
            self._bound_optimizer_bytes += sent * ADAM_STATES * self.costs.expert_bytes
        elif self.system == "smartmoe":
            if self._pool is None and len(self._trace) >= SMARTMOE_WARMUP:
                trace_NE = torch.stack(self._trace)
                self._pool = planners.placement_pool(trace_NE, self.base_placement, self._slots_R, SMARTMOE_POOL)
            if self._pool is not None:
                self.placement = self._pool[planners.pick_from_pool(self._pool, self._load_E)]
        else:
            node_of = self.node_of if self.system == "topoep" else None
            self.placement = plan_replicas(self.base_placement, self._load_E, self._slots_R, node_of)
        if self.controller is not None:
            self.controller.check_slots(self.placement)
        self._stale = True

    def _place_call(self, counts_SE: torch.Tensor) -> dict:
        """Per-call planners: this call's placement from its own counts, copies fetched now
        (collective, every parameter byte counted). Returns stats of the plan."""
        counts_E = counts_SE.sum(0)
        if self.system == "laer":  # assembled in the routed forward, from the slices
            self.placement = planners.laer_layout(counts_E, self.base_placement, self._slots_R)
            return {"assembled_experts": self.placement.num_copies}
        if self.system == "fastermoe":
            shadow = planners.shadow_experts(counts_SE, self.base_placement, self.costs)
            owner_E = self.base_placement.owner_E
            self.placement = self.base_placement.with_replicas(
                [[e for e in shadow if int(owner_E[e]) != r] for r in range(self.world)])
            stats = {"shadowed_experts": len(shadow)}
        else:  # ultraep: replica counts ∝ this call's load; per-replica quotas by assign_min_peak
            self.placement = plan_replicas(self.base_placement, counts_E.to(torch.float64), self._slots_R)
            stats = {"replicas": self.placement.num_copies - self.config.num_experts}
        self._refresh_replicas()
        return stats

    def _wire(self) -> WireCounter:
        return WireCounter(node_of=self.node_of)

    def _refresh_replicas(self) -> None:
        self._placement_bytes += self.replicas.refresh(
            self.experts.gate_up_proj.detach(), self.experts.down_proj.detach(), self.placement, self.rank,
            self.group)
        self._stale = False

    def _take_placement_bytes(self, keep: int = 0) -> int:
        """Parameter bytes moved since the last take, less ``keep`` left for the next one: a
        forward-only call reports only its own moves, so an evaluation between steps does not
        swallow the training step's replica refresh."""
        moved, self._placement_bytes = self._placement_bytes - keep, keep
        return moved

    def _observe_load(self, counts_E: torch.Tensor) -> None:
        self._load_E = self.load_ema * self._load_E + (1 - self.load_ema) * counts_E.to(torch.float64)
        if self.system == "smartmoe" and self._pool is None:
            self._trace.append(counts_E.to(torch.float64))

    @torch.no_grad()
    def step_end(self) -> None:
        """Call after every optimizer step (collective): re-plans replicas when due and
        refreshes every replica from its owner's updated parameters. A no-op without replicas."""
        self._steps += 1
        if self._slots_R is None or self.system in PER_CALL:
            return
        if self._steps % self.replan_interval == 0:
            self._replan()
        self._refresh_replicas()

    def train_state(self) -> dict:
        """What a checkpoint needs beyond the state dict to resume exactly: load statistics,
        step and selection counters, and the replica placement."""
        return {"load_E": self._load_E.clone(), "steps": self._steps, "backward_calls": self._backward_calls,
                "slots": [list(s) for s in self.placement.slots], "trace": [t.clone() for t in self._trace]}

    def load_train_state(self, state: dict) -> None:
        self._load_E = state["load_E"].clone()
        self._steps, self._backward_calls = int(state["steps"]), int(state["backward_calls"])
        self._trace = [t.clone() for t in state.get("trace", [])]
        if self.system == "smartmoe" and self._trace and len(self._trace) >= SMARTMOE_WARMUP:
            self._pool = planners.placement_pool(torch.stack(self._trace), self.base_placement, self._slots_R,
                                                 SMARTMOE_POOL)
        slots = [tuple(s) for s in state["slots"]]
        if self._slots_R is not None and self.system not in PER_CALL:
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
        if self.system not in PER_CALL and self._slots_R is not None and self._stale:
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
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the state dict of the world-size-1 layer, keeping what this rank holds."""
        local = dict(state_dict)
        for name in EXPERT_TENSORS:
            if name not in local:
                raise KeyError(f"full state dict lacks {name!r}")
            if local[name].shape[0] != self.config.num_experts:
                raise ValueError(
                    f"{name} has {local[name].shape[0]} experts, the layer's config has {self.config.num_experts}"
                )
        full = [local[name] for name in EXPERT_TENSORS]
        if self.system == "laer":
            mine = sharding.shard_full(*full, self.rank, self.world)
        else:
            idx = torch.tensor(self.base_placement.owned(self.rank), dtype=torch.long)
            mine = [t.index_select(0, idx) for t in full]
        local.update(zip(EXPERT_TENSORS, mine))
        self.load_state_dict(local)
        if self._slots_R is not None and self.system not in PER_CALL:  # every rank has the full tensors
            self.replicas.load_from_full(state_dict["experts.gate_up_proj"], state_dict["experts.down_proj"],
                                         self.placement, self.rank)
            self._stale = False

    def _gather_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full expert tensors (of the weights or their gradients), in expert order, on every
        rank: from the owners, or for ``laer`` from every rank's slices."""
        if self.system == "laer":
            return dict(zip(EXPERT_TENSORS, sharding.gather_full(gate_up.detach(), down.detach(), self.group)))
        owned = [self.base_placement.owned(r) for r in range(self.world)]
        order = torch.tensor([e for o in owned for e in o], dtype=torch.long)
        out = {}
        for name, local in zip(EXPERT_TENSORS, (gate_up, down)):
            stacked = comm.all_gather(local.detach(), [len(o) for o in owned], self.group)
            out[name] = torch.empty_like(stacked)
            out[name][order] = stacked
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the world-size-1 layer's state dict, on every rank."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        sd.update(self._gather_experts(*(sd[name] for name in EXPERT_TENSORS)))
        return sd

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Collective: gradients of the world-size-1 layer fed with all ranks' tokens.

        Replicated parameters (router, shared expert): summed over ranks. Experts: from owners.
        """
        grads = {}
        for name, p in self.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = g if name in EXPERT_TENSORS else comm.all_reduce_sum(g.detach(), self.group)
        grads.update(self._gather_experts(*(grads[name] for name in EXPERT_TENSORS)))
        return grads

    # ---------------------------------------------------------------- training hooks
    @torch.no_grad()
    def update_router_bias(self, counts_E: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (sigmoid router), once per optimizer step, global counts."""
        self.router.update_bias(counts_E, rate)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """Every :class:`MoELayer` in ``model`` with its qualified name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
