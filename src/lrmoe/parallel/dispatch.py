"""Row plans and the movement of rows: which of this rank's token–expert pairs go to which
rank, how received rows are regrouped by expert, and the exchanges that carry them there and
back. Parameter-free; the plans are deterministic. This is the compaction room: a backward plan
over the kept pairs only makes every message and every GEMM smaller.

A plan is derived from a :class:`~lrmoe.planning.assignment.PairAssignment` (pairs of expert e from
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

import numpy as np
import torch

from lrmoe.memory.bytes import MemoryMeter, position_bytes
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Group, WireCounter
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement
from lrmoe.selection.strata import Strata, kept_positions


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
    mine_ER = assignment.sent_ER(rank)
    pairs = torch.arange(ids_P.numel(), device=device) if keep_P is None else kept_positions(keep_P, int(mine_ER.sum()))
    experts = ids_P[pairs]
    by_expert = torch.argsort(experts, stable=True)
    pairs, experts = pairs[by_expert], experts[by_expert]

    if placement.expert_ordered:
        pair_idx = pairs  # sorted by expert = by (destination, slot)
    else:
        mine_dev = comm.to_device(mine_ER, device)
        start_E = mine_dev.sum(1).cumsum(0) - mine_dev.sum(1)
        within = torch.arange(pairs.numel(), device=device) - start_E[experts]
        bounds_PR = mine_dev.cumsum(1)[experts]
        dest = torch.searchsorted(bounds_PR, within.unsqueeze(1), right=True).squeeze(1)
        slot_WE = comm.to_device(placement.slot_index, device)
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
    """Index turning source-major received rows into slot-major rows (sources in rank order);
    planned on the host from host counts."""
    S, L = counts_SL.shape
    if S == 1 or L <= 1:
        return None
    flat_SL = counts_SL.numpy().reshape(-1)
    start_LS = (np.cumsum(flat_SL) - flat_SL).reshape(S, L).T.reshape(-1)
    counts_LS = flat_SL.reshape(S, L).T.reshape(-1)
    dst_start_LS = np.cumsum(counts_LS) - counts_LS
    return torch.from_numpy(np.repeat(start_LS - dst_start_LS, counts_LS) + np.arange(int(flat_SL.sum())))


def to_experts(send_ND: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter,
               meter: MemoryMeter) -> torch.Tensor:
    """Send home rows (in ``plan.pair_idx`` order) to the experts; returns them received and
    regrouped slot-major, their bytes held in ``meter``."""
    recv_RD = comm.all_to_all(send_ND, plan.send_splits, plan.recv_splits, group, wire)
    meter.hold(recv_RD)
    if plan.regroup_idx is None:
        return recv_RD
    rows_RD = recv_RD[comm.to_device(plan.regroup_idx, recv_RD.device)]
    meter.hold(rows_RD)
    meter.drop(recv_RD)
    return rows_RD


def to_home(rows_RX: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter) -> torch.Tensor:
    """Inverse of :func:`to_experts`: slot-major expert rows back to their home ranks."""
    if plan.regroup_idx is not None:
        back = torch.empty_like(rows_RX)
        back[comm.to_device(plan.regroup_idx, rows_RX.device)] = rows_RX
        rows_RX = back
    return comm.all_to_all(rows_RX, plan.recv_splits, plan.send_splits, group, wire)


def _with_columns(rows_NX: torch.Tensor, extra_N: torch.Tensor) -> torch.Tensor:
    """``rows_NX`` with each row's ``extra_N`` value appended as extra columns of the rows'
    dtype (its bytes reinterpreted, nothing rounded): one message instead of two."""
    cols = extra_N.element_size() // rows_NX.element_size()
    return torch.cat([rows_NX, extra_N.to(rows_NX.device).view(rows_NX.dtype).view(-1, cols)], 1)


def _split_columns(rows_NY: torch.Tensor, width: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_with_columns`: (the first ``width`` columns, the extra values)."""
    return rows_NY[:, :width], rows_NY[:, width:].contiguous().view(dtype).view(-1)


def to_home_with_norms(y_RD: torch.Tensor, h_sq_R: torch.Tensor, plan: RowPlan, group: Group, wire: WireCounter
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`to_home` of expert outputs together with each row's float64 ‖h‖² (the LRM score's
    expert-side factor) as extra columns: a selective forward makes one return exchange, not
    two. Returns (y rows, ‖h‖² per row) in home order."""
    back_NX = to_home(_with_columns(y_RD, h_sq_R), plan, group, wire)
    return _split_columns(back_NX, y_RD.shape[1], torch.float64)


def position_dtype(rows: torch.Tensor) -> torch.dtype:
    """Dtype of a row's position riding in its message (:func:`lrmoe.memory.bytes.position_bytes`)."""
    return torch.int64 if position_bytes(rows.element_size()) == 8 else torch.int32


def kept_plan(fwd: RowPlan, strata: Strata, keep_N: torch.Tensor) -> tuple[RowPlan, torch.Tensor]:
    """The backward plan of a local selection whose kept pairs are computed where the forward
    computed them: the forward's plan restricted to ``keep_N`` (over its send order), every
    split size known from the strata. Returns the plan and each kept pair's position inside its
    stratum (the row's place among the forward's rows from this rank to that slot)."""
    sel = kept_positions(keep_N, strata.plan.sent)
    counts_SL = strata.plan.received_SL
    plan = RowPlan(fwd.pair_idx[sel], strata.plan.send_R, counts_SL.sum(1).tolist(), _regroup(counts_SL),
                   counts_SL.sum(0), counts_SL)
    pos = torch.arange(keep_N.numel(), device=keep_N.device) - strata.start_N
    return plan, pos[sel]


def to_kept_experts(dy_ND: torch.Tensor, pos_N: torch.Tensor, plan: RowPlan, fwd: RowPlan, group: Group,
                    wire: WireCounter, meter: MemoryMeter) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`to_experts` of the kept rows' dy under a :func:`kept_plan`, each row's stratum
    position riding as extra columns. Returns dy slot-major and, in the same order, each kept
    row's slot-major index among the forward's received rows (None: every row kept)."""
    D = dy_ND.shape[1]
    recv_RX = comm.all_to_all(_with_columns(dy_ND, pos_N.to(position_dtype(dy_ND))), plan.send_splits,
                              plan.recv_splits, group, wire)
    recv_RD, pos_R = _split_columns(recv_RX, D, position_dtype(dy_ND))
    meter.hold(recv_RD)
    if plan.regroup_idx is None:
        dy_RD = recv_RD.contiguous()
    else:
        regroup = comm.to_device(plan.regroup_idx, recv_RD.device)
        dy_RD = recv_RD[regroup]
        meter.hold(dy_RD)
        meter.drop(recv_RD)
    if plan.recv_rows == fwd.recv_rows:  # (kept ≤ forward rows in every block)
        return dy_RD, None
    # forward rows are slot-major: block (slot l, source s) starts at the rows of earlier blocks
    S, L = fwd.counts_SL.shape
    flat_LS = fwd.counts_SL.t().reshape(-1)
    start_SL = (flat_LS.cumsum(0) - flat_LS).view(L, S).t().reshape(-1)
    device = recv_RD.device
    fwd_row_R = torch.repeat_interleave(comm.to_device(start_SL, device),
                                        comm.to_device(plan.counts_SL.reshape(-1), device),
                                        output_size=len(pos_R)) + pos_R.long()
    return dy_RD, fwd_row_R if plan.regroup_idx is None else fwd_row_R[regroup]
