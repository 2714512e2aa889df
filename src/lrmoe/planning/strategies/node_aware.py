"""TopoEP-style topology awareness: replicas ∝ load placed so that a node lacking an expert gets
its copy first (within one row of the peak), and pairs re-matched to holders inside their node
(:func:`localize`: same per-rank rows, fewest rows across nodes; its matching of sources to
holders, :func:`match_sources`, is also LLEP's rule's)."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.strategies.base import PlacementStrategy


class NodeAwareReplicas(PlacementStrategy):
    """Between steps: :func:`plan_replicas` given the rank → node map."""

    replicas_beside_owned = True

    def step_placement(self, current: Placement, load_E: torch.Tensor, slots_R: list[int]) -> Placement:
        return plan_replicas(self.base, load_E, slots_R, self.inputs.node_of)


def _cumsum_within(x_EN: np.ndarray, group_N: np.ndarray) -> np.ndarray:
    """Cumulative sums along N that restart in every group (members in index order)."""
    sums = x_EN.cumsum(1)
    if group_N[0] == group_N[-1] and (group_N == group_N[0]).all():  # one group
        return sums
    if (group_N[1:] >= group_N[:-1]).all():  # groups in contiguous blocks, in order
        first = np.searchsorted(group_N, group_N)  # each member's group's first member
        sums -= sums[:, first] - x_EN[:, first]
        return sums
    order = np.argsort(group_N, kind="stable")
    out = np.empty_like(sums)
    out[:, order] = _cumsum_within(x_EN[:, order], group_N[order])
    return out

def _in_order(supply_ES: np.ndarray, demand_ER: np.ndarray, group: np.ndarray | None, out_HS: np.ndarray,
              entry_ER: np.ndarray, last: bool) -> None:
    """Per expert and group (``None``: one group), sources fill holders in rank order (the
    north-west corner rule): laid end to end on one axis, source s and holder r exchange the
    overlap of their intervals. Adds the exchanged pairs to ``out_HS`` (entry ``entry_ER[e, r]``
    for holder r of expert e) and, unless ``last``, takes them off supply and demand."""
    e, r = np.nonzero(demand_ER)  # the holders still owed rows: few per expert
    if not len(e):
        return
    if group is None:
        hi_S, hi_R = supply_ES.cumsum(1), demand_ER.cumsum(1)
    else:
        hi_S, hi_R = _cumsum_within(supply_ES, group), _cumsum_within(demand_ER, group)
    top_S = hi_S[e]  # (L, S): the sources of each holder's expert
    moved = np.minimum(top_S, hi_R[e, r][:, None])
    moved -= np.maximum(top_S - supply_ES[e], (hi_R[e, r] - demand_ER[e, r])[:, None])
    np.maximum(moved, 0, out=moved)
    if group is not None:
        moved *= group[None, :] == group[r][:, None]
    out_HS[entry_ER[e, r]] += moved  # the (e, r) are distinct
    if not last:
        demand_ER[e, r] -= moved.sum(1)
        first = np.flatnonzero(np.r_[True, e[1:] != e[:-1]])  # e ascending: each expert's first holder
        supply_ES[e[first]] -= np.add.reduceat(moved, first, axis=0)


def localize(assign: PairAssignment, node_of: list[int]) -> PairAssignment:
    """Re-match sources to holders without changing any rank's rows of any expert (so the peak
    is unchanged): first on the source rank itself, then inside its node, then across nodes, in
    rank order. For fixed per-holder totals this minimises the pairs that cross nodes."""
    E, S = assign.num_experts, assign.world
    expert_H, rank_H, rows_HS = assign.expert_H, assign.rank_H, assign.rows_HS
    if not len(expert_H):
        return assign
    supply_ES = np.zeros((E, S), np.int64)
    np.add.at(supply_ES, expert_H, rows_HS)
    demand_ER = np.zeros((E, S), np.int64)
    demand_ER[expert_H, rank_H] = assign.rows_H
    return match_sources(expert_H, rank_H, supply_ES, demand_ER, node_of)


def match_sources(expert_H: np.ndarray, rank_H: np.ndarray, supply_ES: np.ndarray, demand_ER: np.ndarray,
                  node_of: list[int] | None = None) -> PairAssignment:
    """The assignment whose entries (``expert_H``, ``rank_H``: expert then rank ascending) compute
    ``demand_ER[e, r]`` rows of expert e, taken from the sources' ``supply_ES[e, s]`` pairs (each
    expert's supply and demand summing alike): first each holder's own source's pairs, then
    (``node_of`` given) sources inside its node, then any, in rank order (:func:`_in_order`).
    The inputs are not changed."""
    E, S = supply_ES.shape
    out_HS = np.zeros((len(expert_H), S), np.int64)
    if not len(expert_H):
        return PairAssignment(expert_H, rank_H, out_HS, E)
    supply_ES, demand_ER = supply_ES.astype(np.int64, copy=True), demand_ER.astype(np.int64, copy=True)
    entry_ER = np.full((E, S), -1, np.int64)
    entry_ER[expert_H, rank_H] = np.arange(len(expert_H))
    own = np.minimum(supply_ES[expert_H, rank_H], demand_ER[expert_H, rank_H])  # on the source itself (S = R)
    out_HS[np.arange(len(expert_H)), rank_H] = own
    supply_ES[expert_H, rank_H] -= own
    demand_ER[expert_H, rank_H] -= own
    if node_of is not None:
        _in_order(supply_ES, demand_ER, np.asarray(node_of[:S]), out_HS, entry_ER, last=False)  # inside each node
    _in_order(supply_ES, demand_ER, None, out_HS, entry_ER, last=True)  # then anywhere
    return PairAssignment(expert_H, rank_H, out_HS, E)
