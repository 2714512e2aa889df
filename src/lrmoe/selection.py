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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lrmoe import comm
from lrmoe.comm import Group, WireCounter
from lrmoe.config import BackwardConfig


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


def _order_by_expert_then_key(ids_P: torch.Tensor, key_P: torch.Tensor) -> torch.Tensor:
    """Pair indices sorted by (expert asc, key desc, pair index asc)."""
    by_key = torch.argsort(key_P, descending=True, stable=True)
    by_expert = torch.argsort(ids_P[by_key], stable=True)
    return by_key[by_expert]


def _position_in_block(sorted_block_ids: torch.Tensor, block_sizes: torch.Tensor) -> torch.Tensor:
    """For ids sorted into consecutive blocks, each element's position inside its block."""
    starts = block_sizes.cumsum(0) - block_sizes
    return torch.arange(sorted_block_ids.numel(), device=sorted_block_ids.device) - starts[sorted_block_ids]


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
) -> Selection:
    """Choose the kept pairs of this rank for the backward (collective over ``group``)."""
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
        return _sampled(scores_P, finite_P, ids_P, counts_SE, quota_E, cfg, group, wire, generator, nonfinite)

    if cfg.selection == "random":
        key_P = torch.rand(scores_P.shape, generator=generator, dtype=torch.float64).to(device)
    else:
        key_P = scores_P
    key_P = torch.where(finite_P, key_P, torch.full_like(key_P, math.inf))
    order = _order_by_expert_then_key(ids_P, key_P)
    counts_E_mine = counts_SE[me]
    pos = _position_in_block(ids_P[order], counts_E_mine.to(device))

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
        merged = _order_by_expert_then_key(expert, all_keys)
        pos_g = _position_in_block(expert[merged], cand_SE.sum(0))
        kept = merged[pos_g < quota_E[expert[merged]]]
        kept_SE = torch.bincount(src[kept] * E + expert[kept], minlength=W * E).view(W, E)

    keep_sorted = pos < kept_SE[me].to(device)[ids_P[order]]
    keep_P = torch.zeros_like(finite_P)
    keep_P[order[keep_sorted]] = True
    return Selection(keep_P, kept_SE, quota_E, None, nonfinite)


def _sampled(scores_P, finite_P, ids_P, counts_SE, quota_E, cfg, group, wire, generator, nonfinite):
    """Keep pair i with probability p_i = clamp(c_e·s_i, p_min, 1) (1 for non-finite scores),
    c_e set so that Σ_i p_i = q_e over expert e's pairs on all ranks; kept contributions are
    scaled by 1/p_i, an unbiased estimate of the full expert gradient. Where the floor alone
    exceeds q_e every pair has p = p_min; an expert whose scores are all zero is sampled
    uniformly with p = max(p_min, q_e / c_e).

    Every rank needs all scores of an expert to find c_e: each sends its scores sorted by
    expert (non-finite as +inf), so the receivers know each score's expert from the counts.
    """
    W, E = counts_SE.shape
    device = scores_P.device
    ids_cpu = ids_P.cpu()
    key_P = torch.where(finite_P, scores_P, torch.full_like(scores_P, math.inf)).cpu()
    by_expert = torch.argsort(ids_cpu, stable=True)
    all_keys = comm.all_gather(key_P[by_expert], counts_SE.sum(1).tolist(), group, wire)
    all_ids = torch.repeat_interleave(torch.arange(E).repeat(W), counts_SE.reshape(-1))
    scale_E = _water_fill(all_keys, all_ids, quota_E, cfg.p_min, E)
    p_P = _probabilities(key_P, ids_cpu, scale_E, quota_E, counts_SE.sum(0), cfg.p_min)
    keep_P = torch.rand(p_P.shape, generator=generator, dtype=torch.float64) < p_P
    kept_local_E = torch.bincount(ids_cpu[keep_P], minlength=E)
    kept_SE = comm.all_gather(kept_local_E.view(1, E), [1] * W, group, wire)
    scale_P = torch.where(keep_P, 1.0 / p_P, torch.zeros_like(p_P))
    return Selection(keep_P.to(device), kept_SE, quota_E, scale_P.to(device), nonfinite)


def _probabilities(key_P, ids_P, scale_E, quota_E, counts_E, p_min):
    """Keep probabilities of this rank's pairs (see :func:`_sampled`)."""
    uniform_E = (quota_E.to(torch.float64) / counts_E.clamp(min=1).to(torch.float64)).clamp(min=p_min)
    c = scale_E[ids_P]
    p = torch.where(torch.isnan(c), uniform_E[ids_P], (c * key_P).clamp(min=p_min, max=1.0))
    return torch.where(torch.isfinite(key_P), p, torch.ones_like(p)).clamp(max=1.0)


def _water_fill(all_keys, all_ids, quota_E, p_min, E, iters: int = 100):
    """Per expert, the c with Σ clamp(c·s_i, p_min, 1) = q_e (non-finite pairs count 1); NaN
    where every finite score is zero. Bisection in float64 on [0, 1/min positive score]: at the
    upper end every positive score has p = 1."""
    fin = torch.isfinite(all_keys)
    budget_E = quota_E.to(torch.float64) - torch.bincount(all_ids[~fin], minlength=E).to(torch.float64)
    s, ids = all_keys[fin], all_ids[fin]
    zeros = torch.zeros(E, dtype=torch.float64)
    smax_E = zeros.scatter_reduce(0, ids, s, "amax")
    pos = s > 0
    smin_E = torch.full((E,), math.inf, dtype=torch.float64).scatter_reduce(0, ids[pos], s[pos], "amin")
    lo, hi = zeros.clone(), torch.where(torch.isfinite(smin_E), 1.0 / smin_E, torch.ones_like(zeros))
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        total = zeros.index_add(0, ids, (mid[ids] * s).clamp(p_min, 1.0))
        too_many = total > budget_E
        hi, lo = torch.where(too_many, mid, hi), torch.where(too_many, lo, mid)
    return torch.where(smax_E > 0, 0.5 * (lo + hi), torch.full_like(lo, math.nan))
