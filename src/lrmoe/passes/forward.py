"""The routed experts' forward, in stages: plan → fetch weights → dispatch → compute → combine →
save, the backward planned meanwhile. The forward is complete (a forward drop removes its
overflow first); what the backward needs is left in the call's record.

The plan stage waits only for what the forward needs (placement, assignment, chunks); the
backward's part of the plan (quotas, keep mode, strata, kept assignment:
:mod:`lrmoe.planning.backward_plan`) is planned while rows travel: the outputs home, once the
forward's rows and expert work have been issued (on a GPU the host plans while the device
computes), or, on a rank whose chunked forward must know whether to keep gate/up, the rows to
the experts (:func:`plans_backward_first`).
"""

from __future__ import annotations

import time

import torch

from lrmoe import experts
from lrmoe.config import BackwardConfig
from lrmoe.memory.bytes import KEEP_X_ACTS, KEEP_X_GATE_UP, RowSplit, kept_to_backward, nbytes
from lrmoe.parallel.comm import Channel
from lrmoe.parallel.dispatch import Message, to_experts, to_home, to_home_with_norms
from lrmoe.parallel.rows import row_layout
from lrmoe.passes import row_paths
from lrmoe.passes.by_row import forward_by_row
from lrmoe.passes.control import control_means
from lrmoe.passes.record import CallRecord
from lrmoe.passes.rounds import forward_in_rounds
from lrmoe.passes.weights import SlotWeights, fetch_weights
from lrmoe.planning.cost import ADAM_STATES
from lrmoe.selection.global_selection import nonfinite_counts, select
from lrmoe.selection.scores import score_norms


def routed_forward(call: CallRecord, x_TD: torch.Tensor, weights_TK: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Complete forward of the routed experts. Returns (out_TD, y_PD expert outputs per pair,
    h_sq_P ‖h‖² per pair or None): the last two stay at home for the backward (router gradient,
    LRM scores)."""
    clock = call.clock
    t0 = clock.start()
    channel = call.layer.channel()
    plan(call, weights_TK, channel)
    clock.lap("fwd_plan")
    weights = fetch_weights(call, gate_up, down, channel)
    clock.lap("fwd_fetch")
    if call.plan.rounds_R is not None:  # every exchange in rounds, nothing kept (a call its cap leaves no other way)
        lay_out(call)
        y_home_ND, h_sq_N = forward_in_rounds(call, x_TD, weights.gate_up, weights.down, channel)
        clock.lap("fwd_compute")
        out_TD, y_PD, h_sq_P = outputs(call, x_TD, weights_TK, y_home_ND, h_sq_N)
        clock.lap("fwd_combine")
        plan_backward(call)
        clock.lap("fwd_plan_backward")
        save(call, None, None, weights, gate_up)
    else:
        # the backward's plan while rows travel: home (on CUDA, while the device still computes
        # what was just issued), before save, which keeps what its keep mode says; or, where the
        # compute must know it (plans_backward_first), to the experts
        first = plans_backward_first(call)
        if first:
            call.meanwhile(channel, "fwd_plan_backward", lambda: plan_backward(call))
        rows_RD = dispatch(call, x_TD, weights_TK, channel)
        channel.flush()  # (where no row crossed, no exchange did the plan: now)
        clock.lap("fwd_dispatch")
        y_RD, norms, acts = compute(call, rows_RD, weights)
        clock.lap("fwd_compute")
        if not first:
            call.meanwhile(channel, "fwd_plan_backward", lambda: plan_backward(call))
        out_TD, y_PD, h_sq_P = combine(call, x_TD, weights_TK, y_RD, norms, channel)
        channel.flush()
        clock.lap("fwd_combine")
        del norms, y_RD
        save(call, rows_RD, acts, weights, gate_up)
        del acts, rows_RD
    clock.lap("fwd_save")
    _report(call, channel, y_PD, weights_TK, h_sq_P, nbytes(gate_up, down), weights.moved_bytes, t0)
    return out_TD, y_PD, h_sq_P


def plan(call: CallRecord, weights_TK: torch.Tensor, channel: Channel) -> None:
    """Count exchange (collective), the forward drop's selection if any, and the forward's plan."""
    planner = call.layer.planner
    E = planner.config.num_experts
    ids_P = call.ids_TK.reshape(-1)
    counts_E = torch.bincount(ids_P, minlength=E).cpu()
    parts = [counts_E]
    drop = planner.spec.forward_drop  # kept: each expert's pairs of highest routing probability
    if drop:  # the keys' non-finite counts, which its selection needs from every rank, travel with the counts
        keys_P = weights_TK.detach().reshape(-1).to(torch.float64)
        parts.append(nonfinite_counts(torch.isfinite(keys_P), ids_P, E))
    noise_at = sum(len(p) for p in parts)
    noise = planner.noise  # its sums of the last backward travel with the counts, as their float64 bits
    if noise is not None:
        parts.append(noise.pending().view(torch.int64))
    gathered = channel.all_gather(torch.cat(parts).view(1, -1), [1] * planner.world)
    counts_SE = gathered[:, :E]
    if noise is not None:
        noise.update(gathered[:, noise_at:].contiguous().view(torch.float64).sum(0))
    forward_SE = None
    if drop:
        sel = select(keys_P, ids_P, counts_SE, planner.forward_quota(counts_SE), BackwardConfig("lrm"), channel,
                     nonfinite_SE=gathered[:, E:noise_at])
        call.forward_keep_P, forward_SE = sel.keep_P, sel.kept_SE
    call.plan = planner.plan_forward(counts_SE, forward_SE, call.training)
    call.stats.figures = call.plan.figures


def plans_backward_first(call: CallRecord) -> bool:
    """Whether this rank plans the backward before its compute: a compacting training call whose
    forward the plan chunks here, which keeping gate/up computes otherwise (every row's gate/up
    held, silu, h and y in chunks). A rank computing every row at once has all four activations
    and keeps what the plan then says; the plan is the same on every rank either way."""
    plan, rank = call.plan, call.layer.rank
    return (call.training and call.layer.spec.compacts and plan.chunk_rows_R is not None
            and plan.chunk_rows_R[rank] < int(plan.assignment.rows_R()[rank]))


def plan_backward(call: CallRecord) -> None:
    """A training call's backward plan (pure, from the forward's: the planner's state is as the
    plan stage left it), merged into the record's plan, and the backward's selection and row
    path chosen from it. Before ``compute`` and ``save``, which compute and keep what the plan's
    keep mode says."""
    if not call.training:
        return
    layer = call.layer
    call.plan = call.plan.with_backward(layer.planner.plan_backward(call.plan), layer.spec)
    layer.planner.kept_activations = call.plan.keep == KEEP_X_ACTS
    noise = layer.planner.noise
    if noise is not None:  # the ratio the quotas took (the plan's figures say whether memory kept fewer)
        stats = call.stats
        stats.trim_ratio, stats.variance_ratio, stats.minibatch_ratio = noise.ratio, noise.variance_ratio, \
            noise.minibatch_ratio
    call.stats.figures = call.plan.figures
    call.selector, call.path = row_paths.choose(layer.spec, call.plan.keep, layer.backward.local)


def lay_out(call: CallRecord, weights_TK: torch.Tensor | None = None) -> None:
    """The forward's row layout (:func:`~lrmoe.parallel.rows.row_layout`), on the call. A
    compacting backward's pairs in the order of their routing weights (``weights_TK``), which
    the pairs it keeps follow, so its compaction in place moves fewer rows; only where the
    layer's last backward kept the activations (its keep mode is planned after this layout, and
    one that kept x alone gathers it, in any order: the sort and the home side's gathers out of
    token order would be for nothing)."""
    layer = call.layer
    ordered = weights_TK is not None and layer.spec.compacts and layer.planner.kept_activations
    key_P = weights_TK.detach().reshape(-1) if ordered else None
    call.rows = row_layout(call.ids_TK.reshape(-1), call.plan.assignment, call.plan.placement, call.layer.rank,
                           keep_P=call.forward_keep_P, order_key_P=key_P)


def dispatch(call: CallRecord, x_TD: torch.Tensor, weights_TK: torch.Tensor, channel: Channel) -> torch.Tensor:
    """The forward's row layout, and this rank's x rows sent to the copies that compute them
    (collective); returns the rows this rank's expert side received, slot-major."""
    lay_out(call, weights_TK)
    return to_experts(x_TD[call.rows.pair_idx // call.ids_TK.shape[1]], call.rows, channel)


def compute(call: CallRecord, rows_RD: torch.Tensor, weights: SlotWeights
            ) -> tuple[torch.Tensor, Message | None, dict[str, torch.Tensor] | None]:
    """The grouped SwiGLU experts over every received row, all at once or, where the plan chunks
    this rank's forward, ``chunk`` rows at a time (activations dropped after each chunk: a
    budgeted expert side never holds more than a chunk), or by the row where the plan splits
    this rank's rows (:mod:`lrmoe.passes.by_row`: its parts kept on the record), or, keeping
    gate/up, every row's gate/up products first and silu, h and y a chunk at a time. Returns (y,
    for a selective backward the return message holding y and ‖h‖² per row side by side, the
    activations — gate and up alone where those are kept — or None when chunked)."""
    rows, meter = call.rows, call.meter
    chunk = rows.recv_rows if call.plan.chunk_rows_R is None else call.plan.chunk_rows_R[call.layer.rank]
    R, D = rows_RD.shape
    selective = call.layer.spec.selective
    norms = Message.empty(R, D, rows_RD, torch.float64) if selective else None  # y then written into it
    h_sq_R = norms.extra if norms is not None else (
        torch.empty(R, dtype=torch.float64, device=rows_RD.device) if selective else None)
    split = None if call.plan.split_R is None else call.plan.split_R[call.layer.rank]
    h_mean_LF = None
    backward = call.layer.backward
    if selective and backward.control_variate:  # the variate's means, before the scores need h̄
        call.saved.control = control_means(rows_RD, weights.gate_up, rows.slot_counts)
        if backward.variate_scores == "residuals":
            h_mean_LF = call.saved.control.h_LF
    gate_up = call.plan.keep == KEEP_X_GATE_UP
    if split is not None or chunk < R or gate_up:  # by the row, x alone in chunks, or gate/up kept
        y_RD = rows_RD.new_empty(R, D) if norms is None else norms.rows
        meter.hold(y_RD, h_sq_R)
        kept = forward_by_row(rows_RD, weights.gate_up, weights.down, rows.slot_counts,
                              split or RowSplit(0, R if gate_up else 0), chunk, y_RD, h_sq_R, meter, h_mean_LF)
        if split is not None:  # (its backward goes part by part)
            call.saved.by_row = kept
        acts = dict(zip(("gate", "up"), kept.gate_up)) if gate_up else None
    else:  # (y allocated by the GEMM where it has no message: on CUDA the fused kernel's own output)
        y_RD, acts = experts.expert_forward(rows_RD, weights.gate_up, weights.down, rows.slot_counts,
                                            y_out=None if norms is None else norms.rows)
        meter.hold(y_RD, *acts.values(), h_sq_R)
        if selective:
            h_sq_R.copy_(score_norms(acts["h"], rows.slot_counts, h_mean_LF))
    if selective and norms is None:  # a row's bytes would misalign the value: y and ‖h‖² copied into one
        norms = Message.of(y_RD, h_sq_R)
    return y_RD, norms, acts


def combine(call: CallRecord, x_TD: torch.Tensor, weights_TK: torch.Tensor, y_RD: torch.Tensor,
            norms: Message | None, channel: Channel
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Expert outputs home (with ‖h‖² for the LRM scores, one message) and the weighted sum per
    token. Pairs a plan does not carry (dropped by a capacity factor) contribute zero."""
    rows, meter = call.rows, call.meter
    h_sq_N = None
    if norms is not None:
        y_home_ND, h_sq_N = to_home_with_norms(norms, rows, channel)
        meter.drop(norms.extra)
    else:
        y_home_ND = to_home(y_RD, rows, channel)
    meter.drop(y_RD)
    return outputs(call, x_TD, weights_TK, y_home_ND, h_sq_N)


def outputs(call: CallRecord, x_TD: torch.Tensor, weights_TK: torch.Tensor, y_home_ND: torch.Tensor,
            h_sq_N: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out_TD, y_PD, h_sq_P) from the expert outputs home in the layout's send order: y per
    pair, the weighted sum per token, and ‖h‖² per pair where the backward is selective."""
    rows = call.rows
    T, K = call.ids_TK.shape
    h_sq_P = None
    if h_sq_N is not None:
        h_sq_P = torch.empty(T * K, dtype=torch.float64, device=x_TD.device)
        h_sq_P[rows.pair_idx] = h_sq_N
    full = len(rows.pair_idx) == T * K
    y_PD = (x_TD.new_empty if full else x_TD.new_zeros)(T * K, x_TD.shape[1])
    y_PD[rows.pair_idx] = y_home_ND
    out_TD = torch.bmm(weights_TK.unsqueeze(1), y_PD.view(T, K, x_TD.shape[1])).squeeze(1)
    return out_TD, y_PD, h_sq_P


def save(call: CallRecord, rows_RD: torch.Tensor, acts: dict[str, torch.Tensor] | None, weights: SlotWeights,
         gate_up: torch.Tensor) -> None:
    """What the expert side keeps for the backward (:func:`lrmoe.memory.bytes.kept_to_backward`);
    the rest is freed. Concatenated or assembled slot weights serve the backward too."""
    meter = call.meter
    if weights.gate_up is not gate_up:
        call.saved.slot_weights = (weights.gate_up, weights.down)
    kept = kept_to_backward(call.layer.spec, call.plan.keep, chunked=acts is None)
    if kept.gate_up and "silu" in acts:  # a forward of every row at once: silu and h go
        meter.drop(acts.pop("silu"), acts.pop("h"))
    if kept.acts or kept.gate_up:
        call.saved.rows_RD, call.saved.acts = rows_RD, acts
        return
    if acts is not None:
        meter.drop(*acts.values())
    if kept.rows:
        call.saved.rows_RD = rows_RD
    else:
        meter.drop(rows_RD)


def _report(call: CallRecord, channel: Channel, y_PD: torch.Tensor, weights_TK: torch.Tensor,
            h_sq_P: torch.Tensor | None, owned_bytes: int, moved: int, t0: float) -> None:
    stats, rows, wire = call.stats, call.rows, channel.wire
    stats.counts_E = call.plan.counts_SE.sum(0)
    stats.recv_rows = stats.forward_pairs_computed = rows.recv_rows
    stats.fwd_a2a_bytes, stats.fwd_a2a_recv_bytes = wire.sent, wire.received
    stats.fwd_a2a_inter_bytes = wire.inter_sent if wire.node_of else None
    stats.home_bytes = nbytes(y_PD, weights_TK, call.ids_TK, rows.pair_idx, h_sq_P)
    stats.peak_expert_side_bytes = call.meter.peak  # the backward raises it to the whole call's peak
    stats.placement_bytes = call.pending_placement_bytes + moved
    stats.optimizer_bytes = ADAM_STATES * owned_bytes
    stats.fwd_ms = (time.perf_counter() - t0) * 1e3
    stats.stage_ms = dict(call.clock.ms)
    if call.training:  # modelled, not moved: see docs/systems.md
        stats.bound_optimizer_bytes = call.layer.planner.take_bound_optimizer_bytes()
