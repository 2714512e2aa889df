"""Which token–expert pairs the LRMoE backward keeps.

LRM score of pair (t, e): the squared Frobenius norm of its contribution to expert e's
down-projection weight gradient. That contribution is the outer product (w_te·g_t) ⊗ h_te, so

    score(t, e) = w_te² · ‖g_t‖² · ‖h_te‖²

and no gradient matrix is formed. Scores are float64: finite fp32/bf16 inputs cannot overflow.

Selection order of the global selections (identical on every rank): higher score first; equal
scores by lower (rank, token, k slot). Non-finite scores rank above every finite one and count
toward the quota; if they alone exceed it, all of them are kept (the quota grows) and
``nonfinite`` is reported — a broken gradient is never hidden by dropping it. The local
selections keep exactly their shares (nothing is exchanged that could grow them): non-finite
pairs first, ``nonfinite`` reported where they exceed a share, the gradient still non-finite
(the router gradient is exact for every pair; see :func:`select_in_strata`).

Exact global top-q_e exchanges scalars, never rows: each rank sends, per expert, only its own
best ``min(q_e, c_{e,r})`` scores (no rank can contribute more to a global top-q_e), sorted in
selection order, so the receivers can merge them without pair ids. Candidate counts follow
from the per-(rank, expert) counts every rank already has from the forward.

Selections (``BackwardConfig.selection``): ``lrm`` the exact global top-q_e above (the paper's);
``random`` q_e uniformly at random, unweighted; ``local`` each rank its largest-remainder share of
q_e by its own scores; ``sampled`` an unbiased fixed-size sample of exactly q_e pairs across
ranks with π ∝ score, contributions weighted by 1/π (all scores exchanged); ``local-sampled``
the same drawn per source rank from its largest-remainder share — unbiased, exactly q_e, and
no exchange at all (lrmoe.selection.sampling). The two local ones draw in strata, each source's share
split once more over the ranks that computed its pairs in the forward (lrmoe.selection.strata), so every
kept count is known from the plan before any row moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.config import BackwardConfig
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Group, WireCounter
from lrmoe.selection.sampling import group_sizes, order_by_group_then_key, position_in_block, sample, segment_cumsum


def fixed_ratio_quota(counts_E: torch.Tensor, ratio: float) -> torch.Tensor:
    """q_e = min(c_e, max(1, ceil(ρ·c_e − 1e-6))) for c_e > 0, else 0 (float64; the epsilon
    keeps 0.1·30 from becoming 4)."""
    c = counts_E.to(torch.float64)
    q = torch.clamp(torch.ceil(ratio * c - 1e-6), min=1.0)
    q = torch.minimum(q, c)
    return torch.where(counts_E > 0, q, torch.zeros_like(q)).to(torch.long)


def squared_norms(x_RD: torch.Tensor) -> torch.Tensor:
    """‖x_r‖² per row in float64, finite for finite inputs. On the CPU one fp32 pass, with the
    rows whose fp32 norm overflowed redone in float64; on CUDA that check would be a
    device→host read, so :func:`scaled_squared_norms` instead."""
    if x_RD.is_cuda:
        return scaled_squared_norms(x_RD)
    sq = torch.linalg.vector_norm(x_RD, dim=-1).to(torch.float64).square()
    bad = ~torch.isfinite(sq)
    if bad.any():
        sq[bad] = x_RD[bad].to(torch.float64).square().sum(-1)
    return sq


def scaled_squared_norms(x_RD: torch.Tensor) -> torch.Tensor:
    """‖x_r‖² per row in float64 with nothing read back: each row is first scaled by the power
    of two (exact) that brings its largest entry into [1, 2), so the fp32 pass cannot overflow."""
    peak = x_RD.abs().amax(-1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(-torch.floor(torch.log2(peak)))
    low_range = x_RD.dtype not in (torch.bfloat16, torch.float32, torch.float64)  # fp16: 2^±126 overflows it
    work = x_RD.float() if low_range else x_RD
    norm = torch.linalg.vector_norm(work * scale.to(work.dtype), dim=-1, dtype=torch.float32)
    return (norm.to(torch.float64) / scale.squeeze(-1).to(torch.float64)).square()


def lrm_scores(weights_P: torch.Tensor, g_sq_P: torch.Tensor, h_sq_P: torch.Tensor) -> torch.Tensor:
    """w² · ‖g‖² · ‖h‖² per pair, float64."""
    return weights_P.detach().to(torch.float64).square() * g_sq_P * h_sq_P


@dataclass(frozen=True)
class Selection:
    keep_P: torch.Tensor  # bool over this rank's pairs (flattened T·K)
    kept_SE: torch.Tensor  # int64 (W, E): kept pairs per source rank and expert, on every rank
    quota_E: torch.Tensor  # int64 (E,): the quota actually applied (grown by non-finite pairs)
    scale_P: torch.Tensor | None  # sampled: 1/p for kept pairs (None: all contributions × 1)
    nonfinite: bool | torch.Tensor  # non-finite scores alone exceeded a quota (local: a share; a device flag)


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
    """Choose the kept pairs of this rank for the backward with a global selection (``lrm``,
    ``random``, ``sampled``; collective over ``group``); the local ones draw in strata,
    :func:`select_in_strata`.

    ``generator`` draws this rank's random numbers; ``shared_generator`` those every rank must
    draw alike (the offsets of a global sample): seeded the same on every rank."""
    if cfg.local:
        raise ValueError(f"select: selection {cfg.selection!r} is local: use select_in_strata")
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

    if cfg.selection == "random":
        key_P = torch.rand(scores_P.shape, generator=generator, dtype=torch.float64).to(device)
    else:
        key_P = scores_P
    key_P = torch.where(finite_P, key_P, torch.full_like(key_P, math.inf))
    order = order_by_group_then_key(ids_P, key_P)
    counts_E_mine = counts_SE[me]
    pos = position_in_block(ids_P[order], counts_E_mine.to(device))

    if W == 1:  # the local top-q_e is the global one
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


def select_in_strata(scores_N: torch.Tensor, group_N: torch.Tensor, share_G: torch.Tensor, cfg: BackwardConfig,
                     generator: torch.Generator | None = None
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

    Returns (keep_N, scale_N: 1/π of kept pairs, 0 elsewhere, or None for ``local``, nonfinite).
    """
    G = share_G.numel()
    finite = torch.isfinite(scores_N)
    bad = (~finite).long()
    nf_G = torch.zeros(G, dtype=torch.long, device=scores_N.device).index_add_(0, group_N, bad)
    nf_rank, _ = segment_cumsum(bad, group_N, group_sizes(group_N, G))  # 1, 2, … over a stratum's non-finite pairs
    keep_nf = ~finite & (nf_rank <= share_G[group_N])
    rest_G = torch.cat([(share_G - nf_G).clamp(min=0), share_G.new_zeros(1)])  # stratum G: the non-finite pairs
    rest_group = torch.where(finite, group_N, G)
    key_N = torch.where(finite, scores_N, torch.zeros_like(scores_N))
    if cfg.selection == "local-sampled":
        u_G = comm.to_device(torch.rand(G + 1, generator=generator, dtype=torch.float64), scores_N.device)
        keep_f, pi_N = sample(key_N.pow(cfg.score_power), rest_group, rest_G, u_G, cfg.p_min)
        scale = torch.where(keep_f, 1.0 / pi_N.clamp(min=1e-300), keep_nf.to(pi_N.dtype))
    else:  # local: each stratum's top share by score, ties by pair order
        order = order_by_group_then_key(rest_group, key_N)
        pos = position_in_block(rest_group[order], group_sizes(rest_group, G + 1))
        keep_f = torch.zeros_like(finite)
        keep_f[order] = pos < rest_G[rest_group[order]]
        scale = None
    return keep_f | keep_nf, scale, (nf_G > share_G).any()


def _weighted(keep_P: torch.Tensor, pi_P: torch.Tensor, finite_P: torch.Tensor) -> torch.Tensor:
    """Horvitz–Thompson factors: 1/π for kept sampled pairs, 1 for non-finite ones (always kept)."""
    scale = torch.where(keep_P, 1.0 / pi_P.clamp(min=1e-300), torch.zeros_like(pi_P))
    return torch.where(finite_P, scale, torch.ones_like(scale))


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
