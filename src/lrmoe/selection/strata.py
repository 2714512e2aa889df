"""Strata of a local selection: this rank's pairs cut by where the forward computed them.

A local selection (``local``, ``local-sampled``) keeps, of source rank s's pairs of expert e, a
share of q_e fixed by the counts alone (largest remainder over sources). Cutting that share
once more over the ranks that computed e's pairs from s in the forward (in proportion, by
:meth:`PairAssignment.restricted`) makes every kept count a function of the plan: each rank
knows, before any row moves, how many rows every (source, holder, expert) keeps. So

- the backward sends no count, mask or score before its rows: the split sizes are known, and a
  kept row's place among the forward's rows rides in dy's message as an extra column;
- a keep-x backward computes each kept pair where its x was kept, and a re-spread one assigns
  the same kept counts min-peak (every keep mode keeps the same pairs);
- nothing in the selection reads the device (docs/performance.md "Host reads").

A stratum is one (expert, holder) entry the forward sent this rank's pairs to; the forward's
send order (``RowPlan.pair_idx``: by destination, then its slot order, then pair index) lays
the strata end to end, so a stratum is a contiguous run of that order. Stratifying by holder
is unbiased (each stratum's draw is unbiased for its own sum) and keeps exactly q_e per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.parallel.comm import to_device
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement
from lrmoe.selection.selections import largest_remainder


@dataclass(frozen=True)
class StrataPlan:
    """The kept counts one rank needs for one backward (host; planned from the counts alone,
    identically on every rank: each rank's figures are the others' view of it)."""

    kept_SE: torch.Tensor  # int64 (S, E): kept pairs per source and expert, Σ_s = q_e
    sizes_G: np.ndarray  # int64 (G,): this rank's pairs in each stratum, in send order
    share_G: np.ndarray  # int64 (G,): pairs each of them keeps
    send_R: list[int]  # kept pairs this rank sends each rank
    received_SL: torch.Tensor  # int64 (S, L): kept pairs from source s for this rank's local slot l

    @property
    def sent(self) -> int:
        """Pairs this rank keeps."""
        return int(self.share_G.sum())


@dataclass(frozen=True)
class Strata:
    """A :class:`StrataPlan` with this rank's strata laid out on the device."""

    plan: StrataPlan
    group_N: torch.Tensor  # int64 (N,): stratum of each pair in the forward's send order, ascending
    start_N: torch.Tensor  # int64 (N,): where each pair's stratum starts in that order
    share_G: torch.Tensor  # int64 (G,): pairs each stratum keeps


def plan_strata(assignment: PairAssignment, placement: Placement, counts_SE: torch.Tensor, quota_E: torch.Tensor,
                rank: int) -> StrataPlan:
    """The kept counts of a local selection under a forward ``assignment`` covering every pair:
    of :meth:`PairAssignment.restricted`, only this rank's source column and its own experts'
    entries are computed."""
    kept_SE = largest_remainder(quota_E, counts_SE)
    _, sent_H = assignment.kept_rows(kept_SE, sources=[rank])
    sent_H = sent_H[:, 0]
    slot_WE = placement.slot_index.numpy()
    order_H = np.lexsort((slot_WE[assignment.rank_H, assignment.expert_H], assignment.rank_H))  # send order
    send_R = np.bincount(assignment.rank_H, sent_H, minlength=assignment.world).astype(np.int64).tolist()
    slots = placement.slots[rank]
    entries, rows_NS = assignment.kept_rows(kept_SE, experts=np.asarray(slots))
    here = assignment.rank_H[entries] == rank
    received_SL = np.zeros((assignment.world, len(slots)), np.int64)
    received_SL[:, slot_WE[rank, assignment.expert_H[entries[here]]]] = rows_NS[here].T
    return StrataPlan(kept_SE, assignment.rows_HS[order_H, rank], sent_H[order_H], send_R,
                      torch.from_numpy(received_SL))


def strata_on(plan: StrataPlan, device: torch.device) -> Strata:
    """Lay ``plan``'s strata out over this rank's pairs on ``device`` (no device→host read)."""
    sizes = to_device(torch.from_numpy(plan.sizes_G), device)
    N, G = int(plan.sizes_G.sum()), len(plan.sizes_G)
    group_N = torch.repeat_interleave(torch.arange(G, device=device), sizes, output_size=N)
    return Strata(plan, group_N, (sizes.cumsum(0) - sizes)[group_N], to_device(torch.from_numpy(plan.share_G), device))


def kept_positions(keep_N: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` True entries of ``keep_N``, ascending — ``nonzero`` with its
    size known in advance, so nothing is read from the device."""
    slot = torch.where(keep_N, keep_N.long().cumsum(0) - 1, count)  # dropped entries share a spare slot
    out = torch.empty(count + 1, dtype=torch.long, device=keep_N.device)
    out[slot] = torch.arange(keep_N.numel(), device=keep_N.device)
    return out[:count]
