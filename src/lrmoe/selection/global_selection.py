"""The global selections of the LRMoE backward: kept sets chosen across ranks by exchanging
scores (never rows).

Selection order (identical on every rank): higher score first; equal scores by lower (rank,
token, k slot). Non-finite scores rank above every finite one and count toward the quota; if
they alone exceed it, all of them are kept (the quota grows) and ``nonfinite`` is reported — a
broken gradient is never hidden by dropping it.

Exact global top-q_e exchanges scalars, never rows: each rank sends, per expert, only its own
best ``min(q_e, c_{e,r})`` scores (no rank can contribute more to a global top-q_e), sorted in
selection order, so the receivers can merge them without pair ids. Candidate counts follow
from the per-(rank, expert) counts every rank already has from the forward.

Selections (``BackwardConfig.selection``): ``lrm`` the exact global top-q_e above (the paper's);
``random`` q_e uniformly at random, unweighted; ``sampled`` an unbiased fixed-size sample of
exactly q_e pairs across ranks with π ∝ score, contributions weighted by 1/π (all scores
exchanged). The local ones (``local``, ``local-sampled``) exchange nothing: :mod:`lrmoe.selection.strata`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.config import BackwardConfig
from lrmoe.parallel.comm import Channel
from lrmoe.selection.arrays import as_tensor, on_host, zeros
from lrmoe.selection.sampling import order_by_group_then_key, position_in_block, sample


@dataclass(frozen=True)
class Selection:
    """The kept set of one rank's pairs for one backward."""

    keep_P: torch.Tensor  # bool over this rank's pairs (flattened T·K)
    kept_SE: torch.Tensor  # int64 (W, E): kept pairs per source rank and expert, on every rank
    quota_E: torch.Tensor  # int64 (E,): the quota actually applied (grown by non-finite pairs)
    scale_P: torch.Tensor | None  # sampled: 1/p for kept pairs (None: all contributions × 1)
    nonfinite: bool | torch.Tensor  # non-finite scores alone exceeded a quota (local: a share; a device flag)


def select(scores_P: torch.Tensor, ids_P: torch.Tensor, counts_SE: torch.Tensor, quota_E: torch.Tensor,
           cfg: BackwardConfig, channel: Channel, generator: torch.Generator | None = None,
           shared_generator: torch.Generator | None = None, nonfinite_SE: torch.Tensor | None = None) -> Selection:
    """Choose the kept pairs of this rank for the backward with a global selection (``lrm``,
    ``random``, ``sampled``; collective over the channel's group); the local ones draw in strata,
    :func:`lrmoe.selection.strata.select_in_strata`.

    ``generator`` draws this rank's random numbers; ``shared_generator`` those every rank must
    draw alike (the offsets of a global sample): seeded the same on every rank."""
    if cfg.local:
        raise ValueError(f"select: selection {cfg.selection!r} is local: use select_in_strata")
    finite_P = torch.isfinite(scores_P)
    nf_SE = _nonfinite_counts(ids_P, finite_P, counts_SE.shape, channel) if nonfinite_SE is None else nonfinite_SE
    nf_E = nf_SE.sum(0)
    nonfinite = bool((nf_E > quota_E).any())
    quota_E = torch.maximum(quota_E, nf_E)
    if cfg.selection == "sampled":
        return _sampled_global(scores_P, finite_P, ids_P, counts_SE, quota_E, nf_SE, cfg, channel, shared_generator,
                               nonfinite)
    if cfg.selection == "random":
        key_P = torch.rand(scores_P.shape, generator=generator, dtype=torch.float64).to(scores_P.device)
    else:
        key_P = scores_P
    key_P = torch.where(finite_P, key_P, torch.full_like(key_P, math.inf))
    return _top_quota(key_P, ids_P, counts_SE, quota_E, channel, nonfinite)


def nonfinite_counts(finite_P: torch.Tensor, ids_P: torch.Tensor, E: int) -> torch.Tensor:
    """This rank's non-finite scores per expert (``finite_P``: ``isfinite`` of them), on the
    host, where an exchange sends them from."""
    return torch.bincount(ids_P[~finite_P], minlength=E).cpu()


def _nonfinite_counts(ids_P: torch.Tensor, finite_P: torch.Tensor, shape: torch.Size, channel: Channel
                      ) -> torch.Tensor:
    """Non-finite scores per (rank, expert), on every rank (collective)."""
    W, E = shape
    return channel.all_gather(nonfinite_counts(finite_P, ids_P, E).view(1, E), [1] * W)


def _top_quota(key_P: torch.Tensor, ids_P: torch.Tensor, counts_SE: torch.Tensor, quota_E: torch.Tensor,
               channel: Channel, nonfinite: bool) -> Selection:
    """Each expert's ``quota_E`` pairs of highest key across ranks: exact, by merging every rank's
    candidates (its best min(q_e, c_e,r) keys per expert; collective). Scores on the host are
    ranked in NumPy (:mod:`lrmoe.selection.arrays`: its sort is several times torch's), and so
    are the exchanged keys, which arrive on the host."""
    W, E = counts_SE.shape
    me, device = channel.rank, key_P.device
    key, ids = on_host(key_P), on_host(ids_P)
    order = order_by_group_then_key(ids, key)
    pos = position_in_block(ids[order], on_host(counts_SE[me].to(device)))
    if W == 1:  # the local top-q_e is the global one
        kept_SE = quota_E.view(1, E).clone()
    else:
        cand_SE = torch.minimum(quota_E.unsqueeze(0), counts_SE)
        mine = order[pos < on_host(cand_SE[me].to(device))[ids[order]]]
        all_keys = channel.all_gather(as_tensor(key[mine]).cpu(), cand_SE.sum(1).tolist()).numpy()
        sent_S, cand_E = cand_SE.sum(1).numpy(), cand_SE.reshape(-1).numpy()
        src = np.repeat(np.arange(W), sent_S)
        expert = np.repeat(np.tile(np.arange(E), W), cand_E)
        merged = order_by_group_then_key(expert, all_keys)
        pos_g = position_in_block(expert[merged], cand_SE.sum(0).numpy())
        kept = merged[pos_g < quota_E.numpy()[expert[merged]]]
        kept_SE = torch.from_numpy(np.bincount(src[kept] * E + expert[kept], minlength=W * E).reshape(W, E))
    keep_sorted = pos < on_host(kept_SE[me].to(device))[ids[order]]
    keep = zeros(len(key), key, "bool")
    keep[order[keep_sorted]] = True
    return Selection(as_tensor(keep), kept_SE, quota_E, None, nonfinite)


def _weighted(keep_P: torch.Tensor, pi_P: torch.Tensor, finite_P: torch.Tensor) -> torch.Tensor:
    """Horvitz–Thompson factors: 1/π for kept sampled pairs, 1 for non-finite ones (always kept)."""
    scale = torch.where(keep_P, 1.0 / pi_P.clamp(min=1e-300), torch.zeros_like(pi_P))
    return torch.where(finite_P, scale, torch.ones_like(scale))


def _sampled_global(scores_P: torch.Tensor, finite_P: torch.Tensor, ids_P: torch.Tensor, counts_SE: torch.Tensor,
                    quota_E: torch.Tensor, nf_SE: torch.Tensor, cfg: BackwardConfig, channel: Channel,
                    shared_generator: torch.Generator | None, nonfinite: bool) -> Selection:
    """Unbiased fixed-size sample over every rank's pairs of an expert: exactly q_e kept, π ∝
    score across ranks. Each rank sends its finite scores sorted by expert (the receivers know
    each score's expert and source from the counts); every rank then draws the same sample
    with the same offsets and keeps its own part."""
    W, E = counts_SE.shape
    me, device = channel.rank, scores_P.device
    fin = finite_P.nonzero().squeeze(1)
    ids_f = ids_P[fin]
    by_expert = torch.argsort(ids_f, stable=True)
    fin_SE = counts_SE - nf_SE
    all_scores = channel.all_gather(scores_P[fin][by_expert].cpu(), fin_SE.sum(1).tolist())
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
