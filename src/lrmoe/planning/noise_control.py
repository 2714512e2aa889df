"""The noise controller: each layer's backward keeps the fewest pairs whose sampling noise is
predicted to cost at most a share τ more steps (``BackwardConfig(objective="noise")``,
docs/design.md "Noise objective").

The steps model is the gradient noise scale's (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training"): steps to a loss grow as 1 + B_noise / B, B_noise / B = V / ‖G‖² for a
minibatch gradient of variance V around the true gradient G. Sampling adds V_s to V, so steps
grow by the factor 1 + V_s / (‖G‖² + V) = 1 + V_s / E‖G_mb‖²: the sampling noise over the
minibatch gradient's own squared norm. E‖Ĝ‖² = E‖G_mb‖² + V_drawn for the sampled gradient Ĝ the
backward produced, so the denominator is read off it. VCAS (arXiv 2402.17227) holds V_s / V
instead, the same where noise dominates (V ≫ ‖G‖²); on configs/paper.toml E‖G_mb‖² is about three
times V (docs/convergence.md "The noise objective").

A call's quotas are set before its backward, so the ratio is carried from step to step: during
step t every rank adds what its backward already holds — the design variance
(:mod:`lrmoe.selection.noise`, (2)) of its strata at the quotas drawn and at every ratio of
:data:`NOISE_RATIOS`, Σ s of its pairs and its tokens (home side), ‖Ĝ‖² of its owned experts'
down-projection gradient (owner side). Step t + 1's first forward carries them in its count
exchange (no collective of their own; :func:`lrmoe.passes.forward.plan`), every rank sums them
in rank order, and :meth:`NoiseController.update` sets the ratio that call's quotas take, the
least ρ of the grid with

    V(ρ) ≤ τ · (‖Ĝ‖² − V_drawn)

Step 1 keeps every pair; memory and the network stay hard limits on top (the call's
``memory_trimmed`` says when they kept fewer pairs than the ratio). VCAS's ratio is reported
beside it (``minibatch_ratio``: V_drawn / V_mb, V_mb = Σ s − ‖G_mb‖² / N, the N tokens taken as
independent draws).
"""

from __future__ import annotations

import math

import torch

from lrmoe.config import BackwardConfig
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Group
from lrmoe.planning.quota_ratio import fixed_ratio_quota
from lrmoe.selection.noise import design_variances
from lrmoe.selection.ranked import Ranked

NOISE_RATIOS = tuple(round(1.0 - 0.05 * i, 2) for i in range(20))  # 1, 0.95, …, 0.05: the ratios priced
_SCORES, _TOKENS, _GRAD, _DRAWN = range(4)  # the sums' first entries; the ratios' variances follow
_SUMS = _DRAWN + 1 + len(NOISE_RATIOS)


class NoiseController:
    """One layer's trimming ratio from measured gradient noise (see the module docstring)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.ratio = 1.0  # the ratio this step's quotas take
        self.variance_ratio: float | None = None  # the last step's V_drawn / ‖G_mb‖²: its predicted step cost
        self.minibatch_ratio: float | None = None  # ... and V_drawn / V_mb, VCAS's
        self._sums: torch.Tensor | None = None

    def _add(self, index: slice | int, value: torch.Tensor) -> None:
        if self._sums is None:
            self._sums = torch.zeros(_SUMS, dtype=torch.float64, device=value.device)
        self._sums[index] += value

    def add_pairs(self, scores_N: torch.Tensor, group_N: torch.Tensor, sizes_G: torch.Tensor,
                  share_G: torch.Tensor, tokens: int, power: float, ranked: Ranked | None = None) -> None:
        """A home side's pairs of one call: their scores (``group_N``: each one's stratum, of
        ``sizes_G`` pairs; ``share_G``: the pairs each stratum keeps), its tokens and the
        sampler's π ∝ score^``power``; ``ranked``: the pairs already ranked
        (:func:`~lrmoe.selection.ranked.rank_scores`, the sampler's ranking)."""
        quota_CG = torch.cat([share_G.view(1, -1).to(torch.long),
                              fixed_ratio_quota(sizes_G.to(share_G.device), list(NOISE_RATIOS))])
        scores = torch.where(torch.isfinite(scores_N), scores_N, 0.0).sum()
        self._add(slice(_DRAWN, None), design_variances(scores_N, group_N, quota_CG, power, ranked))
        self._add(_SCORES, scores)
        self._add(_TOKENS, torch.tensor(float(tokens), dtype=torch.float64, device=scores.device))

    def add_gradient(self, down_grad: torch.Tensor) -> None:
        """An owner's gradient of its experts' down projections from one call (the sampled Ĝ)."""
        self._add(_GRAD, torch.linalg.vector_norm(down_grad.detach()).to(torch.float64).square())

    def pending(self) -> torch.Tensor:
        """This rank's sums since the last :meth:`update` (float64 on the host; zeros if none),
        taken off: the next forward's count exchange carries them to every rank of the group."""
        sums = torch.zeros(_SUMS, dtype=torch.float64) if self._sums is None else self._sums.cpu()
        self._sums = None
        return sums

    def update(self, summed: torch.Tensor) -> None:
        """The ratio from every rank's :meth:`pending` sums, summed (in rank order: the same on every
        rank); unchanged where no backward measured anything since the last update."""
        sums = summed.tolist()
        scores, tokens, grad, drawn = sums[:_DRAWN + 1]
        if scores <= 0 or tokens <= 0:
            return
        signal = max(grad - drawn, 0.0)  # E‖Ĝ‖² − V_drawn = E‖G_mb‖²
        minibatch = max(scores - signal / tokens, 0.0)
        self.variance_ratio, self.minibatch_ratio = (drawn / d if d > 0 else (math.inf if drawn > 0 else 0.0)
                                                     for d in (signal, minibatch))
        ratio = 1.0
        for rho, v in zip(NOISE_RATIOS, sums[_DRAWN + 1:]):
            if v > self.threshold * signal:
                break
            ratio = rho
        self.ratio = ratio

    def state(self, group: Group = None) -> tuple[float | None, ...]:
        """What a checkpoint keeps: the ratio, the last measured ratios, then the sums not yet taken
        (a checkpoint falls between a backward and the next forward that takes them), totalled
        over ``group`` (collective) so that every rank's copy is the same: gathered and summed in
        rank order as :meth:`update`'s caller sums them, so the total is theirs to the last bit."""
        sums = torch.zeros(_SUMS, dtype=torch.float64) if self._sums is None else self._sums.cpu()
        summed = comm.all_gather(sums.view(1, -1), [1] * comm.world_size(group), group).sum(0)
        return (self.ratio, self.variance_ratio, self.minibatch_ratio, *summed.tolist())

    def load_state(self, state: tuple[float | None, ...], holder: bool = True) -> None:
        """:meth:`state` back; the group's pending total goes to one ``holder`` rank (the others
        none), so that the next count exchange sums it exactly once."""
        self.ratio = float(state[0])
        self.variance_ratio, self.minibatch_ratio = (None if v is None else float(v) for v in state[1:3])
        sums = [float(v) for v in state[3:]]
        self._sums = torch.tensor(sums, dtype=torch.float64) if holder and any(sums) else None


def noise_controller(selective: bool, backward: BackwardConfig) -> NoiseController | None:
    """A selective layer's controller under ``backward``'s noise objective; None otherwise."""
    return NoiseController(backward.noise_threshold) if selective and backward.objective == "noise" else None


__all__ = ["NOISE_RATIOS", "NoiseController", "noise_controller"]
