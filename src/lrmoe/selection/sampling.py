"""Fixed-size unbiased sampling: exactly q pairs of a group kept, each with a known inclusion
probability π, so that weighting kept contributions by 1/π (Horvitz–Thompson) estimates the
group's full sum without bias (docs/design.md "Selections").

Inclusion probabilities are proportional to the score, capped at 1 (the pairs whose scaled
score reaches 1 are kept for sure, the rest share what is left of q in proportion to their
scores), then mixed with the uniform q/n: π = (1 − λ)·π_score + λ·q/n with
λ = min(1, floor·n/q), so that no pair's probability falls below min(floor, q/n). Both parts
sum to q and lie in [0, 1], so π does too.

Systematic sampling then keeps exactly q: the pairs of a group are laid end to end on a line
in order of descending score, pair i covering an interval of length π_i; one uniform offset u
in (0, 1) and the points u, u + 1, …, u + q − 1 pick the pairs whose intervals they fall in.
Every pair is picked with probability exactly π_i and at most once (π_i ≤ 1); ordering by score
stratifies the draw, so high- and low-score pairs are both represented. Everything is a few
vectorised operations over all groups at once (no per-group loop, no host sync), written once
for NumPy arrays (the host) and torch tensors (a device) (:mod:`lrmoe.selection.arrays`).
"""

from __future__ import annotations

import torch

from lrmoe.selection.arrays import (
    Array,
    as_tensor,
    block_sum,
    expand,
    float64,
    group_sizes,
    on_host,
    order_by_group_then_key,
    position_in_block,
    segment_cumsum,
    xp,
    zeros,
)
from lrmoe.selection.ranked import Ranked, rank

_EDGE = 1e-9  # offsets stay this far from 0 and 1, where float rounding could shift a count

__all__ = ["group_sizes", "inclusion_probabilities", "order_by_group_then_key", "position_in_block", "sample",
           "segment_cumsum", "systematic_sample"]


def inclusion_probabilities(score_P: Array, groups_P: Array, quota_G: Array, floor: float,
                            ranked: Ranked | None = None) -> tuple[Array, Array, Array]:
    """π per pair for groups of non-negative finite scores, Σ_group π = quota (see the module
    docstring). Returns (order, π in that order, block sizes): ``order`` sorts pairs by (group,
    score desc, index). ``ranked``: these scores already ranked in these groups (the caller's
    :func:`~lrmoe.selection.ranked.rank`), else ranked here.

    What depends on the group alone is worked out per group and spread over its pairs as one
    ``π·a_g + b_g`` (:func:`_per_group`): a few passes over the pairs instead of a few dozen."""
    G, w = len(quota_G), xp(score_P)
    r = ranked if ranked is not None else rank(score_P, groups_P, G)
    s, n_G, N = r.key, r.n_G, len(r.key)
    q_G, n = float64(w.minimum(quota_G, n_G)), float64(n_G)
    q = expand(q_G, n_G, N)
    # pair m (tail sum T_m = Σ_{i ≥ m} s_i in its block) is capped iff m < q and
    # s_m·(q − m) ≥ T_m, a prefix of the block (the condition only weakens as m grows)
    capped = (r.pos < q) & (s * (q - r.pos) >= r.tail) & (r.tail > 0)
    m_G = block_sum(float64(capped), n_G)
    # the rest share q − m in proportion to their scores (uniformly if their scores are all zero)
    rest_G, left_G = block_sum(s * ~capped, n_G), q_G - m_G
    by_score = rest_G > 0
    pi = _per_group(s, n_G, w.where(by_score, left_G / rest_G.clip(min=1e-300), 0.0),
                    w.where(by_score, 0.0, left_G / (n - m_G).clip(min=1))).clip(max=1.0)
    pi[capped] = 1.0
    # mixed with the uniform q/n (λ = floor·n/q, at most 1); a group that keeps nothing: π = 0
    lam_G = (floor * n / q_G.clip(min=1)).clip(max=1.0)
    pi = _per_group(pi, n_G, w.where(q_G > 0, 1 - lam_G, 0.0), lam_G * q_G / n.clip(min=1))
    return r.order, _sum_to_quota(pi, n_G, q_G), n_G


def _per_group(x: Array, sizes_G: Array, a_G: Array, b_G: Array) -> Array:
    """x·a_g + b_g for each element x of block g (block-sorted, ``sizes_G`` a block)."""
    return x * expand(a_G, sizes_G, len(x)) + expand(b_G, sizes_G, len(x))


def _sum_to_quota(pi: Array, sizes_G: Array, q_G: Array) -> Array:
    """π with each group's sum exactly its quota, every π still in [0, 1]; a group kept whole
    gets π = 1 exactly (block-sorted π, ``sizes_G`` a group).

    In exact arithmetic the capped π above already sum to q. In floats they may not: the tail
    sums come from one cumulative sum over every group, so a tail of scores many orders of
    magnitude below the ones before it is lost in rounding, a pair that should be capped is not,
    and its group sums short of q (at q = n, some pair gets π < 1). The systematic sample would
    then keep fewer than q — and a local selection's split sizes rely on exactly q. A deficit is
    handed to each pair in proportion to its room 1 − π (π + t·(1 − π), t = deficit / room, never
    past 1: the rooms sum to n − Σπ ≥ q − Σπ); an excess scales the group down. Any π in [0, 1]
    summing to q is an exact inclusion probability of the sample drawn with it, so the 1/π
    weights stay unbiased."""
    w, n = xp(pi), float64(sizes_G)
    total_G = block_sum(pi, sizes_G)
    deficit_G = q_G - total_G
    short = deficit_G > 0
    t_G = w.where(short, deficit_G / block_sum(1 - pi, sizes_G).clip(min=1e-300), 0.0)
    scale_G = w.where(short, 1 - t_G, q_G / total_G.clip(min=1e-300))
    whole = q_G >= n  # π = 1 exactly, whatever the rounding
    return _per_group(pi, sizes_G, w.where(whole, 0.0, scale_G), w.where(whole, 1.0, t_G)).clip(0.0, 1.0)


def systematic_sample(order: Array, pi_sorted: Array, sizes_G: Array, quota_G: Array, u_G: Array) -> Array:
    """Keep mask (over the original pairs) of a systematic sample: block g's points
    u_g + j, j < quota_g, on the line of its pairs' intervals (see the module docstring);
    ``pi_sorted`` in ``order``, blocks of ``sizes_G`` pairs; ``u_G`` an offset a block, any after
    the last unread (a local selection draws one for its non-finite stratum whether it has one)."""
    w, N = xp(pi_sorted), len(pi_sorted)
    q_G = float64(w.minimum(quota_G, sizes_G))
    total_G = block_sum(pi_sorted, sizes_G)
    # rescale each block's line to length exactly q (float rounding of Σ π), so the q points fit
    scaled = pi_sorted * expand(w.where(total_G > 0, q_G / total_G.clip(min=1e-300), 0.0), sizes_G, N)
    incl, excl = segment_cumsum(scaled, sizes_G)
    u = expand(float64(u_G[:len(sizes_G)]) * (1 - 2 * _EDGE) + _EDGE, sizes_G, N)
    hits = w.ceil(incl - u) - w.ceil(excl - u)  # points in (excl, incl] shifted by u
    keep = zeros(N, order, "bool")
    keep[order] = hits >= 1
    return keep


def sample_arrays(score_P: Array, groups_P: Array, quota_G: Array, u_G: Array, floor: float,
                  ranked: Ranked | None = None) -> tuple[Array, Array]:
    """:func:`sample` on arrays of one library (NumPy on the host, torch on a device);
    ``ranked`` as :func:`inclusion_probabilities` takes it."""
    r = ranked if ranked is not None else rank(score_P, groups_P, len(quota_G))
    order, pi_sorted, n_G = inclusion_probabilities(score_P, groups_P, quota_G, floor, r)
    keep = systematic_sample(order, pi_sorted, n_G, quota_G, u_G)
    pi = 0 * pi_sorted
    pi[order] = pi_sorted
    return keep, pi


def sample(score_P: torch.Tensor, groups_P: torch.Tensor, quota_G: torch.Tensor, u_G: torch.Tensor,
           floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly min(quota_g, n_g) pairs of each group g kept, π ∝ score (capped, floored);
    returns (keep_P, π_P) over the original pair order. CPU tensors are sampled through NumPy
    (:mod:`lrmoe.selection.arrays`), device tensors where they are."""
    device = score_P.device
    host = [on_host(t.to(device)) for t in (score_P, groups_P, quota_G, u_G)]
    keep, pi = sample_arrays(*host, floor)
    return as_tensor(keep), as_tensor(pi)
