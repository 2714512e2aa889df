"""Row plans and the movement of rows: which of this rank's token–expert pairs go to which
rank, how received rows are regrouped by expert, and the exchanges that carry them there and
back. Parameter-free; the plans are deterministic. This is the compaction room: a backward plan
over the kept pairs only makes every message and every GEMM smaller.

A plan is derived from a :class:`~lrmoe.assignment.PairAssignment` (pairs of expert e from
source rank s computed at rank r), which every rank knows identically after the count exchange,
so split sizes never need a second exchange. The forward plan covers every pair; a backward
plan may cover only a kept subset (compaction) and may send pairs to other replicas than the
forward did.

Send order at a source: by destination rank, then by the destination's slot order, then by
pair index. Receive order at a destination: by source rank, then slot, then pair index;
``regroup_idx`` reorders that into slot-major order for the grouped GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe import comm
from lrmoe.assignment import PairAssignment
from lrmoe.comm import Group, WireCounter
from lrmoe.meter import MemoryMeter
from lrmoe.placement import Placement


@dataclass(frozen=True)
class RowPlan:
    pair_idx: torch.Tensor  # int64 (n_send,): flattened (t·K + k) pair ids in send order
    send_splits: list[int]  # rows to each destination rank
    recv_splits: list[int]  # rows from each source rank
    regroup_idx: torch.Tensor | None  # received order → slot-major order; None when identity
    slot_counts: torch.Tensor  # int64 (L,) rows per local slot, on CPU
    counts_SL: torch.Tensor | None = None  # int64 (S, L) rows from source s for local slot l, on CPU

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)


def build_row_plan(
    ids_P: torch.Tensor,
    assignment: PairAssignment,
    placement: Placement,
    rank: int,
    keep_P: torch.Tensor | None = None,
) -> RowPlan:
    """Plan the exchange of this rank's pairs (``ids_P`` their expert ids, flattened (T·K)).

    ``keep_P`` (bool) restricts the plan to a subset of pairs; ``assignment`` must then count
    exactly the kept pairs. Pairs of expert e from this rank are handed to e's holders in pair
    order: the first ``assign_ESR[e, rank, r0]`` to the first holder r0, and so on.
    """
    E = assignment.num_experts
    device = ids_P.device
    pairs = torch.arange(ids_P.numel(), device=device) if keep_P is None else keep_P.nonzero().squeeze(1)
    experts = ids_P[pairs]
    by_expert = torch.argsort(experts, stable=True)
    pairs, experts = pairs[by_expert], experts[by_expert]

    mine_ER = assignment.sent_ER(rank)
    if placement.expert_ordered:
        pair_idx = pairs  # sorted by expert = by (destination, slot)
    else:
        mine_dev = mine_ER.to(device)
        start_E = mine_dev.sum(1).cumsum(0) - mine_dev.sum(1)
        within = torch.arange(pairs.numel(), device=device) - start_E[experts]
        bounds_PR = mine_dev.cumsum(1)[experts]
        dest = torch.searchsorted(bounds_PR, within.unsqueeze(1), right=True).squeeze(1)
        slot_WE = placement.slot_index.to(device)
        pair_idx = pairs[torch.argsort(dest * E + slot_WE[dest, experts], stable=True)]

    send_splits = mine_ER.sum(0).tolist()
    counts_SL = assignment.received_SL(rank, placement.slots[rank])  # rows from source s for local slot l
    recv_splits = counts_SL.sum(1).tolist()
    return RowPlan(pair_idx, send_splits, recv_splits, _regroup(counts_SL), counts_SL.sum(0), counts_SL)


def restrict_to_kept(fwd: RowPlan, keep_P: torch.Tensor, group: Group, wire: WireCounter
                     ) -> tuple[RowPlan, torch.Tensor | None]:
    """The backward plan of an expert side that kept the forward's x rows: the forward plan
    restricted to the kept pairs, each computed where the forward computed it (no re-spread).

    Home tells each expert side which of the rows it received are kept: one byte per forward
    row, through the forward's splits (collective, counted in ``wire``). Returns the plan and
    the slot-major indices of the kept rows among the forward's received rows (None: all kept).
    """
    keep_send = keep_P[fwd.pair_idx]
    mask = comm.all_to_all(keep_send.to(torch.uint8), fwd.send_splits, fwd.recv_splits, group, wire).cpu().bool()
    counts_SL = fwd.counts_SL
    S, L = counts_SL.shape
    segment = torch.repeat_interleave(torch.arange(S * L), counts_SL.reshape(-1), output_size=len(mask))
    kept_SL = torch.bincount(segment[mask], minlength=S * L).view(S, L)
    send_splits = [int(k.sum()) for k in torch.split(keep_send, fwd.send_splits)]
    plan = RowPlan(fwd.pair_idx[keep_send], send_splits, kept_SL.sum(1).tolist(), _regroup(kept_SL),
                   kept_SL.sum(0), kept_SL)
    if bool(mask.all()):
        return plan, None
    slot_major = mask if fwd.regroup_idx is None else mask[fwd.regroup_idx]
    return plan, slot_major.nonzero().squeeze(1)


def _regroup(counts_SL: torch.Tensor) -> torch.Tensor | None:
    """Index turning source-major received rows into slot-major rows (sources in rank order)."""
    S, L = counts_SL.shape
    if S == 1 or L <= 1:
        return None
    flat_SL = counts_SL.reshape(-1)
    start_SL = (flat_SL.cumsum(0) - flat_SL).view(S, L)
    counts_LS, start_LS = counts_SL.t().reshape(-1), start_SL.t().reshape(-1)
    total = int(flat_SL.sum())
    dst_start_LS = counts_LS.cumsum(0) - counts_LS
    shift = torch.repeat_interleave(start_LS - dst_start_LS, counts_LS, output_size=total)
    return shift + torch.arange(total)


def to_experts(send_ND: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter,
               meter: MemoryMeter) -> torch.Tensor:
    """Send home rows (in ``plan.pair_idx`` order) to the experts; returns them received and
    regrouped slot-major, their bytes held in ``meter``."""
    recv_RD = comm.all_to_all(send_ND, plan.send_splits, plan.recv_splits, group, wire)
    meter.hold(recv_RD)
    if plan.regroup_idx is None:
        return recv_RD
    rows_RD = recv_RD[plan.regroup_idx.to(recv_RD.device)]
    meter.hold(rows_RD)
    meter.drop(recv_RD)
    return rows_RD


def to_home(rows_RX: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter) -> torch.Tensor:
    """Inverse of :func:`to_experts`: slot-major expert rows back to their home ranks."""
    if plan.regroup_idx is not None:
        back = torch.empty_like(rows_RX)
        back[plan.regroup_idx.to(rows_RX.device)] = rows_RX
        rows_RX = back
    return comm.all_to_all(rows_RX, plan.recv_splits, plan.send_splits, group, wire)


def to_home_with_norms(y_RD: torch.Tensor, h_sq_R: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_home` of expert outputs together with each row's float64 ‖h‖² (the LRM score's
    expert-side factor): the norms ride as extra columns of the same message, their bytes
    reinterpreted in y's dtype (nothing rounded), so a selective forward makes one return
    exchange, not two. Returns (y rows, ‖h‖² per row) in home order."""
    D = y_RD.shape[1]
    norms_RX = h_sq_R.to(y_RD.device).view(y_RD.dtype).view(y_RD.shape[0], 8 // y_RD.element_size())
    back_NX = to_home(torch.cat([y_RD, norms_RX], 1), plan, group, wire)
    return back_NX[:, :D], back_NX[:, D:].contiguous().view(torch.float64).view(-1)
