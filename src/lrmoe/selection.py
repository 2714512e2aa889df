"""Which token–expert pairs the LRMoE backward keeps.

LRM score of pair (t, e): the squared Frobenius norm of its contribution to expert e's
down-projection weight gradient. That contribution is the outer product (w_te·g_t) ⊗ h_te, so

    score(t, e) = w_te² · ‖g_t‖² · ‖h_te‖²

and no gradient matrix is formed. Scores are float64: finite fp32/bf16 inputs cannot overflow.

Selection order (identical on every rank): higher score first; equal scores by lower (rank,
token, k slot). Non-finite scores rank above every finite one and count toward the quota; if
they alone exceed it, all of them are kept (the quota grows) and ``nonfinite`` is reported —
a broken gradient is never hidden by dropping it.

Exact global top-q_e exchanges scalars, never rows: each rank sends, per expert, only its own
best ``min(q_e, c_{e,r})`` scores (no rank can contribute more to a global top-q_e), sorted in
selection order, so the receivers can merge them without pair ids. Candidate counts follow
from the per-(rank, expert) counts every rank already has from the forward.

Selections (``BackwardConfig.selection``): ``lrm`` the exact global top-q_e above (the paper's);
``random`` q_e uniformly at random, unweighted; ``local`` each rank its largest-remainder share of
q_e by its own scores; ``sampled`` an unbiased fixed-size sample of exactly q_e pairs across
ranks with π ∝ score, contributions weighted by 1/π (all scores exchanged); ``local-sampled``
the same drawn per source rank from its largest-remainder share — unbiased, exactly q_e, and
no score exchange (lrmoe.sampling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lrmoe import comm
from lrmoe.comm import Group, WireCounter
from lrmoe.config import BackwardConfig
from lrmoe.sampling import order_by_group_then_key, position_in_block, sample


def fixed_ratio_quota(counts_E: torch.Tensor, ratio: float) -> torch.Tensor:
    """q_e = min(c_e, max(1, ceil(ρ·c_e − 1e-6))) for c_e > 0, else 0 (float64; the epsilon
    keeps 0.1·30 from becoming 4)."""
    c = counts_E.to(torch.float64)
    q = torch.clamp(torch.ceil(ratio * c - 1e-6), min=1.0)
    q = torch.minimum(q, c)
    return torch.where(counts_E > 0, q, torch.zeros_like(q)).to(torch.long)


def squared_norms(x_RD: torch.Tensor) -> torch.Tensor:
    """‖x_r‖² per row in float64. One fp32 pass; rows whose fp32 norm overflowed are redone in
    float64, so finite inputs always give finite results."""
    sq = torch.linalg.vector_norm(x_RD, dim=-1).to(torch.float64).square()
    bad = ~torch.isfinite(sq)
    if bad.any():
        sq[bad] = x_RD[bad].to(torch.float64).square().sum(-1)
    return sq


def lrm_scores(weights_P: torch.Tensor, g_sq_P: torch.Tensor, h_sq_P: torch.Tensor) -> torch.Tensor:
    """w² · ‖g‖² · ‖h‖² per pair, float64."""
    return weights_P.detach().to(torch.float64).square() * g_sq_P * h_sq_P


@dataclass(frozen=True)
class Selection:
    keep_P: torch.Tensor  # bool over this rank's pairs (flattened T·K)
    kept_SE: torch.Tensor  # int64 (W, E): kept pairs per source rank and expert, on every rank
    quota_E: torch.Tensor  # int64 (E,): the quota actually applied (grown by non-finite pairs)
    scale_P: torch.Tensor | None  # sampled: 1/p for kept pairs (None: all contributions × 1)
    nonfinite: bool  # non-finite scores alone exceeded some expert's quota


def largest_remainder(total_E: torch.Tensor, counts_SE: torch.Tensor) -> torch.Tensor:
    """Split total_E[e] over ranks in proportion to counts_SE[:, e]; floors, then the largest
    remainders (ties: lower rank) get one more. Sums exactly to total_E."""
    c = counts_SE.to(torch.float64)
    exact = total_E.to(torch.float64) * c / c.sum(0).clamp(min=1)
    share = torch.floor(exact + 1e-9).to(torch.long).clamp(max=counts_SE)
    missing = total_E - share.sum(0)
    rem = exact - share
    rem = torch.where(share < counts_SE, rem, torch.full_like(rem, -1.0))  # full ranks get no more
    W = counts_SE.shape[0]
    order = torch.argsort(-rem, dim=0, stable=True)  # (W, E): ranks by remainder, ties lower rank
    rank_pos = torch.empty_like(order)
    rank_pos.scatter_(0, order, torch.arange(W).unsqueeze(1).expand_as(order))
    return share + (rank_pos < missing.unsqueeze(0)).to(torch.long)


def select(
    scores_P: torch.Tensor,
    ids_P: torch.Tensor,
    counts_SE: torch.Tensor,
    quota_E: torch.Tensor,
    cfg: BackwardConfig,
    group: Group,
    wire: WireCounter,
    generator: torch.Generator | None = None,
    shared_generator: torch.Generator | None = None,
) -> Selection:
    """Choose the kept pairs of this rank for the backward (collective over ``group``).

    ``generator`` draws this rank's random numbers; ``shared_generator`` those every rank must
    draw alike (the offsets of a global sample): seeded the same on every rank."""
    W, E = counts_SE.shape
    me = comm.rank_of(group)
    device = scores_P.device
    finite_P = torch.isfinite(scores_P)
    nf_local_E = torch.bincount(ids_P[~finite_P], minlength=E).cpu()
    nf_SE = comm.all_gather(nf_local_E.view(1, E), [1] * W, group, wire)
    nf_E = nf_SE.sum(0)
    nonfinite = bool((nf_E > quota_E).any())
    quota_E = torch.maximum(quota_E, nf_E)

    if cfg.selection == "sampled":
        return _sampled_global(scores_P, finite_P, ids_P, counts_SE, quota_E, nf_SE, cfg, group, wire,
                               shared_generator, nonfinite)
    if cfg.selection == "local-sampled":
        return _sampled_local(scores_P, finite_P, ids_P, counts_SE, quota_E, nf_SE, cfg, me, generator, nonfinite)

    if cfg.selection == "random":
        key_P = torch.rand(scores_P.shape, generator=generator, dtype=torch.float64).to(device)
    else:
        key_P = scores_P
    key_P = torch.where(finite_P, key_P, torch.full_like(key_P, math.inf))
    order = order_by_group_then_key(ids_P, key_P)
    counts_E_mine = counts_SE[me]
    pos = position_in_block(ids_P[order], counts_E_mine.to(device))

    if cfg.selection == "local":
        # Non-finite pairs first, then the rest of q_e apportioned by finite local counts.
        kept_SE = largest_remainder(quota_E - nf_E, counts_SE - nf_SE) + nf_SE
    elif W == 1:  # the local top-q_e is the global one
        kept_SE = quota_E.view(1, E).clone()
    else:  # exact global top-q_e by merging every rank's candidates
        cand_SE = torch.minimum(quota_E.unsqueeze(0), counts_SE)
        mine = order[pos < cand_SE[me].to(device)[ids_P[order]]]
        all_keys = comm.all_gather(key_P[mine].cpu(), cand_SE.sum(1).tolist(), group, wire)
        src = torch.repeat_interleave(torch.arange(W), cand_SE.sum(1))
        expert = torch.repeat_interleave(torch.arange(E).repeat(W), cand_SE.reshape(-1))
        merged = order_by_group_then_key(expert, all_keys)
        pos_g = position_in_block(expert[merged], cand_SE.sum(0))
        kept = merged[pos_g < quota_E[expert[merged]]]
        kept_SE = torch.bincount(src[kept] * E + expert[kept], minlength=W * E).view(W, E)

    keep_sorted = pos < kept_SE[me].to(device)[ids_P[order]]
    keep_P = torch.zeros_like(finite_P)
    keep_P[order[keep_sorted]] = True
    return Selection(keep_P, kept_SE, quota_E, None, nonfinite)


def _weighted(keep_P: torch.Tensor, pi_P: torch.Tensor, finite_P: torch.Tensor) -> torch.Tensor:
    """Horvitz–Thompson factors: 1/π for kept sampled pairs, 1 for non-finite ones (always kept)."""
    scale = torch.where(keep_P, 1.0 / pi_P.clamp(min=1e-300), torch.zeros_like(pi_P))
    return torch.where(finite_P, scale, torch.ones_like(scale))


def _sampled_local(scores_P, finite_P, ids_P, counts_SE, quota_E, nf_SE, cfg, me, generator, nonfinite):
    """Unbiased fixed-size sample with no score exchange: each expert's quota (less its
    non-finite pairs, always kept) is split over source ranks in proportion to their finite
    pairs (largest remainder), and each rank draws its exact share from its own pairs with
    π ∝ score (lrmoe.sampling). Each rank's draw is unbiased for its own pairs' sum, so the
    sum over ranks is unbiased for the expert's; exactly q_e are kept."""
    E = counts_SE.shape[1]
    device = scores_P.device
    share_SE = largest_remainder(quota_E - nf_SE.sum(0), counts_SE - nf_SE)
    u_E = torch.rand(E, generator=generator, dtype=torch.float64).to(device)
    fin = finite_P.nonzero().squeeze(1)
    keep_f, pi_f = sample(scores_P[fin].pow(cfg.score_power), ids_P[fin], share_SE[me].to(device), u_E, cfg.p_min)
    keep_P, pi_P = ~finite_P, torch.ones_like(scores_P, dtype=torch.float64)
    keep_P[fin], pi_P[fin] = keep_f, pi_f
    return Selection(keep_P, share_SE + nf_SE, quota_E, _weighted(keep_P, pi_P, finite_P), nonfinite)


def _sampled_global(scores_P, finite_P, ids_P, counts_SE, quota_E, nf_SE, cfg, group, wire, shared_generator,
                    nonfinite):
    """Unbiased fixed-size sample over every rank's pairs of an expert: exactly q_e kept, π ∝
    score across ranks. Each rank sends its finite scores sorted by expert (the receivers know
    each score's expert and source from the counts); every rank then draws the same sample
    with the same offsets and keeps its own part."""
    W, E = counts_SE.shape
    me = comm.rank_of(group)
    device = scores_P.device
    fin = finite_P.nonzero().squeeze(1)
    ids_f = ids_P[fin]
    by_expert = torch.argsort(ids_f, stable=True)
    fin_SE = counts_SE - nf_SE
    all_scores = comm.all_gather(scores_P[fin][by_expert].cpu(), fin_SE.sum(1).tolist(), group, wire)
    all_ids = torch.repeat_interleave(torch.arange(E).repeat(W), fin_SE.reshape(-1))
    u_E = torch.rand(E, generator=shared_generator, dtype=torch.float64)
    keep_all, pi_all = sample(all_scores.pow(cfg.score_power), all_ids, quota_E - nf_SE.sum(0), u_E, cfg.p_min)
    src = torch.repeat_interleave(torch.arange(W), fin_SE.sum(1))
    kept_SE = torch.bincount(src[keep_all] * E + all_ids[keep_all], minlength=W * E).view(W, E) + nf_SE
    start = int(fin_SE[:me].sum())
    mine = slice(start, start + int(fin_SE[me].sum()))
    keep_P, pi_P = ~finite_P, torch.ones_like(scores_P, dtype=torch.float64)
    keep_P[fin[by_expert]] = keep_all[mine].to(device)
    pi_P[fin[by_expert]] = pi_all[mine].to(device)
    return Selection(keep_P, kept_SE, quota_E, _weighted(keep_P, pi_P, finite_P), nonfinite)
