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
vectorised tensor operations over all groups at once (no per-group loop, no host sync), so it
runs where the scores are.
"""

from __future__ import annotations

import torch

_EDGE = 1e-9  # offsets stay this far from 0 and 1, where float rounding could shift a count


def order_by_group_then_key(groups_P: torch.Tensor, key_P: torch.Tensor) -> torch.Tensor:
    """Indices sorted by (group asc, key desc, index asc)."""
    by_key = torch.argsort(key_P, descending=True, stable=True)
    by_group = torch.argsort(groups_P[by_key], stable=True)
    return by_key[by_group]


def position_in_block(sorted_groups: torch.Tensor, sizes_G: torch.Tensor) -> torch.Tensor:
    """For ids sorted into consecutive blocks, each element's position inside its block."""
    starts = sizes_G.cumsum(0) - sizes_G
    return torch.arange(sorted_groups.numel(), device=sorted_groups.device) - starts[sorted_groups]


def group_sizes(groups_P: torch.Tensor, G: int) -> torch.Tensor:
    """Members of each of G groups (``bincount`` without its device→host read of the maximum)."""
    return torch.zeros(G, dtype=torch.long, device=groups_P.device).index_add_(0, groups_P, torch.ones_like(groups_P))


def segment_cumsum(x: torch.Tensor, groups: torch.Tensor, sizes_G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive and exclusive cumulative sums inside each block of a block-sorted vector
    (``groups``: each element's block, ascending)."""
    total = x.cumsum(0)
    start = (sizes_G.cumsum(0) - sizes_G)[groups]  # index of each element's block start
    incl = total - torch.where(start > 0, total[(start - 1).clamp(min=0)], torch.zeros_like(total))
    return incl, incl - x


def inclusion_probabilities(score_P: torch.Tensor, groups_P: torch.Tensor, quota_G: torch.Tensor,
                            floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """π per pair for groups of non-negative finite scores, Σ_group π = quota (see the module
    docstring). Returns (order, π in that order, block sizes): ``order`` sorts pairs by (group,
    score desc, index)."""
    G = quota_G.numel()
    s_all = score_P.to(torch.float64)
    order = order_by_group_then_key(groups_P, s_all)
    g, s = groups_P[order], s_all[order]
    n_G = group_sizes(groups_P, G)
    pos = position_in_block(g, n_G)
    q_G = torch.minimum(quota_G.to(n_G.device), n_G).to(torch.float64)
    q, n = q_G[g], n_G[g].to(torch.float64)
    # tail sums T_m = Σ_{i ≥ m} s_i inside each block; pair m is capped iff m < q and
    # s_m·(q − m) ≥ T_m, a prefix of the block (the condition only weakens as m grows)
    incl, excl = segment_cumsum(s, g, n_G)
    block_total = torch.zeros(G, dtype=torch.float64, device=s.device).index_add_(0, g, s)
    tail = block_total[g] - excl
    capped = (pos < q) & (s * (q - pos) >= tail) & (tail > 0)
    m_G = torch.zeros(G, dtype=torch.float64, device=s.device).index_add_(0, g, capped.to(torch.float64))
    # the rest share q − m in proportion to their scores (uniformly if their scores are all zero)
    rest_total = torch.zeros(G, dtype=torch.float64, device=s.device).index_add_(
        0, g, torch.where(capped, torch.zeros_like(s), s))
    left = (q_G - m_G)[g]
    by_score = torch.where(rest_total[g] > 0, left * s / rest_total[g].clamp(min=1e-300),
                           left / (n - m_G[g]).clamp(min=1))
    pi = torch.where(capped, torch.ones_like(s), by_score).clamp(max=1.0)
    lam = (floor * n / q.clamp(min=1)).clamp(max=1.0)
    pi = (1 - lam) * pi + lam * q / n.clamp(min=1)
    pi = _sum_to_quota(torch.where(q > 0, pi, torch.zeros_like(pi)), g, q_G)
    return order, torch.where(q >= n, torch.ones_like(pi), pi), n_G  # a group kept whole: π = 1 exactly


def _sum_to_quota(pi: torch.Tensor, g: torch.Tensor, q_G: torch.Tensor) -> torch.Tensor:
    """π with each group's sum exactly its quota, every π still in [0, 1].

    In exact arithmetic the capped π above already sum to q. In floats they may not: the tail
    sums come from one cumulative sum over every group, so a tail of scores many orders of
    magnitude below the ones before it is lost in rounding, a pair that should be capped is not,
    and its group sums short of q (at q = n, some pair gets π < 1). The systematic sample would
    then keep fewer than q — and a local selection's split sizes rely on exactly q. A deficit is
    handed to each pair in proportion to its room 1 − π (never past 1: the rooms sum to
    n − Σπ ≥ q − Σπ); an excess scales the group down. Any π in [0, 1] summing to q is an exact
    inclusion probability of the sample drawn with it, so the 1/π weights stay unbiased."""
    G = q_G.numel()
    total_G = torch.zeros(G, dtype=pi.dtype, device=pi.device).index_add_(0, g, pi)
    room_G = torch.zeros_like(total_G).index_add_(0, g, 1 - pi)
    deficit = (q_G - total_G)[g]
    topped = pi + deficit.clamp(min=0) * (1 - pi) / room_G[g].clamp(min=1e-300)
    scaled = pi * (q_G / total_G.clamp(min=1e-300))[g]
    return torch.where(deficit > 0, topped, scaled).clamp(0.0, 1.0)


def systematic_sample(order: torch.Tensor, pi_sorted: torch.Tensor, groups_P: torch.Tensor, sizes_G: torch.Tensor,
                      quota_G: torch.Tensor, u_G: torch.Tensor) -> torch.Tensor:
    """Keep mask (over the original pairs) of a systematic sample: block g's points
    u_g + j, j < quota_g, on the line of its pairs' intervals (see the module docstring)."""
    g = groups_P[order]
    q_G = torch.minimum(quota_G.to(sizes_G.device), sizes_G).to(torch.float64)
    total_G = torch.zeros_like(q_G).index_add_(0, g, pi_sorted)
    # rescale each block's line to length exactly q (float rounding of Σ π), so the q points fit
    scaled = pi_sorted * torch.where(total_G > 0, q_G / total_G.clamp(min=1e-300), torch.zeros_like(q_G))[g]
    incl, excl = segment_cumsum(scaled, g, sizes_G)
    u = (u_G.to(q_G) * (1 - 2 * _EDGE) + _EDGE)[g]
    hits = torch.ceil(incl - u) - torch.ceil(excl - u)  # points in (excl, incl] shifted by u
    keep = torch.zeros(order.numel(), dtype=torch.bool, device=order.device)
    keep[order] = hits >= 1
    return keep


def sample(score_P: torch.Tensor, groups_P: torch.Tensor, quota_G: torch.Tensor, u_G: torch.Tensor,
           floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Exactly min(quota_g, n_g) pairs of each group g kept, π ∝ score (capped, floored);
    returns (keep_P, π_P) over the original pair order."""
    order, pi_sorted, n_G = inclusion_probabilities(score_P, groups_P, quota_G, floor)
    keep = systematic_sample(order, pi_sorted, groups_P, n_G, quota_G, u_G)
    pi = torch.empty_like(pi_sorted)
    pi[order] = pi_sorted
    return keep, pi
