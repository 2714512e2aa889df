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
send order (``RowLayout.pair_idx``: by destination, then its slot order, then pair index) lays
the strata end to end, so a stratum is a contiguous run of that order. Stratifying by holder
is unbiased (each stratum's draw is unbiased for its own sum) and keeps exactly q_e per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.config import BackwardConfig
from lrmoe.parallel.comm import to_device
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement
from lrmoe.selection.arrays import (
    Array,
    as_tensor,
    float64,
    group_sizes,
    int64,
    on_host,
    order_by_group_then_key,
    position_in_block,
    segment_cumsum,
    segment_sum,
    xp,
    zeros,
)
from lrmoe.selection.ranked import Ranked, design_key
from lrmoe.selection.sampling import sample_arrays


def largest_remainder(total_E: torch.Tensor, counts_SE: torch.Tensor) -> torch.Tensor:
    """Split total_E[e] over ranks in proportion to counts_SE[:, e]; floors, then the largest
    remainders (ties: lower rank) get one more. Sums exactly to total_E (capped at the counts'
    sum). Integer arithmetic: within an expert the remainders share a denominator, so they
    compare exactly and every rank derives the same split."""
    c = np.asarray(counts_SE, dtype=np.int64)
    sum_E = c.sum(0)
    t_E = np.minimum(np.asarray(total_E, dtype=np.int64), sum_E)
    share, rem = np.divmod(t_E * c, np.maximum(sum_E, 1))
    missing_E = t_E - share.sum(0)
    short = np.flatnonzero(missing_E)  # experts with remainders to hand out
    if len(short):
        W = c.shape[0]
        key = rem[:, short] * W + np.arange(W - 1, -1, -1)[:, None]  # distinct in a column: ties to the lower rank
        order = np.argsort(-key, axis=0)  # ranks by remainder
        # the first missing_e of each column get one more (a rank with a remainder is below its count)
        share[order, short] += np.arange(W)[:, None] < missing_E[short]
    return torch.from_numpy(share)


@dataclass(frozen=True)
class StrataCounts:
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
    """A :class:`StrataCounts` with this rank's strata laid out on the device."""

    counts: StrataCounts
    group_N: torch.Tensor  # int64 (N,): stratum of each pair in the forward's send order, ascending
    start_N: torch.Tensor  # int64 (N,): where each pair's stratum starts in that order
    share_G: torch.Tensor  # int64 (G,): pairs each stratum keeps


def plan_strata(assignment: PairAssignment, placement: Placement, counts_SE: torch.Tensor, quota_E: torch.Tensor,
                rank: int) -> StrataCounts:
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
    return StrataCounts(kept_SE, assignment.rows_HS[order_H, rank], sent_H[order_H], send_R,
                      torch.from_numpy(received_SL))


def strata_on(counts: StrataCounts, device: torch.device) -> Strata:
    """Lay ``counts``' strata out over this rank's pairs on ``device`` (no device→host read;
    on the host, laid out by NumPy)."""
    N, G = int(counts.sizes_G.sum()), len(counts.sizes_G)
    if device.type == "cpu":
        group_N = np.repeat(np.arange(G), counts.sizes_G)
        start_N = (np.cumsum(counts.sizes_G) - counts.sizes_G)[group_N]
        return Strata(counts, torch.from_numpy(group_N), torch.from_numpy(start_N), torch.from_numpy(counts.share_G))
    sizes = to_device(torch.from_numpy(counts.sizes_G), device)
    group_N = torch.repeat_interleave(torch.arange(G, device=device), sizes, output_size=N)
    share_G = to_device(torch.from_numpy(counts.share_G), device)
    return Strata(counts, group_N, (sizes.cumsum(0) - sizes)[group_N], share_G)


def kept_positions(keep_N: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` True entries of ``keep_N``, ascending — ``nonzero`` with its
    size known in advance, so nothing is read from the device."""
    slot = torch.where(keep_N, keep_N.long().cumsum(0) - 1, count)  # dropped entries share a spare slot
    out = torch.empty(count + 1, dtype=torch.long, device=keep_N.device)
    out[slot] = torch.arange(keep_N.numel(), device=keep_N.device)
    return out[:count]


def select_in_strata(scores_N: torch.Tensor, group_N: torch.Tensor, share_G: torch.Tensor, cfg: BackwardConfig,
                     generator: torch.Generator | None = None, ranked: Ranked | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A local selection (``cfg.local``) of this rank's pairs, kept exactly ``share_G[g]`` in
    each stratum g (``group_N``: each pair's stratum, ascending; lrmoe.selection.strata). No exchange and
    no device→host read: the shares are fixed by the counts, so every rank already knows how
    many rows each stratum sends.

    ``local-sampled`` draws each stratum's share with π ∝ score^power (weights 1/π: unbiased
    for the stratum's sum, hence for the expert's); ``local`` keeps each stratum's top share by
    score. Non-finite scores go first, in pair order; where they alone exceed a share, the
    share is kept and ``nonfinite`` (a 0-dim bool tensor, read when the stats are) is set. The
    broken gradient stays visible: a non-finite score means a non-finite routing weight, g or h,
    and the router gradient, exact for every pair, carries it.

    ``ranked``: the pairs ranked by score^``cfg.score_power`` in these strata
    (:func:`~lrmoe.selection.ranked.rank_scores`, where the caller ranked them to price the
    draw): ``local-sampled`` draws on it where every score is finite, instead of ranking again.

    Returns (keep_N, scale_N: 1/π of kept pairs, 0 elsewhere, or None for ``local``, nonfinite).
    """
    u_G = None
    if cfg.selection == "local-sampled":  # drawn first: the stream is the same on any device
        u_G = torch.rand(share_G.numel() + 1, generator=generator, dtype=torch.float64)
    device = scores_N.device
    arrays = [on_host(t) for t in (scores_N, group_N, share_G.to(device))]
    keep, scale, nonfinite = _select_arrays(*arrays, None if u_G is None else on_host(to_device(u_G, device)), cfg,
                                            ranked)
    return as_tensor(keep), None if scale is None else as_tensor(scale), torch.as_tensor(nonfinite, device=device)


def _select_arrays(scores_N: Array, group_N: Array, share_G: Array, u_G: Array | None, cfg: BackwardConfig,
                   ranked: Ranked | None) -> tuple[Array, Array | None, Array]:
    """:func:`select_in_strata` on arrays of one library (NumPy on the host, torch on a device)."""
    G, w = len(share_G), xp(scores_N)
    finite = w.isfinite(scores_N)
    if isinstance(finite, np.ndarray) and finite.all():  # the host sees at no cost that nothing is broken
        keep_nf, nonfinite = zeros(len(finite), finite, "bool"), np.False_
        rest_group, rest_G, key_N = group_N, share_G, scores_N  # (no stratum G: it would be empty)
    else:
        ranked = None  # ranked with the non-finite pairs in their strata; drawn here without them
  # non-finite pairs first in their stratum, the rest drawn in stratum G
        bad = int64(~finite)
        nf_G = segment_sum(bad, group_N, G)
        nf_rank, _ = segment_cumsum(bad, group_sizes(group_N, G))  # 1, 2, … over a stratum's non-finite
        keep_nf, nonfinite = ~finite & (nf_rank <= share_G[group_N]), (nf_G > share_G).any()
        rest_G = w.concatenate([(share_G - nf_G).clip(min=0), 0 * share_G[:1]])  # stratum G: the non-finite pairs
        rest_group = w.where(finite, group_N, G)
        key_N = w.where(finite, scores_N, 0.0)
    if u_G is not None:  # local-sampled
        keep_f, pi_N = sample_arrays(design_key(key_N, cfg.score_power), rest_group, rest_G, u_G, cfg.p_min, ranked)
        scale = w.where(keep_f, 1.0 / pi_N.clip(min=1e-300), float64(keep_nf))
    else:  # local: each stratum's top share by score, ties by pair order
        order = order_by_group_then_key(rest_group, key_N)
        pos = position_in_block(rest_group[order], group_sizes(rest_group, len(rest_G)))
        keep_f = zeros(len(finite), finite, "bool")
        keep_f[order] = pos < rest_G[rest_group[order]]
        scale = None
    return keep_f | keep_nf, scale, nonfinite
