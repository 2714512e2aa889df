"""Planners of the replication family (supply side): where expert copies live and which copy
computes which pairs, from routing counts. Pure, deterministic functions of values every rank
holds identically (global counts, smoothed load, a shared trace), so every rank plans the same
without another exchange. ``docs/systems.md`` says what of each published mechanism is
reproduced here and what is not.

- ``fastermoe``: :func:`shadow_experts` (per call, cost model: broadcast weights vs send rows)
  and :func:`local_assignment` (shadowed experts compute their pairs where they originate);
- ``flexmoe``: :func:`flexmoe_replan` (greedy replicate/migrate moves, applied only when the
  predicted gain over a horizon exceeds the migration cost, optimizer state included);
- ``smartmoe``: :func:`placement_pool` (offline, from a routing trace) and :func:`pick_from_pool`
  (online, per step);
- ``laer``: :func:`laer_layout` (per call: which experts each rank assembles from shards);
- ``topoep``: :func:`localize` (same peak, fewest cross-node rows), with
  :func:`lrmoe.planning.placement.plan_replicas` given the rank → node map;
- ``ultraep`` needs nothing new: :func:`~lrmoe.planning.placement.plan_replicas` on the call's own counts,
  then :func:`~lrmoe.planning.balance.assign_min_peak` (per-replica token quotas).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lrmoe.memory.bytes import expert_param_bytes
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement, copies_by_load, place_copies, plan_replicas

ADAM_STATES = 2  # optimizer state per parameter moved with a bound (FlexMoE) replica


@dataclass(frozen=True)
class CostModel:
    """What the cost-driven planners (fastermoe, flexmoe) believe about the hardware.

    ``row_s``: seconds to push one pair through an expert, forward and backward (≈ 18·D·F FLOPs
    at ``gemm_flops``); ``byte_s``: seconds per byte on a rank's link. Defaults: 1 TFLOP/s and
    100 Gbit/s; a :class:`~lrmoe.config.ClusterBudget` with ``inter_node_gbps`` sets the link.
    """

    dim: int
    ffn_dim: int
    elem_bytes: int
    gemm_flops: float = 1e12
    link_gbps: float = 100.0

    @property
    def row_s(self) -> float:
        return 18 * self.dim * self.ffn_dim / self.gemm_flops

    @property
    def byte_s(self) -> float:
        return 8 / (self.link_gbps * 1e9)

    @property
    def expert_bytes(self) -> int:
        return expert_param_bytes(self.dim, self.ffn_dim, self.elem_bytes)

    @property
    def row_wire_bytes(self) -> int:
        """A remote pair crosses the link four times: x out, y back, dy out, dx back."""
        return 4 * self.dim * self.elem_bytes


# ------------------------------------------------------------------------------- fastermoe
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


# ------------------------------------------------------------------------------- flexmoe
def predicted_rank_load(placement: Placement, load_E: list[float]) -> list[float]:
    """Each expert's load split evenly over its copies (what a min-peak spread approaches)."""
    out = [0.0] * placement.world
    for e, hs in enumerate(placement.holder_lists):
        for r in hs:
            out[r] += load_E[e] / len(hs)
    return out


def flexmoe_replan(current: Placement, load_E: torch.Tensor, slots_R: list[int], cost: CostModel,
                   horizon: int) -> tuple[Placement, int]:
    """FlexMoE's greedy re-placement: repeatedly relieve the most loaded rank by a replica of its
    heaviest expert on the least-loaded rank not holding it — into a free slot (replicate) or in
    place of that rank's coldest replica (migrate) — while the predicted peak falls. The result
    is adopted only if the peak saved over ``horizon`` steps outweighs moving the new replicas'
    parameters and their bound optimizer state. Returns (placement, expert copies created)."""
    load = [max(float(v), 0.0) for v in load_E.tolist()]
    W = current.world
    replicas = [list(current.replicas(r)) for r in range(W)]
    plan = current
    peak0 = peak = max(predicted_rank_load(plan, load))
    for _ in range(current.num_experts * W):
        rank_load = predicted_rank_load(plan, load)
        hot = max(range(W), key=lambda r: (rank_load[r], -r))
        e = max(plan.slots[hot], key=lambda e: (load[e] / len(plan.holders(e)), -e))
        options = [r for r in range(W) if e not in plan.slots[r]]
        if not options:
            break
        t = min(options, key=lambda r: (rank_load[r], r))
        trial = [list(x) for x in replicas]
        if len(plan.slots[t]) >= slots_R[t]:
            if not trial[t]:
                break
            cold = min(trial[t], key=lambda u: (load[u] / len(plan.holders(u)), u))
            trial[t].remove(cold)
        trial[t].append(e)
        candidate = current.with_replicas(trial)
        new_peak = max(predicted_rank_load(candidate, load))
        if new_peak >= peak:
            break
        plan, replicas, peak = candidate, trial, new_peak
    created = sum(len(set(plan.replicas(r)) - set(current.replicas(r))) for r in range(W))
    gain_s = (peak0 - peak) * cost.row_s * horizon
    move_s = created * cost.expert_bytes * (1 + ADAM_STATES) * cost.byte_s
    if created and gain_s > move_s:
        return plan, created
    return current, 0


# ------------------------------------------------------------------------------- smartmoe
def placement_pool(trace_NE: torch.Tensor, base: Placement, slots_R: list[int], size: int) -> list[Placement]:
    """SmartMoE's offline phase: cluster the trace's load vectors (normalised per step) into
    ``size`` centroids by k-means (farthest-point initialisation from step 0, 20 Lloyd rounds,
    deterministic) and plan one replica placement per centroid."""
    loads = trace_NE.to(torch.float64).numpy()
    if loads.ndim != 2 or loads.shape[1] != base.num_experts or not len(loads):
        raise ValueError(f"routing trace must be (steps, {base.num_experts}) with at least one step, "
                         f"got {tuple(loads.shape)}")
    X = loads / np.maximum(loads.sum(1, keepdims=True), 1e-12)
    k = min(size, len(X))
    centres = [X[0]]
    for _ in range(1, k):
        d = np.min([((X - c) ** 2).sum(1) for c in centres], axis=0)
        centres.append(X[int(np.argmax(d))])
    C = np.stack(centres)
    for _ in range(20):
        label = np.argmin(((X[:, None, :] - C[None]) ** 2).sum(2), axis=1)
        C = np.stack([X[label == j].mean(0) if (label == j).any() else C[j] for j in range(k)])
    return [plan_replicas(base, torch.from_numpy(c), slots_R) for c in C]


def pick_from_pool(pool: list[Placement], load_E: torch.Tensor) -> int:
    """SmartMoE's online phase: the pool entry with the lowest predicted peak for ``load_E``."""
    load = [float(v) for v in load_E.tolist()]
    return min(range(len(pool)), key=lambda i: (max(predicted_rank_load(pool[i], load)), i))


# ------------------------------------------------------------------------------- laer
def laer_layout(counts_E: torch.Tensor, base: Placement, slots_R: list[int]) -> Placement:
    """LAER-MoE's per-call layout: with every expert sharded over all ranks any rank can
    assemble any expert, so the planner starts from nothing — one copy of each expert that has
    pairs, more for heavy ones (D'Hondt within the ranks' assembly slots), placed LPT.
    ``owner_E`` of the result is each expert's first holder (experts without pairs keep the
    static owner, and no rank assembles them)."""
    E, W = base.num_experts, base.world
    load = [float(v) for v in counts_E.tolist()]
    needed = [e for e in range(E) if load[e] > 0]
    if len(needed) > sum(slots_R):
        raise ValueError(f"{len(needed)} experts have pairs but the ranks can assemble only {sum(slots_R)}")
    copies = copies_by_load(load, [1 if load[e] > 0 else 0 for e in range(E)], sum(slots_R) - len(needed), W)
    units = [(load[e] / copies[e], e) for e in needed for _ in range(copies[e])]
    slots = place_copies(units, [0.0] * W, list(slots_R), [set() for _ in range(W)])
    owner = base.owner_E.tolist()
    for r in reversed(range(W)):
        for e in slots[r]:
            owner[e] = r
    owner_E = torch.tensor(owner, dtype=base.owner_E.dtype)
    return Placement(E, tuple(tuple(sorted(s)) for s in slots), owner_E)


# ------------------------------------------------------------------------------- topoep
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
    out_HS = np.zeros_like(rows_HS)
    if not len(expert_H):
        return assign
    supply_ES = np.zeros((E, S), np.int64)
    np.add.at(supply_ES, expert_H, rows_HS)
    demand_ER = np.zeros((E, S), np.int64)
    demand_ER[expert_H, rank_H] = assign.rows_H
    entry_ER = np.full((E, S), -1, np.int64)
    entry_ER[expert_H, rank_H] = np.arange(len(expert_H))
    own = np.minimum(supply_ES[expert_H, rank_H], demand_ER[expert_H, rank_H])  # on the source itself (S = R)
    out_HS[np.arange(len(expert_H)), rank_H] = own
    supply_ES[expert_H, rank_H] -= own
    demand_ER[expert_H, rank_H] -= own
    _in_order(supply_ES, demand_ER, np.asarray(node_of[:S]), out_HS, entry_ER, last=False)  # inside each node
    _in_order(supply_ES, demand_ER, None, out_HS, entry_ER, last=True)  # then anywhere
    return PairAssignment(expert_H, rank_H, out_HS, E)
