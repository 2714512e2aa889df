"""How a call's backward moves its rows, chosen once from the call's plan together with its
selection (:func:`choose`, :mod:`lrmoe.passes.selectors`), so no backward stage branches on a mode.

Row paths (docs/design.md "Recompute"): the forward's rows (:class:`ForwardRows`: full and
recompute backwards, which kept x); the forward's rounds, x re-sent with dy (:class:`RoundRows`:
an exact backward that kept nothing); the same rows with the dropped pairs' dy zeroed
(:class:`MaskedRows`, the ablation); a compacting backward that kept nothing re-spreads its kept
pairs over the copies and home re-sends their x (:class:`ResentRows`); one that kept x computes
each kept pair where its x was kept, told which rows by the positions riding in dy's message
(:class:`KeptInStrata`, local selections) or by a kept byte per forward row
(:class:`KeptByMask`, global ones). Their interface, :class:`~lrmoe.passes.record.RowPath`, is
the record's, which names it; the rows and dy they pass on are :mod:`lrmoe.passes.backward_rows`'.
"""

from __future__ import annotations

import torch

from lrmoe import experts
from lrmoe.memory.bytes import KEEP_NOTHING, in_place
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Channel
from lrmoe.parallel.dispatch import Delivered, kept_forward_rows, to_experts, to_home, to_kept_experts
from lrmoe.parallel.rows import RowLayout, kept_layout, restrict_to_kept, row_layout
from lrmoe.passes.backward_rows import BackwardRows, DyRows, Kept
from lrmoe.passes.compaction import compact_in_place, gather_kept_rows
from lrmoe.passes.expert_rows import expert_rows_backward
from lrmoe.passes.record import CallRecord, RowPath, Selector
from lrmoe.passes.rounds import backward_in_rounds
from lrmoe.passes.selectors import ForwardPairs, GlobalSelector, StrataSelector
from lrmoe.systems import SystemSpec


def _compact_saved(call: CallRecord, kept_rows: torch.Tensor | None, layout: RowLayout) -> torch.Tensor | None:
    """Keep-x backward: the saved rows of the kept pairs brought together per slot
    (:mod:`lrmoe.passes.compaction`): in place where the plan says so, else gathered.
    ``kept_rows``: their slot-major indices among the saved rows, in dy's slot-major order (None:
    every row kept, nothing to do). Returns the order dy must then take (None: its own)."""
    saved = call.saved
    if kept_rows is None:
        return None
    call.clock.lap("bwd_dispatch")
    # (kept gate/up alone are gathered, so that silu and h are recomputed for the kept rows alone)
    if saved.acts is not None and "silu" in saved.acts and in_place(call.rows.recv_rows, layout.recv_rows):
        saved.in_place, call.stats.compacted_rows = compact_in_place([saved.rows_RD, *saved.acts.values()], kept_rows,
                                                                     call.rows.slot_counts, layout.slot_counts)
        call.stats.compaction = "in place"
        order_R = saved.in_place.order_R.to(kept_rows.device)
    else:
        saved.rows_RD = gather_kept_rows(saved, kept_rows, call.meter)
        call.stats.compaction, call.stats.compacted_rows = "gathered", len(kept_rows)
        order_R = None
    call.clock.lap("bwd_compact")
    return order_R


def _packed_in_order(dy: DyRows, layout: RowLayout, order_R: torch.Tensor | None, channel: Channel) -> torch.Tensor:
    """World 1, nothing crosses: dy packed straight into the slot-major order the expert side
    needs (``order_R``: in that order of it), the send order being slot-major already."""
    dy_RD = dy.of(layout.pair_idx if order_R is None else layout.pair_idx[order_R])
    channel.delivered(dy_RD)
    return dy_RD


def backward_chunk(call: CallRecord, layout: RowLayout | None = None) -> int | None:
    """Rows this rank's backward recomputes at once where the plan chunks it (None: all of
    ``layout``'s rows at once, the forward's by default; a call keeping by the row always works in
    chunks, reading dy in its received order). A compacting backward's kept rows are chunked by
    ``BackwardConfig.recompute_chunk``; their dy arrives slot-major, chunked or not."""
    chunk_R = call.plan.bwd_chunk_rows_R
    rows = (call.rows if layout is None else layout).recv_rows
    if chunk_R is None or (chunk_R[call.layer.rank] >= rows and call.plan.split_R is None):
        return None
    return chunk_R[call.layer.rank]


def _take_saved(call: CallRecord) -> torch.Tensor:
    rows_RD, call.saved.rows_RD = call.saved.rows_RD, None
    return rows_RD


class ForwardRows(RowPath):
    """The forward's layout; the expert side kept x (and, for a full backward, the activations)."""

    def rows(self, call: CallRecord, kept: Kept, channel: Channel) -> BackwardRows:
        return BackwardRows(call.rows, chunk=backward_chunk(call))

    def factor(self, factor_P: torch.Tensor, kept: Kept) -> torch.Tensor:
        """Per-row factor of dy = factor · g_t: the routing weight, times 1/π for sampled pairs."""
        return factor_P if kept.scale_P is None else factor_P * kept.scale_P.to(factor_P.dtype)

    def dispatch(self, call: CallRecord, dy: DyRows, x_TD: torch.Tensor, rows: BackwardRows,
                 channel: Channel) -> tuple[torch.Tensor, torch.Tensor]:
        """(dy, x) rows at the expert side: x slot-major, dy too unless the backward is chunked."""
        dy_ND = dy.of(rows.layout.pair_idx)
        return to_experts(dy_ND, rows.layout, channel, regroup=rows.dy_slot_major), _take_saved(call)

    def compute(self, call: CallRecord, dy_RD: torch.Tensor, rows_RD: torch.Tensor, rows: BackwardRows,
                gate_up: torch.Tensor, down: torch.Tensor, channel: Channel
                ) -> tuple[torch.Tensor, experts.Slots, experts.Slots]:
        """(dx rows, slot weight gradients): the grouped expert backward over the received rows."""
        return expert_rows_backward(call, dy_RD, rows_RD, rows, gate_up, down)

    def home(self, call: CallRecord, dx_RD: torch.Tensor, rows: BackwardRows, channel: Channel
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """dx rows back to their home ranks (collective), with the pair each row belongs to: in
        the layout's send order, or — where nothing is exchanged (world 1) and the rows were
        compacted in place — in their compacted order, the pairs read through it instead of the
        rows put back."""
        order_R = None if call.saved.in_place is None else call.saved.in_place.order_R
        if order_R is not None and comm.world_size(channel.group) == 1:  # slot-major order is the send order
            return dx_RD, rows.layout.pair_idx[order_R.to(rows.layout.pair_idx.device)]
        dx_ND = to_home(dx_RD, rows.layout, channel, slot_major=rows.dy_slot_major, order_R=order_R)
        return dx_ND, rows.layout.pair_idx


class RoundRows(ForwardRows):
    """An exact call that kept nothing: x and dy go to the experts in the forward's rounds, and
    dx comes home round by round (:mod:`lrmoe.passes.rounds`)."""

    def dispatch(self, call, dy, x_TD, rows, channel):
        """Nothing moves yet: (dy, x) in the forward layout's send order, home side."""
        return dy.of(rows.layout.pair_idx), x_TD[rows.layout.pair_idx // call.ids_TK.shape[1]]

    def compute(self, call, dy_ND, x_ND, rows, gate_up, down, channel):
        w_gu, w_down = call.saved.slot_weights or (gate_up, down)
        call.saved.slot_weights = None
        return backward_in_rounds(call, dy_ND, x_ND, w_gu, w_down, channel)

    def home(self, call, dx_ND, rows, channel):
        return dx_ND, rows.layout.pair_idx  # home already, in send order


class MaskedRows(ForwardRows):
    """The forward's layout, the dy of dropped pairs zeroed: the selection's cost without its saving."""

    def factor(self, factor_P: torch.Tensor, kept: Kept) -> torch.Tensor:
        factor_P = super().factor(factor_P, kept)
        return factor_P if kept.keep_P is None else factor_P * kept.keep_P


class ResentRows(ForwardRows):
    """Kept pairs re-spread min-peak within the plan's kept capacities; home re-sends their x."""

    def rows(self, call: CallRecord, kept: Kept, channel: Channel) -> BackwardRows:
        plan = call.plan
        layout = row_layout(call.ids_TK.reshape(-1), plan.assign_kept(kept.kept_SE), plan.placement, call.layer.rank,
                            keep_P=kept.keep_P)
        return BackwardRows(layout, chunk=backward_chunk(call, layout), slot_major=True)

    def dispatch(self, call, dy, x_TD, rows, channel):
        x_ND = x_TD[rows.layout.pair_idx // call.ids_TK.shape[1]]
        dy_RD = to_experts(dy.of(rows.layout.pair_idx), rows.layout, channel)
        return dy_RD, to_experts(x_ND, rows.layout, channel)


class KeptInStrata(ForwardRows):
    """Kept pairs computed where their x was kept; each kept row's position rides with its dy."""

    def rows(self, call: CallRecord, kept: Kept, channel: Channel) -> BackwardRows:
        if kept.keep_N is None:  # every pair kept: the forward's rows
            return BackwardRows(call.rows, chunk=backward_chunk(call, call.rows), slot_major=True)
        layout, pos_N = kept_layout(call.rows, kept.strata, kept.keep_N)
        return BackwardRows(layout, kept_pos_N=pos_N, chunk=backward_chunk(call, layout), slot_major=True)

    def dispatch(self, call, dy, x_TD, rows, channel):
        if rows.kept_pos_N is None:
            return super().dispatch(call, dy, x_TD, rows, channel)
        if comm.world_size(channel.group) == 1:
            order_R = _compact_saved(call, kept_forward_rows(rows.kept_pos_N, rows.layout, call.rows), rows.layout)
            return _packed_in_order(dy, rows.layout, order_R, channel), _take_saved(call)
        delivered, kept_rows = to_kept_experts(dy.with_positions(rows.layout.pair_idx, rows.kept_pos_N), rows.layout,
                                               call.rows, channel)
        return delivered.slot_major(channel, _compact_saved(call, kept_rows, rows.layout)), _take_saved(call)


class KeptByMask(ForwardRows):
    """Kept pairs computed where their x was kept; home tells the expert sides which rows are
    kept, a byte per forward row (collective)."""

    def rows(self, call: CallRecord, kept: Kept, channel: Channel) -> BackwardRows:
        layout, kept_rows = restrict_to_kept(call.rows, kept.keep_P, channel)
        return BackwardRows(layout, kept_rows=kept_rows, chunk=backward_chunk(call, layout), slot_major=True)

    def dispatch(self, call, dy, x_TD, rows, channel):
        order_R = _compact_saved(call, rows.kept_rows, rows.layout)
        if comm.world_size(channel.group) == 1:
            return _packed_in_order(dy, rows.layout, order_R, channel), _take_saved(call)
        recv_RD = to_experts(dy.of(rows.layout.pair_idx), rows.layout, channel, regroup=False)
        regroup = None if rows.layout.regroup_idx is None else rows.layout.regroup_idx.to(recv_RD.device)
        return Delivered(recv_RD, regroup).slot_major(channel, order_R), _take_saved(call)


def choose(spec: SystemSpec, keep: str | None, local: bool) -> tuple[Selector, RowPath]:
    """The backward of a training call: its selection and row path, from the spec, the plan's
    keep mode and whether the selection is local. The only place that tells the modes apart."""
    if not spec.selective:
        return ForwardPairs(), RoundRows() if keep == KEEP_NOTHING else ForwardRows()
    selector = StrataSelector() if local else GlobalSelector()
    if not spec.compacts:
        return selector, MaskedRows()
    if keep == KEEP_NOTHING:
        return selector, ResentRows()
    return selector, KeptInStrata() if local else KeptByMask()

