"""The expert backward over the rows an expert side received (the forward's, or a backward
layout's): the grouped SwiGLU backward with the saved activations (silu and h recomputed where
gate/up alone were kept), or recomputing them from x
for every row at once or, where the plan chunks this rank's backward, a chunk at a time, or
part by part where the call kept by the row (:mod:`lrmoe.passes.by_row`)."""

from __future__ import annotations

import torch

from lrmoe import experts
from lrmoe.memory.bytes import nbytes
from lrmoe.parallel import comm
from lrmoe.passes.backward_rows import BackwardRows
from lrmoe.passes.by_row import backward_by_row
from lrmoe.passes.record import CallRecord


def expert_rows_backward(call: CallRecord, dy_RD: torch.Tensor, rows_RD: torch.Tensor, rows: BackwardRows,
                         gate_up: torch.Tensor, down: torch.Tensor
                         ) -> tuple[torch.Tensor, experts.Slots, experts.Slots]:
    """The grouped SwiGLU backward over the received rows (recomputing gate/up/h where the
    activations were not kept). Returns (dx rows, slot weight gradients)."""
    meter, saved = call.meter, call.saved
    acts, saved.acts = saved.acts, None
    w_gu, w_down = saved.slot_weights or (gate_up, down)
    saved.slot_weights = None
    by_row, saved.by_row = saved.by_row, None
    if by_row is not None:  # part by part, dy in received order (the plan's chunk set for every rank)
        order = None if rows.dy_slot_major else comm.to_device(rows.layout.regroup_idx, dy_RD.device)
        return backward_by_row(dy_RD, rows_RD, w_gu, w_down, rows.layout.slot_counts, by_row, rows.chunk, order,
                               meter)
    if acts is not None:  # (gate and up alone: silu and h recomputed beside them, as large)
        meter.reach(0 if "silu" in acts else nbytes(*acts.values()))
        meter.drop(*acts.values())
        starts_L = None if saved.in_place is None else saved.in_place.starts_L
        return experts.expert_backward(dy_RD, rows_RD, w_gu, w_down, rows.layout.slot_counts, acts,
                                       saved_starts_L=starts_L)
    # The expert backward works in place (dh over h, d up over silu, d gate over gate, dx over
    # dy), so its peak is the four (R, F) activations beside dy and x: already counted when
    # saved, recomputed otherwise: for every row at once, or for one chunk's rows where the
    # plan chunks this rank's backward.
    # A chunked backward gathers each chunk's dy rows from their received order.
    R, s = dy_RD.shape[0], dy_RD.element_size()
    if rows.chunk is None:
        meter.reach(4 * R * down.shape[2] * s)
        return experts.expert_backward(dy_RD, rows_RD, w_gu, w_down, rows.layout.slot_counts)
    order = None if rows.dy_slot_major else comm.to_device(rows.layout.regroup_idx, dy_RD.device)
    meter.reach(rows.chunk * (4 * down.shape[2] * s + (0 if order is None else dy_RD.shape[1] * s)))
    return experts.expert_backward_chunked(dy_RD, rows_RD, w_gu, w_down, rows.layout.slot_counts, rows.chunk, order)
