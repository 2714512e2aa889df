"""The planners as they were before the speed-ups, kept verbatim as the reference (but for the
``ref_`` prefix of their names): min-peak assignment (lrmoe.planning.balance), max-min fair quotas
and the largest ratio (then in lrmoe.planning.controller), replica placement
(lrmoe.planning.placement) and the replication family's planners (lrmoe.planning.strategies).
The faster planners must match them bit for bit, errors included (tests/planning/test_balance.py,
test_quotas.py, test_placement.py, test_replication.py). Nothing here is a test; do not edit these
to follow a change of the planners: a change of behaviour shows as a mismatch."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lrmoe.planning.placement import Placement
from lrmoe.planning.strategies import CostModel


def ref_level_for(need: int, base: np.ndarray, cap: np.ndarray) -> int | None:
    """Least P with Σ_r clip(min(P, cap_r) − base_r, 0) ≥ need, or None if even P = ∞ fails."""
    room = np.clip(cap - base, 0, None)
    if room.sum() < need:
        return None
    lo, hi = int(base.min()), int(base.max()) + need  # at hi every rank has ≥ need room
    while lo < hi:  # the room is monotone in P; ~log2(need) steps over ≤ R ranks
        mid = (lo + hi) // 2
        if np.clip(np.minimum(mid, cap) - base, 0, None).sum() >= need:
            hi = mid
        else:
            lo = mid + 1
    return lo


def ref_experts_of_ranks(holders: list[list[int]], ranks: int) -> list[list[int]]:
    """The inverse of ``holders`` (expert → ranks holding it): rank → experts it holds, ascending."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    for e, hs in enumerate(holders):
        for r in hs:
            out[r].append(e)
    return out


def ref_max_flow(flow, supply, slack, holders, holders_of_rank):
    """Place ``supply[e]`` more rows of each expert on its holders within ``slack``: Dinic's
    algorithm on the residual graph, in place on plain lists. Returns None when every unit is
    placed, else (experts, ranks) reachable from unplaced units: the blocking set, whose ranks
    are full and receive rows from those experts only.

    ``flow[e]`` maps holder rank → rows of e there; a forward edge e → r is unbounded, the
    residual edge r → e carries flow[e][r]; rank r has ``slack[r]`` left toward the sink.
    """
    E = len(flow)
    while True:
        # BFS levels from every expert with unplaced rows.
        level_e = [-1] * E
        level_r = [-1] * len(slack)
        frontier = [e for e in range(E) if supply[e] > 0]
        if not frontier:
            return None
        for e in frontier:
            level_e[e] = 0
        depth, found = 0, False
        while frontier and not found:
            ranks = []
            for e in frontier:
                for r in holders[e]:
                    if level_r[r] < 0:
                        level_r[r] = depth + 1
                        ranks.append(r)
                        found |= slack[r] > 0
            if found:
                break
            frontier = []
            for r in ranks:
                for e in holders_of_rank[r]:
                    if level_e[e] < 0 and flow[e].get(r, 0) > 0:
                        level_e[e] = depth + 2
                        frontier.append(e)
            depth += 2
        if not found:
            seen_e = [e for e in range(E) if level_e[e] >= 0]
            seen_r = [r for r in range(len(slack)) if level_r[r] >= 0]
            return seen_e, seen_r
        # Blocking flow along level-increasing paths (iterative DFS with current-arc pointers).
        arc_e = [0] * E  # next holder to try
        arc_r = [0] * len(slack)  # next expert to try going backward from a rank
        for e0 in range(E):
            while supply[e0] > 0 and level_e[e0] == 0:
                path = ref_find_path(e0, flow, slack, holders, holders_of_rank, level_e, level_r, arc_e, arc_r)
                if path is None:
                    break
                delta = supply[e0]
                r_end = path[-1][1]
                delta = min(delta, slack[r_end])
                for e, r_in, _ in ref_hops(path):
                    if r_in is not None:
                        delta = min(delta, flow[e][r_in])
                for e, r_in, r_out in ref_hops(path):
                    flow[e][r_out] = flow[e].get(r_out, 0) + delta
                    if r_in is not None:
                        flow[e][r_in] -= delta
                supply[e0] -= delta
                slack[r_end] -= delta


def ref_hops(path):
    """(expert, rank it gives rows up at or None, rank it sends rows to) along a path."""
    for i, (e, r_out) in enumerate(path):
        yield e, (path[i - 1][1] if i else None), r_out


def ref_find_path(e0, flow, slack, holders, holders_of_rank, level_e, level_r, arc_e, arc_r):
    """One path e0 → r → e → r … → r_end (slack > 0) in the level graph, as [(expert, rank)]."""
    stack = [(e0, None)]  # (expert, rank it was entered from)
    path = []
    while stack:
        e, _ = stack[-1]
        hs = holders[e]
        advanced = False
        while arc_e[e] < len(hs):
            r = hs[arc_e[e]]
            if level_r[r] == level_e[e] + 1:
                if slack[r] > 0:
                    return path + [(e, r)]
                # go backward to an expert with rows at r, one level deeper
                hr = holders_of_rank[r]
                while arc_r[r] < len(hr):
                    e2 = hr[arc_r[r]]
                    if level_e[e2] == level_r[r] + 1 and flow[e2].get(r, 0) > 0:
                        break
                    arc_r[r] += 1
                if arc_r[r] < len(hr):
                    path.append((e, r))
                    stack.append((hr[arc_r[r]], r))
                    advanced = True
                    break
            arc_e[e] += 1
        if not advanced:
            stack.pop()
            level_e[e] = -2  # dead end for this phase
            if path:
                path.pop()
    return None


def ref_assign_min_peak(
    counts_ES: torch.Tensor,
    holders: Sequence[Sequence[int]],
    capacity_R: torch.Tensor | Sequence[int] | None = None,
    base_R: torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Assign pairs to holders with the smallest possible peak of ``base_R + rows_R``.

    ``counts_ES``: int64 (E, S) pairs per expert and source rank (S ranks). ``holders[e]``: the
    sorted ranks holding expert e. ``capacity_R``: optional bound on ``base_R + rows_R``.
    Returns int64 ``assign_ESR`` (E, S, R = S) whose sum over R is ``counts_ES``, non-zero only
    on holders; among optimal assignments rows stay on their source rank where the initial
    local placement fits (so when keeping every row local is optimal, every row stays local).
    Raises ``ValueError`` when the capacities cannot hold the pairs.
    """
    counts = np.asarray(counts_ES, dtype=np.int64)
    E, S = counts.shape
    R = S
    if len(holders) != E:
        raise ValueError(f"holders has {len(holders)} entries, counts_ES has {E} experts")
    if (counts < 0).any():
        raise ValueError("counts_ES must be non-negative")
    base = np.zeros(R, np.int64) if base_R is None else np.asarray(base_R, dtype=np.int64).copy()
    big = 1 << 40  # "no capacity": far above any row count, and sums of it cannot overflow
    cap = np.full(R, big, np.int64) if capacity_R is None else np.asarray(capacity_R, dtype=np.int64).copy()
    hold = np.zeros((E, R), bool)
    for e, hs in enumerate(holders):
        if len(hs) == 0 and counts[e].sum() > 0:
            raise ValueError(f"expert {e} has {int(counts[e].sum())} pairs but no holder")
        for r in hs:
            if not 0 <= r < R:
                raise ValueError(f"holder {r} of expert {e} is not a rank in [0, {R})")
        hold[e, list(hs)] = True
    n_E = counts.sum(1)
    if (base > cap).any():
        r = int(np.argmax(base > cap))
        raise ValueError(f"rank {r}: base load {int(base[r])} already exceeds its capacity {int(cap[r])}")

    # A lower bound to start from: no rank below its base, and some holder of each expert takes
    # at least n_e / |H_e| rows on top of the smallest base among its holders.
    n_holders = hold.sum(1)
    used = n_E > 0
    min_base = np.where(hold, base[None, :], big).min(1)
    P = int(base.max()) if R else 0
    if used.any():
        P = max(P, int((min_base[used] + -(-n_E[used] // n_holders[used])).max()))
    single = used & (n_holders == 1)  # experts with one holder must all land on it
    if single.any():
        only = np.bincount(hold[single].argmax(1), weights=n_E[single], minlength=R).astype(np.int64)
        P = max(P, int((base + only).max()))

    holder_lists = [sorted(int(r) for r in hs) for hs in holders]
    holders_of_rank = ref_experts_of_ranks(holder_lists, R)
    local_D = np.where(hold, counts, 0) if S == R else np.zeros((E, R), np.int64)
    cap_l = cap.tolist()

    def solve(P: int):
        """Flow from the local start at peak P, raising P until complete. Returns (P, flow)."""
        limit = np.minimum(P, cap) - base
        before = local_D.cumsum(0) - local_D  # rows kept local, lowest expert index first
        local = np.clip(limit[None, :] - before, 0, local_D)
        flow = [{r: int(local[e, r]) for r in hs} for e, hs in enumerate(holder_lists)]
        supply = (n_E - local.sum(1)).tolist()
        slack = (limit - local.sum(0)).tolist()
        while True:
            blocked = ref_max_flow(flow, supply, slack, holder_lists, holders_of_rank)
            if blocked is None:
                return P, flow
            seen_e, seen_r = blocked
            need = int(n_E[seen_e].sum())
            ranks = np.asarray(seen_r)
            level = ref_level_for(need, base[ranks], cap[ranks])
            if level is None:
                raise ValueError(
                    f"infeasible capacity: experts {seen_e} have {need} pairs, their holders {seen_r} "
                    f"have room for {int(np.clip(cap[ranks] - base[ranks], 0, None).sum())}"
                )
            new_P = max(P + 1, level)
            for r in range(R):
                slack[r] += min(new_P, cap_l[r]) - min(P, cap_l[r])
            P = new_P

    best, flow = solve(P)
    if best > P:  # the local start was cut at a too-low peak: start again from it at the optimum
        best, flow = solve(best)
    flow_ER = np.zeros((E, R), np.int64)
    for e, f in enumerate(flow):
        for r, k in f.items():
            flow_ER[e, r] = k
    return torch.from_numpy(ref_split_by_source(counts, flow_ER, hold))


def ref_split_by_source(counts: np.ndarray, flow: np.ndarray, hold: np.ndarray) -> np.ndarray:
    """Turn per-(expert, rank) row totals into per-(expert, source, rank) counts: each source
    keeps its rows local as far as its own rank's share allows; the rest fill the remaining
    shares in (source, holder) order (north-west corner rule, vectorised over experts)."""
    E, S = counts.shape
    R = flow.shape[1]
    assign = np.zeros((E, S, R), np.int64)
    keep = np.where(hold, np.minimum(counts, flow), 0)  # S == R: source s is rank s
    idx = np.arange(S)
    assign[:, idx, idx] = keep
    left_s = counts - keep
    left_r = flow - keep
    H = int(hold.sum(1).max()) if E else 0
    if H == 0 or not left_s.any():
        return assign
    # holders of each expert as columns, padded with rank 0 carrying nothing
    order = np.argsort(~hold, axis=1, kind="stable")[:, :H]
    valid = np.take_along_axis(hold, order, 1)
    left_h = np.where(valid, np.take_along_axis(left_r, order, 1), 0)
    cs = left_s.cumsum(1)
    ch = left_h.cumsum(1)
    # rows of source s to holder column h: overlap of [cs_{s-1}, cs_s) and [ch_{h-1}, ch_h)
    lo = np.maximum((cs - left_s)[:, :, None], (ch - left_h)[:, None, :])
    hi = np.minimum(cs[:, :, None], ch[:, None, :])
    moved = np.clip(hi - lo, 0, None)  # (E, S, H)
    e, src, h = np.nonzero(moved)  # few: each source's rows span a handful of holders
    assign[e, src, order[e, h]] += moved[e, src, h]  # (e, src, rank) triples are distinct
    return assign


def ref_max_min_quotas(counts_E: torch.Tensor, holders: list[list[int]], cap_R: list[int]) -> torch.Tensor:
    """Max–min fair quotas by progressive filling, then leftover capacity filled.

    Each round looks for the largest ratio ρ at which every unfrozen expert can keep
    q(ρ, c_e) pairs (frozen ones keeping theirs). From ρ = 1 it runs a max-flow; a blocked
    flow names a set A of experts whose holders N(A) are full and serve A alone, so any
    feasible ρ satisfies Σ_{A} q ≤ cap(N(A)): ρ drops to the largest value meeting that and
    the flow is tried again. Every ρ tried bounds the answer from above, so the first feasible
    one is the round's ρ; the last blocking set is tight there and its unfrozen experts freeze.
    Every expert with pairs keeps at least one; a capacity too small for that is an error.
    """
    counts = counts_E.to(torch.long)
    c = counts.numpy()
    E, R = counts.numel(), len(cap_R)
    holders_of_rank = ref_experts_of_ranks(holders, R)

    # One flow, carried across every trial: lowering a target hands rows back (highest rank
    # first), raising it adds supply; the max-flow resumes from there.
    flow = [dict.fromkeys(hs, 0) for hs in holders]
    slack = list(cap_R)

    def place(target: np.ndarray):
        supply = []
        for e, f in enumerate(flow):
            excess = sum(f.values()) - int(target[e])
            for r in sorted(f, reverse=True):
                if excess <= 0:
                    break
                k = min(excess, f[r])
                f[r] -= k
                slack[r] += k
                excess -= k
            supply.append(max(-excess, 0))
        return ref_max_flow(flow, supply, slack, holders, holders_of_rank)

    frozen = np.zeros(E, bool)
    target = c.copy()
    while True:
        rho, tight = 1.0, None
        while True:
            trial = np.where(frozen, target, ref_quota(c, rho))
            blocked = place(trial)
            if blocked is None:
                break
            seen_e, seen_r = blocked
            seen = np.zeros(E, bool)
            seen[seen_e] = True
            active = seen & ~frozen
            room = sum(cap_R[r] for r in seen_r) - int(target[seen & frozen].sum())
            if not active.any() or int(ref_quota(c[active], 0.0).sum()) > room:
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts {seen_e} "
                    f"need at least {int(np.where(frozen, target, ref_quota(c, 0.0))[seen].sum())} kept rows, "
                    f"their holders {seen_r} can keep {sum(cap_R[r] for r in seen_r)}"
                )
            rho, tight = ref_largest_ratio(c[active], room), active
        if tight is None:
            target = trial
            break
        target = np.where(tight, ref_quota(c, rho), target)
        frozen |= tight
    # leftover capacity: frozen experts take what their holders still have room for
    ref_max_flow(flow, (c - target).tolist(), slack, holders, holders_of_rank)
    return torch.tensor([sum(f.values()) for f in flow], dtype=torch.long)


def ref_quota(c: np.ndarray, rho: float) -> np.ndarray:
    """The fixed-ratio quota of docs/design.md, vectorised in numpy (see selection.fixed_ratio_quota)."""
    q = np.minimum(np.maximum(np.ceil(rho * c.astype(np.float64) - 1e-6), 1.0), c)
    return np.where(c > 0, q, 0).astype(np.int64)


def ref_largest_ratio(c: np.ndarray, room: int) -> float:
    """Largest ρ in [0, 1] with Σ q(ρ, c_e) ≤ room; 0 if none."""
    if int(ref_quota(c, 1.0).sum()) <= room:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(50):  # q(ρ) is a step function; 50 halvings resolve every step
        mid = 0.5 * (lo + hi)
        if int(ref_quota(c, mid).sum()) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def ref_copies_by_load(load: list[float], copies: list[int], free_slots: int, world: int) -> list[int]:
    """Hand ``free_slots`` more copies out one at a time, each to the expert with the largest
    load per copy (D'Hondt; ties to the lower expert id), never more copies than ranks and none
    to an expert without load. ``copies`` gives the starting counts."""
    copies = list(copies)
    E = len(load)
    for _ in range(free_slots):
        e = max(range(E), key=lambda e: (load[e] / max(copies[e], 1) if copies[e] < world else -1.0, -e))
        if copies[e] >= world or load[e] <= 0:
            break
        copies[e] += 1
    return copies


def ref_place_copies(units: list[tuple[float, int]], rank_load: list[float], free: list[int],
                 holds: list[set[int]], node_of: list[int] | None = None) -> list[list[int]]:
    """LPT: copies (share of load, expert), heaviest first, each to the least-loaded rank with a
    free slot that does not hold the expert yet. With ``node_of`` (rank → node) the peak comes
    first, to within one row, and a node that lacks the expert second, so that more pairs can
    stay inside their node. Updates ``rank_load``, ``free`` and ``holds``; returns the experts
    placed on each rank."""
    placed: list[list[int]] = [[] for _ in rank_load]
    for share, e in sorted(units, key=lambda u: (-u[0], u[1])):
        options = [r for r in range(len(rank_load)) if free[r] > 0 and e not in holds[r]]
        if not options:
            continue
        if node_of is None:
            r = min(options, key=lambda r: (rank_load[r], r))
        else:
            nodes_with_e = {node_of[q] for q in range(len(rank_load)) if e in holds[q]}
            r = min(options, key=lambda r: (round(rank_load[r]), node_of[r] in nodes_with_e, rank_load[r], r))
        placed[r].append(e)
        holds[r].add(e)
        free[r] -= 1
        rank_load[r] += share
    return placed


def ref_plan_replicas(base: Placement, load_E: torch.Tensor, slots_R: list[int],
                  node_of: list[int] | None = None) -> Placement:
    """Replica placement from (smoothed) expert load: copies ∝ load, at least one per expert
    (the owner's), at most ``slots_R[r]`` experts on rank r, min-peak.

    Copies: :func:`copies_by_load`. Placement: :func:`place_copies`, rank loads starting from
    the owners' shares (``node_of``: topology-aware tie-breaking). Deterministic.
    """
    E, W = base.num_experts, base.world
    load = [max(float(v), 0.0) for v in load_E.tolist()]
    owned = [base.owned(r) for r in range(W)]
    free = [slots_R[r] - len(owned[r]) for r in range(W)]
    if any(f < 0 for f in free):
        r = min(range(W), key=lambda r: free[r])
        raise ValueError(f"rank {r} has {slots_R[r]} expert slots but owns {len(owned[r])} experts")
    copies = ref_copies_by_load(load, [1] * E, sum(free), W)
    rank_load = [sum(load[e] / copies[e] for e in owned[r]) for r in range(W)]
    units = [(load[e] / copies[e], e) for e in range(E) for _ in range(copies[e] - 1)]
    replicas = ref_place_copies(units, rank_load, free, [set(o) for o in owned], node_of)
    return base.with_replicas(replicas)


def ref_shadow_time(counts_SE: np.ndarray, owner_E: np.ndarray, shadow: np.ndarray, cost: CostModel) -> float:
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


def ref_shadow_experts(counts_SE: torch.Tensor, base: Placement, cost: CostModel) -> list[int]:
    """FasterMoE's dynamic shadowing decision for one call: experts by descending load, each
    shadowed while the predicted time keeps falling (the first that does not help stops it)."""
    counts = counts_SE.numpy().astype(np.float64)
    owner_E = base.owner_E.numpy()
    shadow = np.zeros(counts.shape[1], bool)
    best = ref_shadow_time(counts, owner_E, shadow, cost)
    for e in np.argsort(-counts.sum(0), kind="stable"):
        if counts[:, e].sum() == 0:
            break
        shadow[e] = True
        t = ref_shadow_time(counts, owner_E, shadow, cost)
        if t >= best:
            shadow[e] = False
            break
        best = t
    return sorted(int(e) for e in np.flatnonzero(shadow))


def ref_laer_layout(counts_E: torch.Tensor, base: Placement, slots_R: list[int]) -> Placement:
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
    copies = ref_copies_by_load(load, [1 if load[e] > 0 else 0 for e in range(E)], sum(slots_R) - len(needed), W)
    units = [(load[e] / copies[e], e) for e in needed for _ in range(copies[e])]
    slots = ref_place_copies(units, [0.0] * W, list(slots_R), [set() for _ in range(W)])
    owner_E = base.owner_E.clone()
    for r in reversed(range(W)):
        for e in slots[r]:
            owner_E[e] = r
    return Placement(E, tuple(tuple(sorted(s)) for s in slots), owner_E)


def ref_cumsum_within(x_EN: torch.Tensor, group_N: torch.Tensor) -> torch.Tensor:
    """Cumulative sums along N that restart in every group (members in index order)."""
    out = torch.empty_like(x_EN)
    for g in group_N.unique():
        idx = (group_N == g).nonzero().squeeze(1)
        out[:, idx] = x_EN[:, idx].cumsum(1)
    return out


def ref_in_order(supply_ES: torch.Tensor, demand_ER: torch.Tensor, group_S: torch.Tensor, group_R: torch.Tensor
              ) -> torch.Tensor:
    """Per expert and group, sources fill holders in rank order (the north-west corner rule):
    laid end to end on one axis, source s and holder r exchange the overlap of their intervals."""
    hi_S, hi_R = ref_cumsum_within(supply_ES, group_S), ref_cumsum_within(demand_ER, group_R)
    lo_S, lo_R = hi_S - supply_ES, hi_R - demand_ER
    flow = torch.minimum(hi_S[:, :, None], hi_R[:, None, :]) - torch.maximum(lo_S[:, :, None], lo_R[:, None, :])
    return flow.clamp(min=0) * (group_S[:, None] == group_R[None, :])


def ref_localize(assign_ESR: torch.Tensor, node_of: list[int]) -> torch.Tensor:
    """Re-match sources to holders without changing any rank's rows of any expert (so the peak
    is unchanged): first on the source rank itself, then inside its node, then across nodes, in
    rank order. For fixed per-holder totals this minimises the pairs that cross nodes."""
    supply_ES, demand_ER = assign_ESR.sum(2), assign_ESR.sum(1)
    out = torch.diag_embed(torch.minimum(supply_ES, demand_ER))  # on the source itself (S = R)
    node = torch.tensor(node_of[: assign_ESR.shape[1]])
    for group in (node, torch.zeros_like(node)):  # inside each node, then anywhere
        out = out + ref_in_order(supply_ES - out.sum(2), demand_ER - out.sum(1), group, group)
    return out
