"""Row layouts: which of this rank's token–expert pairs go to which rank, in what order, and how
received rows are regrouped by expert. Parameter-free and deterministic; the exchanges that
move rows by a layout are :mod:`lrmoe.parallel.dispatch`. This is the compaction room: a
backward layout over the kept pairs only makes every message and every GEMM smaller.

A layout is derived from a :class:`~lrmoe.planning.assignment.PairAssignment` (pairs of expert
e from source rank s computed at rank r), which every rank knows identically after the count
exchange, so split sizes never need a second exchange. The forward layout covers every pair; a
backward layout may cover only a kept subset and may send pairs to other replicas than the
forward did.

Send order at a source: by destination rank, then by the destination's slot order, then by
pair index (or by a key, :func:`row_layout`). Receive order at a destination: by source rank,
then slot, then send order; ``regroup_idx`` reorders that into slot-major order for the grouped
GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.parallel import comm
from lrmoe.parallel.comm import Channel
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement
from lrmoe.selection.arrays import as_tensor, float64, int64, on_host, xp
from lrmoe.selection.strata import Strata, kept_positions


@dataclass(frozen=True)
class RowLayout:
    pair_idx: torch.Tensor  # int64 (n_send,): flattened (t·K + k) pair ids in send order
    send_splits: list[int]  # rows to each destination rank
    recv_splits: list[int]  # rows from each source rank
    regroup_idx: torch.Tensor | None  # received order → slot-major order; None when identity
    slot_counts: torch.Tensor  # int64 (L,) rows per local slot, on CPU
    counts_SL: torch.Tensor | None = None  # int64 (S, L) rows from source s for local slot l, on CPU

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)


def row_layout(ids_P: torch.Tensor, assignment: PairAssignment, placement: Placement, rank: int,
               keep_P: torch.Tensor | None = None, order_key_P: torch.Tensor | None = None) -> RowLayout:
    """Lay out the exchange of this rank's pairs (``ids_P`` their expert ids, flattened (T·K)).

    ``keep_P`` (bool) restricts the layout to a subset of pairs; ``assignment`` must then count
    exactly the kept pairs. Pairs of expert e from this rank are handed to e's holders in pair
    order: the first ``assign_ESR[e, rank, r0]`` to the first holder r0, and so on.

    ``order_key_P`` (a value per pair, such as its routing weight) reorders the pairs within each
    (destination, slot) run, who goes where unchanged: ascending from an even rank, descending
    from an odd one. A slot's block at its holder lays the sources' runs end to end in rank
    order, so the pairs of highest key from ranks 2i and 2i + 1 meet in the middle of their two
    runs: where a backward that keeps pairs of high key compacts in place, they already lie
    together (:mod:`lrmoe.passes.compaction` keeps each slot's kept rows in the window that holds
    the most of them).
    """
    E = assignment.num_experts
    device = ids_P.device
    mine_ER = assignment.sent_ER(rank)
    pairs = torch.arange(ids_P.numel(), device=device) if keep_P is None else kept_positions(keep_P, int(mine_ER.sum()))
    experts = ids_P[pairs]
    by_expert = torch.argsort(experts, stable=True)
    pairs, experts = pairs[by_expert], experts[by_expert]

    if placement.expert_ordered:
        pair_idx, run_P = pairs, experts  # sorted by expert = by (destination, slot)
    else:
        mine_dev = comm.to_device(mine_ER, device)
        start_E = mine_dev.sum(1).cumsum(0) - mine_dev.sum(1)
        within = torch.arange(pairs.numel(), device=device) - start_E[experts]
        bounds_PR = mine_dev.cumsum(1)[experts]
        dest = torch.searchsorted(bounds_PR, within.unsqueeze(1), right=True).squeeze(1)
        slot_WE = comm.to_device(placement.slot_index, device)
        run_P = dest * E + slot_WE[dest, experts]
        by_run = torch.argsort(run_P, stable=True)
        pair_idx, run_P = pairs[by_run], run_P[by_run]
    if order_key_P is not None and len(pair_idx):
        # one unstable sort of run · span + key (runs stay apart): near-equal keys may come in
        # either order, which only the compaction's cost, never a result, depends on
        key = float64(on_host(order_key_P[pair_idx]))
        key = xp(key).nan_to_num(key, nan=0.0, posinf=0.0, neginf=0.0)  # (a broken weight keeps its run)
        by_run_then_key = int64(on_host(run_P)) * (2 * abs(key).max() + 1) + (-key if rank % 2 else key)
        pair_idx = pair_idx[as_tensor(xp(key).argsort(by_run_then_key))]

    send_splits = mine_ER.sum(0).tolist()
    counts_SL = assignment.received_SL(rank, placement.slots[rank])  # rows from source s for local slot l
    recv_splits = counts_SL.sum(1).tolist()
    return RowLayout(pair_idx, send_splits, recv_splits, _regroup(counts_SL), counts_SL.sum(0), counts_SL)


def restrict_to_kept(fwd: RowLayout, keep_P: torch.Tensor, channel: Channel) -> tuple[RowLayout, torch.Tensor | None]:
    """The backward layout of an expert side that kept the forward's x rows: the forward layout
    restricted to the kept pairs, each computed where the forward computed it (no re-spread).

    Home tells each expert side which of the rows it received are kept: one byte per forward
    row, through the forward's splits (collective). Returns the layout and the slot-major indices
    of the kept rows among the forward's received rows (None: all kept).
    """
    keep_send = keep_P[fwd.pair_idx]
    mask = channel.all_to_all(keep_send.to(torch.uint8), fwd.send_splits, fwd.recv_splits).cpu().bool()
    counts_SL = fwd.counts_SL
    S, L = counts_SL.shape
    segment = torch.repeat_interleave(torch.arange(S * L), counts_SL.reshape(-1), output_size=len(mask))
    kept_SL = torch.bincount(segment[mask], minlength=S * L).view(S, L)
    send_splits = [int(k.sum()) for k in torch.split(keep_send, fwd.send_splits)]
    layout = RowLayout(fwd.pair_idx[keep_send], send_splits, kept_SL.sum(1).tolist(), _regroup(kept_SL),
                       kept_SL.sum(0), kept_SL)
    if bool(mask.all()):
        return layout, None
    slot_major = mask if fwd.regroup_idx is None else mask[fwd.regroup_idx]
    return layout, slot_major.nonzero().squeeze(1)


def kept_layout(fwd: RowLayout, strata: Strata, keep_N: torch.Tensor) -> tuple[RowLayout, torch.Tensor]:
    """The backward layout of a local selection whose kept pairs are computed where the forward
    computed them: the forward's layout restricted to ``keep_N`` (over its send order), every
    split size known from the strata. Returns the layout and each kept pair's position inside its
    stratum (the row's place among the forward's rows from this rank to that slot)."""
    sel = kept_positions(keep_N, strata.counts.sent)
    counts_SL = strata.counts.received_SL
    layout = RowLayout(fwd.pair_idx[sel], strata.counts.send_R, counts_SL.sum(1).tolist(), _regroup(counts_SL),
                       counts_SL.sum(0), counts_SL)
    pos = torch.arange(keep_N.numel(), device=keep_N.device) - strata.start_N
    return layout, pos[sel]


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
