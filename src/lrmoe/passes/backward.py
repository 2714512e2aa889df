"""The routed experts' backward, in stages: select → plan rows → dispatch → compute → return
(the row path's dispatch, compute and return: :mod:`lrmoe.passes.row_paths`).
Which selection and row path a call takes was chosen once from its plan
(:func:`lrmoe.passes.row_paths.choose`); everything else it needs is in the call's record.

The router gradient is exact for every pair: it needs only ⟨g_t, y_te⟩, with y kept at home
(docs/design.md "What a dropped pair loses"). Replica weight gradients are reduced to their
owners; sharded systems' slot gradients to the slices' owners.
"""

from __future__ import annotations

import time

import torch

from lrmoe import experts
from lrmoe.parallel import sharding
from lrmoe.parallel.comm import Channel
from lrmoe.parallel.replicas import PendingGrads
from lrmoe.passes.backward_rows import BackwardRows, DyRows, Kept
from lrmoe.passes.control import add_control, dropped_mass
from lrmoe.passes.record import CallRecord
from lrmoe.systems import PlacementKind


def routed_backward(call: CallRecord, g_TD: torch.Tensor, x_TD: torch.Tensor, weights_TK: torch.Tensor,
                    y_PD: torch.Tensor, h_sq_P: torch.Tensor | None, gate_up: torch.Tensor, down: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the routed experts. Returns (dx_TD, dweights_TK, dgate_up, ddown)."""
    clock = call.clock
    t0 = clock.start()
    T, K = call.ids_TK.shape
    channel = call.layer.channel()
    channel.memory = call.meter
    g_TD = g_TD.contiguous()
    # Router gradient, exact for every pair: d out_t / d w_tk = ⟨g_t, y_tk⟩, T (K×D)·(D×1)
    # products. A bmm writes only the T×K result; vecdot forms the T×K×D products first.
    dweights_TK = torch.bmm(y_PD.view(T, K, x_TD.shape[1]), g_TD.unsqueeze(2)).squeeze(2)
    clock.lap("bwd_router")

    t_select = time.perf_counter()  # scoring, selection (and its exchange), the kept rows' plan
    kept = call.selector.select(call, g_TD, weights_TK, h_sq_P, channel)
    rows = call.path.rows(call, kept, channel)
    factor_P = call.path.factor(weights_TK.reshape(-1), kept)
    control, c_LD = call.saved.control, None
    if control is not None and kept.keep_P is not None:  # (every rank alike: both are the plan's)
        c_LD = dropped_mass(call, g_TD, weights_TK, kept, channel)
    select_ms = (time.perf_counter() - t_select) * 1e3
    clock.lap("bwd_select")

    dy_RD, rows_RD = call.path.dispatch(call, DyRows(g_TD, factor_P, K), x_TD, rows, channel)
    clock.lap("bwd_dispatch")  # (the saved rows' compaction, inside it, laps apart)
    down_slots = (call.saved.slot_weights or (gate_up, down))[1]
    dx_RD, dgate_up, ddown = call.path.compute(call, dy_RD, rows_RD, rows, gate_up, down, channel)
    if c_LD is not None:  # the dropped pairs' share, from the variate's means
        add_control(dgate_up, ddown, down_slots, control, c_LD)
    clock.lap("bwd_compute")
    del rows_RD, dy_RD
    dx_TD, dgate_up, ddown = give_back(call, dx_RD, dgate_up, ddown, x_TD, rows, (gate_up, down), channel)
    channel.flush()
    _report(call, kept, select_ms, rows.layout.recv_rows, channel, x_TD, t0)
    return dx_TD, dweights_TK, dgate_up, ddown


def give_back(call: CallRecord, dx_RD: torch.Tensor, dgate_up: experts.Slots, ddown: experts.Slots,
              x_TD: torch.Tensor, rows: BackwardRows, params: tuple[torch.Tensor, torch.Tensor], channel: Channel
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dx rows home and summed per token; slot weight gradients reduced to the weights' owners
    (collectives; with the layer's ``overlap_replica_grads``, the replicas' share is added to
    the owned ``params``' ``.grad`` when the backward pass ends). Returns (dx_TD, gradients of
    the owned gate_up and down)."""
    layer, plan, meter = call.layer, call.plan, call.meter
    owned = params[0].shape[0]
    dx_home_ND, pairs_N = call.path.home(call, dx_RD, rows, channel)
    dx_TD = torch.zeros_like(x_TD)
    dx_TD.index_add_(0, pairs_N // call.ids_TK.shape[1], dx_home_ND)
    call.clock.lap("bwd_home")
    deferred = False  # the replicas' share reaches the owned gradients when the backward pass ends
    if layer.spec.placement is PlacementKind.SHARDED:  # slot gradients summed into the slices' owners
        meter.hold(dgate_up, ddown)  # the send buffer
        dgate_up, ddown = sharding.reduce_grads(dgate_up, ddown, plan.placement, layer.rank, channel.group,
                                                channel.wire, owned)
    elif plan.placement.num_copies > plan.placement.num_experts:  # replica gradients go to owners
        (own_gu, rep_gu), (own_down, rep_down) = _by_set(dgate_up, owned), _by_set(ddown, owned)
        meter.hold(rep_gu, rep_down)  # the send buffer
        pending = layer.replicas.start_reduce_grads(rep_gu, rep_down, plan.placement, layer.rank, channel.group,
                                                    channel.wire)
        deferred = call.overlap_grads
        if deferred:
            _finish_at_backward_end(call, pending, params)
        else:
            pending.add_into(own_gu, own_down)
        dgate_up, ddown = own_gu, own_down
    if layer.planner.noise is not None and not deferred:
        layer.planner.noise.add_gradient(ddown)  # the owned experts' sampled gradient of this call
    call.clock.lap("bwd_reduce_grads")
    return dx_TD, dgate_up, ddown


def _finish_at_backward_end(call: CallRecord, pending: PendingGrads, params: tuple[torch.Tensor, torch.Tensor]
                            ) -> None:
    """The replicas' gradients reach the owned experts' ``.grad`` when the backward pass ends
    (an autograd-engine callback, as DDP finishes its buckets): the exchange overlaps the rest
    of the backward. The wait left then is this call's MoE time too (``bwd_reduce_grads``,
    ``bwd_ms``). Only for ``.backward()``: ``torch.autograd.grad`` would return the owned
    gradients without the replicas' share, hence the layer's opt-in."""
    stats = call.stats

    noise = call.layer.planner.noise

    def finish() -> None:
        t0 = time.perf_counter()
        pending.add_into(*(p.grad if p.requires_grad else None for p in params))
        if noise is not None and params[1].grad is not None:
            noise.add_gradient(params[1].grad)  # owned and replicas' shares: the call's whole gradient
        ms = (time.perf_counter() - t0) * 1e3
        stats.bwd_ms += ms
        stats.stage_ms["bwd_reduce_grads"] = stats.stage_ms.get("bwd_reduce_grads", 0.0) + ms

    torch.autograd.Variable._execution_engine.queue_callback(finish)


def _by_set(grad: experts.Slots, owned: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned experts' gradients, replicas' gradients): the two sets, or one tensor's slots split."""
    return grad if isinstance(grad, tuple) else (grad[:owned], grad[owned:])


def _report(call: CallRecord, kept: Kept, select_ms: float, bwd_rows: int, channel: Channel, x_TD: torch.Tensor,
            t0: float) -> None:
    """The backward's figures, and the kept set, on the call's record."""
    stats, wire, spec = call.stats, channel.wire, call.layer.spec
    T, K = call.ids_TK.shape
    if spec.selective:
        stats.nonfinite = kept.nonfinite
    stats.quota_E, stats.kept_E = kept.quota_E, kept.kept_E
    stats.bwd_gemm_rows = bwd_rows
    stats.select_ms = select_ms if spec.selective else 0.0
    stats.bwd_a2a_bytes, stats.bwd_a2a_recv_bytes = wire.sent, wire.received
    stats.bwd_a2a_inter_bytes = wire.inter_sent if wire.node_of else None
    stats.peak_expert_side_bytes = call.meter.peak
    stats.bwd_ms = (time.perf_counter() - t0) * 1e3
    stats.stage_ms = dict(call.clock.ms)
    if x_TD.is_cuda:  # the allocator's view, for the whole process since the last reset
        stats.cuda_max_memory_allocated = torch.cuda.max_memory_allocated(x_TD.device)
    call.kept_TK = torch.ones_like(call.ids_TK, dtype=torch.bool) if kept.keep_P is None else kept.keep_P.view(T, K)
    call.scale_TK = None if kept.scale_P is None else kept.scale_P.view(T, K)
    if call.log is not None:
        call.log.finished_backward(call)
