"""The weights a call's expert side computes with (:class:`SlotWeights`): every local slot's,
owned experts then replicas as two sets, or (sharded systems) the experts assembled from every
rank's slices; fetched before the forward's rows move (:func:`fetch_weights`), which also starts
the call's memory meter at what those copies and their gradients hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe import experts
from lrmoe.memory.bytes import nbytes
from lrmoe.memory.meter import MemoryMeter
from lrmoe.parallel import sharding
from lrmoe.parallel.comm import Channel, WireCounter
from lrmoe.passes.record import CallRecord
from lrmoe.systems import PlacementKind


@dataclass(frozen=True)
class SlotWeights:
    """Weights of every local slot (owned experts, then replicas, as two sets; sharded systems:
    the experts this call assembled here) and the parameter bytes the call moved to have them."""

    gate_up: experts.Slots
    down: experts.Slots
    moved_bytes: int

    @property
    def ffn_dim(self) -> int:
        return (self.down if isinstance(self.down, torch.Tensor) else self.down[0]).shape[2]


def fetch_weights(call: CallRecord, gate_up: torch.Tensor, down: torch.Tensor, channel: Channel) -> SlotWeights:
    """This call's copies fetched from their owners where the plan placed new ones (collective),
    the local slots' weights, and the call's meter, which from here on hears of every row the
    channel delivers."""
    layer, placement = call.layer, call.plan.placement
    layer.replicas.ready()  # a refresh the last step_end started: its rows are needed now
    moved = 0
    if call.plan.fetch:
        moved += layer.replicas.refresh(gate_up.detach(), down.detach(), placement, layer.rank, layer.group)
    if layer.spec.placement is PlacementKind.SHARDED:  # assembled from every rank's slices
        slices = WireCounter(node_of=layer.node_of)  # placement bytes, not the forward's rows
        w_gu, w_down = sharding.assemble(gate_up.detach(), down.detach(), placement, layer.rank, channel.group, slices)
        moved += slices.sent
        base = 2 * (nbytes(gate_up, down) + nbytes(w_gu, w_down))  # slices and their gradients, assembled and theirs
    elif len(layer.replicas.experts):  # two weight sets, owned then replicas, never concatenated
        w_gu, w_down = (gate_up, layer.replicas.gate_up_proj), (down, layer.replicas.down_proj)
        base = 2 * nbytes(*w_gu, *w_down)  # every copy and its gradient
    else:
        w_gu, w_down = gate_up, down
        base = 2 * nbytes(w_gu, w_down)
    call.meter = channel.memory = MemoryMeter(base)
    return SlotWeights(w_gu, w_down, moved)
