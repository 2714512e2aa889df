"""Integer min-peak assignment of token–expert pairs to the ranks holding each expert.

Given ``counts_ES[e, s]`` pairs of expert e originating at rank s and the ranks holding a copy
of each expert, choose how many pairs each holder computes so that the peak per-rank load
``base_R + rows_R`` is the smallest possible (a rank's rows from its own tokens count), then
prefer keeping rows on their source rank.

Method: a parametric max-flow on the bipartite graph experts → holders, specialised for its
shape. Rows travel along augmenting paths e₀ → r₁ → e₁ → r₂ … → r_k (forward edges are
unbounded; going back from a rank to an expert moves rows that expert already has there to
another of its holders). The search starts from a lower bound on the peak P and a flow that
keeps rows local, augments to a maximum flow, and, while rows are left over, reads the
blocking set off the residual graph: the experts A still reachable from an unplaced row and
their holders N(A) receive rows from A only, so any assignment needs
Σ_{e∈A} n_e ≤ Σ_{r∈N(A)} (min(P, cap_r) − base_r). P jumps to the least value meeting that
bound and the flow resumes from where it was (capacities only grow). Every P tried is a lower
bound of the optimum, so the first P with a complete flow is optimal. Integral capacities give
integral flows. Everything is deterministic (lowest index first), so every rank computes the
same assignment.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _level_for(need: int, base: np.ndarray, cap: np.ndarray) -> int | None:
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


def experts_of_ranks(holders: list[list[int]], ranks: int) -> list[list[int]]:
    """The inverse of ``holders`` (expert → ranks holding it): rank → experts it holds, ascending."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    for e, hs in enumerate(holders):
        for r in hs:
            out[r].append(e)
    return out


def max_flow(flow, supply, slack, holders, holders_of_rank):
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
                path = _find_path(e0, flow, slack, holders, holders_of_rank, level_e, level_r, arc_e, arc_r)
                if path is None:
                    break
                delta = supply[e0]
                r_end = path[-1][1]
                delta = min(delta, slack[r_end])
                for e, r_in, _ in _hops(path):
                    if r_in is not None:
                        delta = min(delta, flow[e][r_in])
                for e, r_in, r_out in _hops(path):
                    flow[e][r_out] = flow[e].get(r_out, 0) + delta
                    if r_in is not None:
                        flow[e][r_in] -= delta
                supply[e0] -= delta
                slack[r_end] -= delta


def _hops(path):
    """(expert, rank it gives rows up at or None, rank it sends rows to) along a path."""
    for i, (e, r_out) in enumerate(path):
        yield e, (path[i - 1][1] if i else None), r_out


def _find_path(e0, flow, slack, holders, holders_of_rank, level_e, level_r, arc_e, arc_r):
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


def assign_min_peak(
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
    holders_of_rank = experts_of_ranks(holder_lists, R)
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
            blocked = max_flow(flow, supply, slack, holder_lists, holders_of_rank)
            if blocked is None:
                return P, flow
            seen_e, seen_r = blocked
            need = int(n_E[seen_e].sum())
            ranks = np.asarray(seen_r)
            level = _level_for(need, base[ranks], cap[ranks])
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
    return torch.from_numpy(_split_by_source(counts, flow_ER, hold))


def _split_by_source(counts: np.ndarray, flow: np.ndarray, hold: np.ndarray) -> np.ndarray:
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
