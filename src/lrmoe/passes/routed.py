"""The routed experts as one autograd function: count exchange → plan → dispatch → grouped
experts → combine, and a hand-written backward with its own row plan.

The forward and backward exchange rows with separate split plans, so a backward may carry fewer
rows (LRMoE compaction) or send them to other copies than the forward did. Everything the
backward needs travels in the :class:`CallRecord` built for that call; nothing goes through the
module or through stats. The router gradient is exact for every pair: it needs only
⟨g_t, y_te⟩, with y kept at home (docs/design.md "What a dropped pair loses").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lrmoe import experts
from lrmoe.config import BackwardConfig
from lrmoe.memory.bytes import KEEP_X, KEEP_X_ACTS, MemoryMeter, nbytes
from lrmoe.parallel import comm, sharding
from lrmoe.parallel.comm import Group, WireCounter
from lrmoe.parallel.dispatch import (
    RowPlan,
    build_row_plan,
    kept_plan,
    restrict_to_kept,
    to_experts,
    to_home,
    to_home_with_norms,
    to_kept_experts,
)
from lrmoe.parallel.replicas import Replicas
from lrmoe.planning.planner import ADAM_STATES, CallPlan, LayerPlanner
from lrmoe.selection.selections import Selection, lrm_scores, select, select_in_strata, squared_norms
from lrmoe.selection.strata import Strata, plan_strata, strata_on
from lrmoe.systems import PlacementKind, SystemSpec


@dataclass(frozen=True)
class RoutedContext:
    """What the routed path uses of its layer; fixed for the layer's life."""

    planner: LayerPlanner
    replicas: Replicas
    group: Group
    rank: int
    backward: BackwardConfig

    @property
    def spec(self) -> SystemSpec:
        return self.planner.spec

    def wire(self) -> WireCounter:
        return WireCounter(node_of=self.planner.node_of)


@dataclass
class CallRecord:
    """One layer call, carried from its forward to its backward."""

    ctx: RoutedContext
    ids_TK: torch.Tensor
    training: bool  # a grad-enabled call: it updates the load and may be followed by a backward
    pending_placement_bytes: int = 0  # parameter bytes moved since the last training call
    generators: Callable[[], tuple[torch.Generator, torch.Generator]] | None = None  # per backward:
    # this rank's selection stream and the stream every rank draws alike
    publish: Callable[[dict, torch.Tensor, torch.Tensor | None], None] | None = None  # the backward's
    # stats, kept mask and weights of kept contributions
    stats: dict = field(default_factory=dict)
    plan: CallPlan | None = None
    rows: RowPlan | None = None
    forward_keep_P: torch.Tensor | None = None  # pairs a forward drop kept (None: all)
    meter: MemoryMeter | None = None
    saved: dict = field(default_factory=dict)


def _slot_weights(call: CallRecord, gate_up: torch.Tensor, down: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Weights of every local slot (owned experts, then replicas; sharded systems: the experts
    this call placed here, assembled from every rank's slices) and the parameter bytes the
    assembly sent."""
    ctx = call.ctx
    if ctx.spec.placement is PlacementKind.SHARDED:
        wire = ctx.wire()
        w_gu, w_down = sharding.assemble(gate_up.detach(), down.detach(), call.plan.placement, ctx.rank,
                                         ctx.group, wire)
        return w_gu, w_down, wire.sent
    if not len(ctx.replicas.experts):
        return gate_up, down, 0
    return torch.cat([gate_up, ctx.replicas.gate_up_proj]), torch.cat([down, ctx.replicas.down_proj]), 0


def _expert_forward_chunked(rows_RD, gate_up, down, counts_L, chunk: int, want_h_sq: bool):
    """Complete forward computed ``chunk`` rows at a time (activations dropped after each
    chunk): a budgeted expert side keeps nothing and never holds more than a chunk."""
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


def _plan(call: CallRecord, weights_TK: torch.Tensor, wire: WireCounter) -> None:
    """Count exchange (collective), the forward drop's selection if any, and the call plan."""
    ctx = call.ctx
    E = ctx.planner.config.num_experts
    ids_P = call.ids_TK.reshape(-1)
    counts_E = torch.bincount(ids_P, minlength=E).cpu()
    counts_SE = comm.all_gather(counts_E.view(1, E), [1] * ctx.planner.world, ctx.group, wire)
    forward_SE = None
    quota_E = ctx.planner.forward_quota(counts_SE)
    if quota_E is not None:  # kept: each expert's pairs of highest routing probability
        sel = select(weights_TK.detach().reshape(-1).to(torch.float64), ids_P, counts_SE, quota_E,
                     BackwardConfig("lrm"), ctx.group, wire)
        call.forward_keep_P, forward_SE = sel.keep_P, sel.kept_SE
    call.plan = ctx.planner.plan_call(counts_SE, forward_SE, call.training)
    call.stats.update(call.plan.stats)


def routed_forward(call: CallRecord, x_TD: torch.Tensor, weights_TK: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Complete forward of the routed experts (a forward drop removes its overflow first).

    Returns (out_TD, y_PD expert outputs per pair, h_sq_P ‖h‖² per pair or None): the last two
    stay at home for the backward (router gradient, LRM scores).
    """
    ctx, spec = call.ctx, call.ctx.spec
    t0 = time.perf_counter()
    T, K = call.ids_TK.shape
    wire = ctx.wire()
    _plan(call, weights_TK, wire)
    moved = 0
    if call.plan.fetch:  # this call's copies, fetched from their owners (collective)
        moved += ctx.replicas.refresh(gate_up.detach(), down.detach(), call.plan.placement, ctx.rank, ctx.group)
    rows = call.rows = build_row_plan(call.ids_TK.reshape(-1), call.plan.assignment, call.plan.placement, ctx.rank,
                                      keep_P=call.forward_keep_P)
    chunk = rows.recv_rows if call.plan.chunk_rows_R is None else call.plan.chunk_rows_R[ctx.rank]

    w_gu, w_down, assembled = _slot_weights(call, gate_up, down)
    moved += assembled
    if spec.placement is PlacementKind.SHARDED:  # slices and their gradients, assembled experts and theirs
        meter = MemoryMeter(2 * (nbytes(gate_up, down) + nbytes(w_gu, w_down)))
    else:  # every local copy and its gradient buffer, plus the owned weights' second copy inside
        # the concatenated slot weights when this rank holds replicas
        meter = MemoryMeter(2 * nbytes(w_gu, w_down) + (nbytes(gate_up, down) if w_gu is not gate_up else 0))
    rows_RD = to_experts(x_TD[rows.pair_idx // K], rows, ctx.group, wire, meter)
    want_h_sq = spec.selective
    acts = None
    if chunk < rows.recv_rows:
        y_RD, h_sq_R = _expert_forward_chunked(rows_RD, w_gu, w_down, rows.slot_counts, chunk, want_h_sq)
        meter.hold(y_RD, h_sq_R)
        meter.reach(chunk * 4 * w_down.shape[2] * y_RD.element_size())
    else:
        y_RD, acts = experts.expert_forward(rows_RD, w_gu, w_down, rows.slot_counts)
        meter.hold(y_RD, *acts.values())
        h_sq_R = squared_norms(acts["h"]) if want_h_sq else None
        meter.hold(h_sq_R)
    h_sq_P = None
    if want_h_sq:  # ‖h‖² of every pair goes home with y, for the LRM scores
        y_home_ND, h_sq_N = to_home_with_norms(y_RD, h_sq_R, rows, ctx.group, wire)
        h_sq_P = torch.empty(T * K, dtype=torch.float64, device=x_TD.device)
        h_sq_P[rows.pair_idx] = h_sq_N
        meter.drop(h_sq_R)
    else:
        y_home_ND = to_home(y_RD, rows, ctx.group, wire)
    meter.drop(y_RD)
    del y_RD

    # Pairs a plan does not carry (dropped by a capacity factor) contribute zero.
    full = len(rows.pair_idx) == T * K
    y_PD = (x_TD.new_empty if full else x_TD.new_zeros)(T * K, x_TD.shape[1])
    y_PD[rows.pair_idx] = y_home_ND
    out_TD = torch.bmm(weights_TK.unsqueeze(1), y_PD.view(T, K, x_TD.shape[1])).squeeze(1)

    # What the expert side keeps for the backward (docs/design.md "Recompute"): a full backward
    # keeps rows and activations, a recompute backward rows only, a compacting one what its plan
    # chose: nothing (home re-sends the x rows of kept pairs), x, or x and the activations.
    if w_gu is not gate_up:  # the concatenated slot weights serve the backward too (counted above)
        call.saved["slot_weights"] = (w_gu, w_down)
    keep = call.plan.keep if spec.compacts else None
    if acts is not None and (spec.saves_activations or keep == KEEP_X_ACTS):
        call.saved.update(rows_RD=rows_RD, acts=acts)
    else:
        if acts is not None:
            meter.drop(*acts.values())
        if spec.saves_rows or keep in (KEEP_X, KEEP_X_ACTS):
            call.saved["rows_RD"] = rows_RD
        else:
            meter.drop(rows_RD)
    del acts, rows_RD
    call.meter = meter
    call.stats.update(
        counts_E=call.plan.counts_SE.sum(0),
        recv_rows=rows.recv_rows,
        forward_pairs_computed=rows.recv_rows,
        fwd_a2a_bytes=wire.sent,
        fwd_a2a_recv_bytes=wire.received,
        **({"fwd_a2a_inter_bytes": wire.inter_sent} if wire.node_of else {}),
        home_bytes=nbytes(y_PD, weights_TK, call.ids_TK, rows.pair_idx, h_sq_P),
        peak_expert_side_bytes=meter.peak,  # the backward raises it to the whole call's peak
        placement_bytes=call.pending_placement_bytes + moved,
        optimizer_bytes=ADAM_STATES * nbytes(gate_up, down),
        fwd_ms=(time.perf_counter() - t0) * 1e3,
    )
    bound = ctx.planner.take_bound_optimizer_bytes() if call.training else None
    if bound is not None:  # modelled, not moved: see docs/systems.md
        call.stats["bound_optimizer_bytes"] = bound
    return out_TD, y_PD, h_sq_P


def _select(call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor,
            wire: WireCounter) -> tuple[Selection, Strata | None, torch.Tensor | None]:
    """LRM scores of this rank's pairs and the kept set within the plan's quotas. A local
    selection draws in strata (lrmoe.selection.strata) with no exchange and returns them and its kept
    mask over the forward's send order; the others are collective (None, None)."""
    ctx, plan = call.ctx, call.plan
    K = call.ids_TK.shape[1]
    g_sq_P = squared_norms(g_TD).repeat_interleave(K)
    scores_P = lrm_scores(weights_TK.reshape(-1), g_sq_P, h_sq_P)
    own, shared = call.generators()
    if not ctx.backward.local:
        return select(scores_P, call.ids_TK.reshape(-1), plan.counts_SE, plan.quota_E, ctx.backward, ctx.group,
                      wire, own, shared), None, None
    strata = strata_on(plan_strata(plan.assignment, plan.placement, plan.counts_SE, plan.quota_E, ctx.rank),
                       scores_P.device)
    send_N = call.rows.pair_idx  # every pair: a selective forward drops none
    keep_N, scale_N, nonfinite = select_in_strata(scores_P[send_N], strata.group_N, strata.share_G, ctx.backward, own)
    keep_P = torch.zeros_like(scores_P, dtype=torch.bool).index_put_((send_N,), keep_N)
    scale_P = None if scale_N is None else torch.zeros_like(scores_P).index_put_((send_N,), scale_N)
    return Selection(keep_P, strata.plan.kept_SE, plan.quota_E, scale_P, nonfinite), strata, keep_N


def _gather_kept(saved: dict, kept_rows: torch.Tensor | None, meter: MemoryMeter) -> None:
    """Keep-x backward: the kept rows of the saved x (and activations) gathered slot-major, each
    full tensor dropped after its gather (``kept_rows`` None: every row kept, nothing to do)."""
    if kept_rows is None:
        return
    idx = kept_rows.to(saved["rows_RD"].device)
    full = saved["rows_RD"]
    saved["rows_RD"] = full[idx]
    meter.hold(saved["rows_RD"])
    meter.drop(full)
    acts = saved.get("acts")
    for k in () if acts is None else tuple(acts):
        full = acts[k]
        acts[k] = full[idx]
        meter.hold(acts[k])
        meter.drop(full)
    del full


def routed_backward(
    call: CallRecord, g_TD: torch.Tensor, x_TD: torch.Tensor, weights_TK: torch.Tensor, y_PD: torch.Tensor,
    h_sq_P: torch.Tensor | None, gate_up: torch.Tensor, down: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the routed experts. Returns (dx_TD, dweights_TK, dgate_up, ddown).

    Full-backward systems reuse the forward's row plan; ``masked`` too, with the rows of
    dropped pairs zeroed. A compacting backward whose expert side kept nothing builds a row
    plan over the kept pairs only (spread min-peak over copies within the plan's kept
    capacities) and re-sends their x rows; one that kept x (and activations) restricts the
    forward's plan to the kept pairs, so each is computed where its x lives (no re-spread over
    replicas: the trade-off for sending dy alone). Replica weight gradients are reduced to
    their owners.
    """
    ctx, spec, meter, saved, plan = call.ctx, call.ctx.spec, call.meter, call.saved, call.plan
    t0 = time.perf_counter()
    T, K = call.ids_TK.shape
    ids_P = call.ids_TK.reshape(-1)
    wire = ctx.wire()
    g_TD = g_TD.contiguous()

    # Router gradient, exact for every pair: d out_t / d w_tk = ⟨g_t, y_tk⟩.
    dweights_TK = torch.bmm(y_PD.view(T, K, x_TD.shape[1]), g_TD.unsqueeze(-1)).squeeze(-1)

    t_select = time.perf_counter()  # scoring, selection exchange and packing
    # Per-row factor of dy = factor · g_t: the routing weight, times 1/p for sampled pairs,
    # times 0 for pairs the masked ablation drops.
    factor_P = weights_TK.reshape(-1)
    rows, scale_P = call.rows, None
    kept_rows = kept_pos_N = None  # keep-x: kept rows among the saved ones; their positions sent with dy
    if spec.selective:
        sel, strata, keep_N = _select(call, g_TD, weights_TK, h_sq_P, wire)
        scale_P = sel.scale_P
        if sel.scale_P is not None:
            factor_P = factor_P * sel.scale_P.to(factor_P.dtype)
        if spec.compacts and "rows_RD" in saved:  # kept pairs computed where their x was kept
            if strata is not None:  # kept positions ride with dy
                rows, kept_pos_N = kept_plan(call.rows, strata, keep_N)
            else:  # the expert sides are told which rows are kept (collective)
                rows, kept_rows = restrict_to_kept(rows, sel.keep_P, ctx.group, wire)
        elif spec.compacts:
            assignment = ctx.planner.assign(sel.kept_SE, plan.placement, plan.kept_capacity_R)
            rows = build_row_plan(ids_P, assignment, plan.placement, ctx.rank, keep_P=sel.keep_P)
        else:
            factor_P = factor_P * sel.keep_P
        keep_TK, quota_E, kept_E = sel.keep_P.view(T, K), sel.quota_E, sel.kept_SE.sum(0)
        call.stats["nonfinite"] = sel.nonfinite
    else:
        kept_E = quota_E = plan.forward_SE.sum(0)
        keep_P = call.forward_keep_P
        keep_TK = torch.ones_like(call.ids_TK, dtype=torch.bool) if keep_P is None else keep_P.view(T, K)
    tok_N = rows.pair_idx // K
    dy_ND = g_TD[tok_N].mul_(factor_P[rows.pair_idx].unsqueeze(1))
    x_ND = x_TD[tok_N] if "rows_RD" not in saved else None
    select_ms = (time.perf_counter() - t_select) * 1e3

    if kept_pos_N is None:
        dy_RD = to_experts(dy_ND, rows, ctx.group, wire, meter)
    else:
        dy_RD, kept_rows = to_kept_experts(dy_ND, kept_pos_N, rows, call.rows, ctx.group, wire, meter)
    if "rows_RD" in saved:
        _gather_kept(saved, kept_rows, meter)
    rows_RD = saved.pop("rows_RD") if x_ND is None else to_experts(x_ND, rows, ctx.group, wire, meter)
    del dy_ND, x_ND
    acts = saved.pop("acts", None)
    # The expert backward works in place (dh over h, d up over silu, d gate over gate, dx over
    # dy), so its peak is the four (R, F) activations beside dy and x: already counted when
    # saved, recomputed otherwise.
    if acts is None:
        meter.reach(4 * dy_RD.shape[0] * down.shape[2] * dy_RD.element_size())
    else:
        meter.drop(*acts.values())
    bwd_rows = dy_RD.shape[0]
    w_gu, w_down = saved.pop("slot_weights", (gate_up, down))
    dx_RD, dgate_up, ddown = experts.expert_backward(dy_RD, rows_RD, w_gu, w_down, rows.slot_counts, acts)
    del rows_RD, dy_RD
    dx_home_ND = to_home(dx_RD, rows, ctx.group, wire)
    dx_TD = torch.zeros_like(x_TD)
    dx_TD.index_add_(0, tok_N, dx_home_ND)
    L = gate_up.shape[0]
    if spec.placement is PlacementKind.SHARDED:  # slot gradients summed into the slices' owners (collective)
        meter.hold(dgate_up, ddown)  # the send buffer
        dgate_up, ddown = sharding.reduce_grads(dgate_up, ddown, plan.placement, ctx.rank, ctx.group, wire, L)
    elif plan.placement.num_copies > plan.placement.num_experts:  # replica gradients go to owners (collective)
        meter.hold(dgate_up[L:], ddown[L:])  # the send buffer
        add_gu, add_down = ctx.replicas.reduce_grads(dgate_up[L:], ddown[L:], plan.placement, ctx.rank,
                                                     ctx.group, wire)
        dgate_up, ddown = dgate_up[:L] + add_gu, ddown[:L] + add_down

    call.stats.update(
        quota_E=quota_E,
        kept_E=kept_E,
        bwd_gemm_rows=bwd_rows,
        select_ms=select_ms if spec.selective else 0.0,
        bwd_a2a_bytes=wire.sent,
        bwd_a2a_recv_bytes=wire.received,
        **({"bwd_a2a_inter_bytes": wire.inter_sent} if wire.node_of else {}),
        peak_expert_side_bytes=meter.peak,
        bwd_ms=(time.perf_counter() - t0) * 1e3,
    )
    if x_TD.is_cuda:  # the allocator's view, for the whole process since the last reset
        call.stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(x_TD.device)
    if call.publish is not None:  # a forward-only call in between must not hide this call's stats
        call.publish(call.stats, keep_TK, None if scale_P is None else scale_P.view(T, K))
    return dx_TD, dweights_TK, dgate_up, ddown


class RoutedExperts(torch.autograd.Function):
    """out_TD = Σ_k w_tk · expert_{ids_tk}(x_t) with the backward of :func:`routed_backward`."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, gate_up, down, call: CallRecord):
        out_TD, y_PD, h_sq_P = routed_forward(call, x_TD, weights_TK, gate_up, down)
        ctx.call = call
        ctx.save_for_backward(x_TD, weights_TK, y_PD, h_sq_P, gate_up, down)
        return out_TD

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, weights_TK, y_PD, h_sq_P, gate_up, down = ctx.saved_tensors
        grads = routed_backward(ctx.call, g_TD, x_TD, weights_TK, y_PD, h_sq_P, gate_up, down)
        return (*grads, None)
