"""A call's pairs ranked once for every score-proportional design that reads them.

The local sampler (:mod:`lrmoe.selection.sampling`) and the noise controller's design variances
(:mod:`lrmoe.selection.noise`) both lay each group's pairs out by descending key a = score^p and
read the same running sums along that order: which pairs are capped at π = 1 depends only on
each pair's key and the sum of the keys after it in its group. A call that prices and draws
ranks its pairs once (one sort, one pass of gathers and prefix sums) and hands the ranking to
both. On the host these are a few dozen small array operations whose cost is mostly the
memory they touch, cold after the expert GEMMs: ranking once took the two from 1.14 to
1.00 ms for 4096 pairs in 24 strata (docs/results.md "stages").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.selection.arrays import (
    Array,
    block_sum,
    expand,
    float64,
    group_sizes,
    on_host,
    order_by_group_then_key,
    position_in_block,
    segment_cumsum,
    xp,
)


@dataclass(frozen=True)
class Ranked:
    """N pairs in G groups by (group ascending, key descending, pair index ascending)."""

    order: Array  # int64 (N,): the pairs in that order
    g: Array  # int64 (N,): each ranked pair's group
    key: Array  # float64 (N,): each ranked pair's key (non-negative, finite)
    n_G: Array  # int64 (G,): pairs a group
    start_G: Array  # int64 (G,): a group's first ranked position
    pos: Array  # int64 (N,): each ranked pair's position in its group
    tail: Array  # float64 (N,): Σ of its group's keys from the pair to the group's end

    @property
    def end_G(self) -> Array:
        return self.start_G + self.n_G


def design_key(scores_N: Array, power: float) -> Array:
    """score^power, the default square root (and 1) without the general power's cost."""
    if power == 0.5:
        return xp(scores_N).sqrt(scores_N)
    return scores_N if power == 1 else scores_N**power


def rank_scores(scores_N: torch.Tensor, group_N: torch.Tensor, G: int, power: float) -> Ranked:
    """A call's pairs ranked by score^``power`` in the ``G`` groups of ``group_N`` (non-finite
    scores as 0), on host arrays for CPU tensors, else on their device."""
    s = on_host(scores_N)
    w = xp(s)
    return rank(design_key(w.where(w.isfinite(s), float64(s), 0.0), power), on_host(group_N), G)


def rank(key_N: Array, group_N: Array, G: int) -> Ranked:
    """Rank ``key_N`` (non-negative, finite) inside the ``G`` groups of ``group_N``."""
    k_all = float64(key_N)
    order = order_by_group_then_key(group_N, k_all)
    g, key = group_N[order], k_all[order]
    n_G = group_sizes(g, G)
    _, excl = segment_cumsum(key, n_G)  # Σ of the group's keys before the pair
    tail = expand(block_sum(key, n_G), n_G, len(key)) - excl
    return Ranked(order, g, key, n_G, n_G.cumsum(0) - n_G, position_in_block(g, n_G), tail)


__all__ = ["Ranked", "design_key", "rank", "rank_scores"]
