"""An exchange in rounds of rows (MemFine-style token chunking): where not even one exchange's
rows fit a rank's memory cap beside its experts, the rows a call moves to an expert side go in
rounds, each expert side receiving at most its ``chunk`` rows a round, computing them and
sending their results back before the next round arrives. The expert side then never holds
more than one round's rows, whatever the routing: the least a call can need is its experts and
one row.

Round c brings expert side d the rows ``[c·chunk_d, (c+1)·chunk_d)`` of its usual received
order (source by source, then slot: :mod:`lrmoe.parallel.rows`). Every rank knows every
(source, destination) row count from the plan, so each source cuts its own send block to d at
the same places without any exchange of sizes, and every rank runs the same number of rounds
(the most any expert side needs; a rank with nothing left sends and receives empty splits).
Within a round the rows are sorted by slot for the grouped GEMMs and the results sorted back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.parallel.rows import RowLayout


@dataclass(frozen=True)
class Round:
    """One round at this rank: what it sends (spans of its send buffer) and receives."""

    send_spans: list[tuple[int, int]]  # per destination: [a, b) of this rank's send buffer
    recv_window: tuple[int, int]  # [a, b) of this rank's received order
    send_splits: list[int]
    recv_splits: list[int]

    def gather(self, send_ND: torch.Tensor) -> torch.Tensor:
        """This round's rows of a home-side send buffer, destination by destination."""
        return torch.cat([send_ND[a:b] for a, b in self.send_spans])

    def scatter(self, back_ND: torch.Tensor, into_ND: torch.Tensor) -> None:
        """Rows that came back this round into their places of a home-side buffer."""
        at = 0
        for a, b in self.send_spans:
            into_ND[a:b] = back_ND[at : at + b - a]
            at += b - a


@dataclass(frozen=True)
class Rounds:
    """Every round of one exchange at this rank, and the slot of each row it receives."""

    rounds: list[Round]
    slot_R: torch.Tensor  # int64 (received rows,): each received row's local slot, received order
    num_slots: int

    def __iter__(self) -> Iterator[Round]:
        return iter(self.rounds)

    def __len__(self) -> int:
        return len(self.rounds)

    def by_slot(self, window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the order sorting a round's received rows by slot, the round's rows per slot)."""
        slots = self.slot_R[window[0] : window[1]]
        return torch.argsort(slots, stable=True), torch.bincount(slots, minlength=self.num_slots)


def plan_rounds(rows_SR: torch.Tensor, chunk_R: list[int], layout: RowLayout, rank: int) -> Rounds:
    """The rounds of an exchange whose rows from source s to expert side r are ``rows_SR[s, r]``
    (every rank's plan), expert side r taking at most ``chunk_R[r]`` rows a round; ``layout`` is
    this rank's row layout of that exchange (its send order and received slots)."""
    rows = np.asarray(rows_SR, dtype=np.int64)
    W = rows.shape[0]
    offset_SR = np.cumsum(rows, axis=0) - rows  # where source s's block starts in r's received order
    recv_R = rows.sum(0)
    chunks = np.maximum(np.asarray(chunk_R, dtype=np.int64), 1)
    n_rounds = max(int((-(-recv_R // chunks)).max()), 1)  # ceil(rows / chunk), the most of any rank
    send_start = np.cumsum(rows[rank]) - rows[rank]  # this rank's send block to each destination
    out = []
    for c in range(n_rounds):
        lo_R, hi_R = np.minimum(c * chunks, recv_R), np.minimum((c + 1) * chunks, recv_R)
        # source s's rows in expert side r's window of this round
        a_SR = np.clip(lo_R[None, :] - offset_SR, 0, rows)
        b_SR = np.clip(hi_R[None, :] - offset_SR, 0, rows)
        spans = [(int(send_start[d] + a_SR[rank, d]), int(send_start[d] + b_SR[rank, d])) for d in range(W)]
        out.append(Round(spans, (int(lo_R[rank]), int(hi_R[rank])), (b_SR[rank] - a_SR[rank]).tolist(),
                         (b_SR[:, rank] - a_SR[:, rank]).tolist()))
    counts_SL = layout.counts_SL
    S, L = counts_SL.shape
    slot_R = torch.arange(L).repeat(S).repeat_interleave(counts_SL.reshape(-1))
    return Rounds(out, slot_R, L)
