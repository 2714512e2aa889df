"""The routed experts of a call whose exchanges run in rounds (:mod:`lrmoe.parallel.rounds`):
nothing is kept from the forward to the backward, and each pass moves its rows a round at a
time, so an expert side holds its copies and one round's rows, never a whole exchange. An exact
call runs both passes so; lrmoe its forward, where its controller finds no other way, its
backward then re-sending the kept pairs' x (:class:`~lrmoe.passes.row_paths.ResentRows`).

Forward round: x rows in, sorted by slot, the grouped SwiGLU experts, y (and, selective, ‖h‖²
beside it in one message) sorted back and home.
Backward round: x (re-sent from home) and dy in one message, sorted by slot, the expert backward
recomputing gate/up/h with the weight gradients added over rounds, dx sorted back and home. The
meter follows each round's buffers in the order they live
(:meth:`~lrmoe.memory.bytes.ByteModel.round_forward`, :meth:`~lrmoe.memory.bytes.ByteModel.round_backward`).
"""

from __future__ import annotations

import torch

from lrmoe import experts
from lrmoe.memory.bytes import H_SQ_BYTES
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Channel
from lrmoe.parallel.dispatch import Message
from lrmoe.parallel.rounds import Round, Rounds, plan_rounds
from lrmoe.passes.record import CallRecord
from lrmoe.selection.scores import squared_norms


def _ffn_dim(down: experts.Slots) -> int:
    return (down if isinstance(down, torch.Tensor) else down[0]).shape[2]


def _received(call: CallRecord, rounds: Rounds, rnd: Round, send_NX: torch.Tensor, channel: Channel
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this round's rows received, the order sorting them by slot, rows per slot); the received
    buffer is on the meter."""
    recv_RX = channel.all_to_all(rnd.gather(send_NX), rnd.send_splits, rnd.recv_splits)
    call.meter.hold(recv_RX)
    order_R, counts_L = rounds.by_slot(rnd.recv_window)
    return recv_RX, comm.to_device(order_R, recv_RX.device), counts_L


def _sent_back(call: CallRecord, rnd: Round, out_RD: torch.Tensor, order_R: torch.Tensor, into_ND: torch.Tensor,
               channel: Channel) -> None:
    """Slot-sorted results put back in received order and sent home, into ``into_ND``."""
    back_RD = torch.empty_like(out_RD)
    back_RD[order_R] = out_RD
    call.meter.hold(back_RD)
    call.meter.drop(out_RD)
    rnd.scatter(channel.all_to_all(back_RD, rnd.recv_splits, rnd.send_splits), into_ND)
    call.meter.drop(back_RD)


def forward_in_rounds(call: CallRecord, x_TD: torch.Tensor, gate_up: experts.Slots, down: experts.Slots,
                      channel: Channel) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the forward's expert outputs, home, in the forward layout's send order; for a selective
    system each row's ‖h‖², the LRM score's expert-side factor, which came home beside y in
    the same messages, else None). Collective: every rank runs every round. Leaves the rounds
    on the call for its backward."""
    rows, meter, K = call.rows, call.meter, call.ids_TK.shape[1]
    rounds = call.rounds = plan_rounds(call.plan.assignment.rows_SR(), call.plan.rounds_R, rows, call.layer.rank)
    x_ND = x_TD[rows.pair_idx // K]
    D, norms = x_ND.shape[1], call.layer.spec.selective
    home_NX = x_ND.new_empty(len(x_ND), D + (H_SQ_BYTES // x_ND.element_size() if norms else 0))
    for rnd in rounds:
        recv_RD, order_R, counts_L = _received(call, rounds, rnd, x_ND, channel)
        x_RD = recv_RD[order_R]
        meter.hold(x_RD)
        meter.drop(recv_RD)
        del recv_RD
        message = Message.empty(len(x_RD), D, x_RD, torch.float64) if norms else None
        y_RD, acts = experts.expert_forward(x_RD, gate_up, down, counts_L, None if message is None else message.rows)
        if norms and message is None:  # a row's bytes would misalign the value: y copied beside it
            message = Message.of(y_RD, squared_norms(acts["h"]))
        elif norms:
            message.extra.copy_(squared_norms(acts["h"]))
        out_RX = y_RD if message is None else message.buffer_NX
        meter.hold(out_RX, *acts.values())
        meter.drop(x_RD, *acts.values())
        del x_RD, acts, y_RD
        _sent_back(call, rnd, out_RX, order_R, home_NX, channel)
    call.stats.exchange_rounds = len(rounds)
    return Message.split(home_NX, D, torch.float64) if norms else (home_NX, None)


def backward_in_rounds(call: CallRecord, dy_ND: torch.Tensor, x_ND: torch.Tensor, gate_up: experts.Slots,
                       down: experts.Slots, channel: Channel) -> tuple[torch.Tensor, experts.Slots, experts.Slots]:
    """(dx rows home in the forward layout's send order, the slots' weight gradients), x re-sent
    beside dy in the forward's rounds (collective)."""
    meter, rounds, D = call.meter, call.rounds, x_ND.shape[1]
    grads = experts.zero_grads(gate_up, down)
    both_NX = torch.cat([x_ND, dy_ND], 1)  # home side: one message a round
    dx_ND = torch.empty_like(x_ND)
    for rnd in rounds:
        recv_RX, order_R, counts_L = _received(call, rounds, rnd, both_NX, channel)
        x_RD, dy_RD = recv_RX[:, :D][order_R], recv_RX[:, D:][order_R]
        meter.hold(x_RD, dy_RD)
        meter.drop(recv_RX)
        del recv_RX
        meter.reach(4 * x_RD.shape[0] * _ffn_dim(down) * x_RD.element_size())  # recomputed activations
        dx_RD = experts.expert_backward(dy_RD, x_RD, gate_up, down, counts_L, grads=grads)[0]
        meter.drop(x_RD)
        del x_RD
        _sent_back(call, rnd, dx_RD, order_R, dx_ND, channel)
    return dx_ND, *grads
