"""The noise a sampled backward adds to an expert's weight gradient, and the minibatch's own:
the estimators of the noise controller (:mod:`lrmoe.planning.noise_control`, docs/design.md
"Noise controller").

Expert e's down-projection weight gradient is a sum of per-pair contributions, G_e = Σ_i c_i
with ‖c_i‖² = s_i, the pair's LRM score. A sample that keeps pair i with probability π_i and
weights it by 1/π_i estimates G_e without bias (Horvitz–Thompson); with independent inclusions
its added variance is

    V_s = Σ_i (1/π_i − 1) · s_i                                                     (1)

(the systematic draw of :mod:`lrmoe.selection.sampling` orders pairs by score, a stratification
that (1) is taken to describe). Its π are proportional to a_i = s_i^p, capped at 1: where q of a
group's n pairs are kept and the m largest are capped, the rest R share q − m, and (1) is

    V(q) = (Σ_R a) · (Σ_R s/a) / (q − m) − Σ_R s                                      (2)

— for p = ½, (Σ_R √s)² / (q − m) − Σ_R s, the least variance any q-pair design reaches. The
sampler's floor (π mixed with the uniform q/n, by at most ``p_min``·n/q) is left out of (2).

The minibatch's own noise treats the batch's N tokens as independent draws, token t adding c_t
(0 if not routed to e) to G_e: Var(Σ_t c_t) = N·Var(c_t), estimated by

    V_mb = Σ_i s_i − ‖G_e‖² / N                                                      (3)

Tokens of one sequence are correlated, which makes the true minibatch noise larger than (3):
the estimate errs on the side of keeping pairs.
"""

from __future__ import annotations

import torch

from lrmoe.selection.arrays import Array, arange, as_tensor, count_at_most, float64, on_host, xp, zeros
from lrmoe.selection.ranked import Ranked, design_key, rank


def design_variances(scores_N: torch.Tensor, group_N: torch.Tensor, quota_CG: torch.Tensor, power: float,
                     ranked: Ranked | None = None) -> torch.Tensor:
    """(2) summed over the G groups, for each of C quota rows (``quota_CG``: pairs each group
    keeps, clipped to its size): (C,) float64, on the scores' device. ``group_N``: each pair's
    group; ``power``: the sampler's p (π ∝ score^p). Non-finite scores count as zero (the
    sampler keeps those pairs first). ``ranked``: the keys score^p (non-finite ones 0) already
    ranked in these groups (:func:`~lrmoe.selection.ranked.rank`: the sampler's own ranking),
    else ranked here."""
    arrays = [on_host(t) for t in (scores_N, group_N, quota_CG.to(scores_N.device))]
    return as_tensor(_variances(*arrays, power, ranked))


def _variances(scores_N: Array, group_N: Array, quota_CG: Array, power: float, ranked: Ranked | None) -> Array:
    """Pair m of a group (by descending score) is capped at q iff q ≥ need_m = m + T_m / a_m, T_m
    the tail sum of a from m: need is nondecreasing along a group (need_{m+1} − need_m =
    T_{m+1}·(1/a_{m+1} − 1/a_m) ≥ 0), so a group's capped count at q is a search in its needs —
    C·G searches after one sort, not C passes over the pairs."""
    w = xp(scores_N)
    G, N = quota_CG.shape[1], len(scores_N)
    s_all = w.where(w.isfinite(scores_N), float64(scores_N), 0.0)
    r = ranked if ranked is not None else rank(design_key(s_all, power), group_N, G)
    g, a, s = r.g, r.key, s_all[r.order]
    end_G = r.end_G
    cum_a, cum_s = (w.concatenate([zeros(1, s), v.cumsum(0)]) for v in (a, s))
    if power == 0.5:  # s / a = a
        cum_sa = cum_a
    else:
        cum_sa = w.concatenate([zeros(1, s), w.where(a > 0, s / w.where(a > 0, a, 1.0), 0.0).cumsum(0)])
    need = w.where(a > 0, r.pos + r.tail / w.where(a > 0, a, 1.0), float(N + 1))
    span = float(N + 2)  # keys of one group stay below the next group's
    key = float64(g) * span + need.clip(max=N + 1)
    q_CG = w.minimum(float64(quota_CG), r.n_G)
    query = float64(arange(G, s)) * span + q_CG
    at = count_at_most(key, query)  # first uncapped position of each group, per candidate
    m_CG = float64(at - r.start_G)
    rest_a, rest_sa, rest_s = (cum[end_G] - cum[at] for cum in (cum_a, cum_sa, cum_s))
    share = q_CG - m_CG
    drawn = (share > 0) & (q_CG < r.n_G)  # a group kept whole adds nothing, whatever the rounding
    v_CG = w.where(drawn, rest_a * rest_sa / w.where(share > 0, share, 1.0) - rest_s, 0.0)
    return v_CG.clip(min=0.0).sum(1)


__all__ = ["design_variances"]
