"""FasterMoE-style dynamic shadowing, per call: hot experts broadcast to every rank while a cost
model (weights broadcast vs rows sent) predicts a faster call, and a shadowed expert's pairs are
computed where they originate (:func:`local_assignment`)."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.cost import CostModel
from lrmoe.planning.figures import PlanFigures
from lrmoe.planning.placement import Placement
from lrmoe.planning.strategies.base import PlacementStrategy


class Shadowing(PlacementStrategy):
    """Per call: :func:`shadow_experts`; under a cap the most shadows that fit, the least-loaded
    dropped first."""

    varies_copies = True

    def _shadowed(self, shadow: list[int]) -> Placement:
        """Every shadowed expert copied to every rank."""
        owner_E, W = self.base.owner_E, self.base.world
        return self.base.with_replicas([[e for e in shadow if int(owner_E[e]) != r] for r in range(W)])

    def place_call(self, counts_SE: torch.Tensor, slots_R: list[int] | None) -> tuple[Placement, PlanFigures]:
        shadow = shadow_experts(counts_SE, self.base, self.inputs.costs)
        return self._shadowed(shadow), PlanFigures(shadowed_experts=len(shadow))

    def fit_call(self, counts_SE, slots_R, fitter, forward_SE, training):
        load = counts_SE.sum(0).tolist()
        shadow = sorted(shadow_experts(counts_SE, self.base, self.inputs.costs), key=lambda e: (-load[e], e))
        k, fit = fitter.longest_prefix(lambda k: self._shadowed(shadow[:k]), len(shadow), forward_SE, training)
        return fit, PlanFigures(shadowed_experts=k)


def _shadow_time(counts_SE: np.ndarray, owner_E: np.ndarray, shadow: np.ndarray, cost: CostModel) -> float:
    """Predicted step time of the routed experts with ``shadow`` (bool, E) experts on every rank:
    the slowest rank's compute plus its token traffic, plus its weight broadcasts and gradient
    reductions as the owner of shadowed experts (counted in full: no overlap is modelled)."""
    S, E = counts_SE.shape
    local_SE = counts_SE * shadow  # shadowed pairs stay where they come from
    owned_SE = counts_SE * ~shadow  # the others go to their owner
    to_owner_R = np.bincount(owner_E, weights=owned_SE.sum(0), minlength=S)
    kept_home_R = (owned_SE * (owner_E[None, :] == np.arange(S)[:, None])).sum(1)  # owner's own pairs
    rows_R = local_SE.sum(1) + to_owner_R
    sent_R = owned_SE.sum(1) - kept_home_R
    recv_R = to_owner_R - kept_home_R
    wire_R = np.maximum(sent_R, recv_R) * cost.row_wire_bytes
    per_rank = rows_R * cost.row_s + wire_R * cost.byte_s
    n_shadow_R = np.bincount(owner_E[shadow], minlength=S)
    broadcast_R = n_shadow_R * 2 * (S - 1) * cost.expert_bytes * cost.byte_s
    return float((per_rank + broadcast_R).max())


def shadow_experts(counts_SE: torch.Tensor, base: Placement, cost: CostModel) -> list[int]:
    """FasterMoE's dynamic shadowing decision for one call: experts by descending load, each
    shadowed while the predicted time keeps falling (the first that does not help stops it).

    The per-rank figures of :func:`_shadow_time` are kept up to date as each expert is shadowed
    (integer-valued sums, so exactly the same figures) instead of recomputed over every expert."""
    counts = counts_SE.numpy().astype(np.float64)
    owner_E = base.owner_E.numpy()
    S, E = counts.shape
    shadow = np.zeros(E, bool)
    total_E = counts.sum(0)
    if counts_SE.is_floating_point() or counts.sum() >= 2**52:  # sums would round: recompute each
        return _shadow_experts_by_recomputing(counts, owner_E, cost)
    ranks = np.arange(S)
    # _shadow_time's figures with nothing shadowed: every pair goes to its owner
    to_owner_R = np.bincount(owner_E, weights=total_E, minlength=S)
    kept_home_R = (counts * (owner_E[None, :] == ranks[:, None])).sum(1)
    rows_R = to_owner_R.copy()
    sent_R = counts.sum(1) - kept_home_R
    recv_R = to_owner_R - kept_home_R
    n_shadow_R = np.zeros(S, np.int64)

    def time_now() -> float:
        wire_R = np.maximum(sent_R, recv_R) * cost.row_wire_bytes
        per_rank = rows_R * cost.row_s + wire_R * cost.byte_s
        broadcast_R = n_shadow_R * 2 * (S - 1) * cost.expert_bytes * cost.byte_s
        return float((per_rank + broadcast_R).max())

    best = time_now()
    for e in np.argsort(-total_E, kind="stable").tolist():
        if total_E[e] == 0:
            break
        col, o = counts[:, e], owner_E[e]
        # shadow e: its pairs stay where they come from instead of going to owner o
        undo = rows_R.copy(), sent_R.copy(), recv_R.copy()
        rows_R += col
        rows_R[o] -= total_E[e]
        sent_R -= col
        sent_R[o] += col[o]  # the owner's own pairs were never sent
        recv_R[o] -= total_E[e] - col[o]
        n_shadow_R[o] += 1
        t = time_now()
        if t >= best:
            rows_R, sent_R, recv_R = undo
            n_shadow_R[o] -= 1
            break
        shadow[e] = True
        best = t
    return sorted(int(e) for e in np.flatnonzero(shadow))


def _shadow_experts_by_recomputing(counts: np.ndarray, owner_E: np.ndarray, cost: CostModel) -> list[int]:
    """:func:`shadow_experts` with :func:`_shadow_time` recomputed for every trial."""
    shadow = np.zeros(counts.shape[1], bool)
    best = _shadow_time(counts, owner_E, shadow, cost)
    for e in np.argsort(-counts.sum(0), kind="stable"):
        if counts[:, e].sum() == 0:
            break
        shadow[e] = True
        t = _shadow_time(counts, owner_E, shadow, cost)
        if t >= best:
            shadow[e] = False
            break
        best = t
    return sorted(int(e) for e in np.flatnonzero(shadow))


def local_assignment(counts_SE: torch.Tensor, placement: Placement) -> PairAssignment:
    """Every pair computed on its source rank if that rank holds the expert, else by the
    expert's owner."""
    index = placement.holder_index
    expert_H, rank_H = index.expert_H, index.rank_H
    counts_ES = counts_SE.t().to(torch.long).numpy()
    held_ES = np.zeros(counts_ES.shape, bool)
    held_ES[expert_H, rank_H] = True
    rows_HS = np.zeros((len(expert_H), counts_ES.shape[1]), np.int64)
    at_owner = rank_H == placement.owner_E.numpy()[expert_H]
    rows_HS[at_owner] = np.where(held_ES, 0, counts_ES)[expert_H[at_owner]]  # sources without a copy
    rows_HS[np.arange(len(expert_H)), rank_H] = counts_ES[expert_H, rank_H]  # each copy's own source
    return PairAssignment(expert_H, rank_H, rows_HS, placement.num_experts)
