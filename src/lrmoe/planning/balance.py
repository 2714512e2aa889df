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
same assignment. The result is a :class:`~lrmoe.planning.assignment.PairAssignment` (rows per
(expert, holder) and source); :func:`assign_min_peak` gives it as a dense (E, S, R) tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.holders import HolderIndex, fill_holders, holder_index


def _level_for(need: int, base: list[int], cap: list[int]) -> int | None:
    """Least P with Σ_r clip(min(P, cap_r) − base_r, 0) ≥ need, or None if even P = ∞ fails.
    Rank r's room grows by one per unit of P between base_r and cap_r: sweep those knots."""
    spans = [(b, c) for b, c in zip(base, cap) if c > b]
    if sum(c - b for b, c in spans) < need:
        return None
    if need <= 0:
        return min(base)
    room = slope = 0
    at = None
    for p, d in sorted([(b, 1) for b, _ in spans] + [(c, -1) for _, c in spans]):
        if at is not None and room + slope * (p - at) >= need:
            return at + -(-(need - room) // slope)
        if at is not None:
            room += slope * (p - at)
        at = p
        slope += d
    raise AssertionError("unreachable: the total room covers need")


def max_flow(flow, supply, slack, holders, holders_of_rank, sources=None):
    """Place ``supply[e]`` more rows of each expert on its holders within ``slack``: Dinic's
    algorithm on the residual graph, in place on plain lists. Returns None when every unit is
    placed, else (experts, ranks) reachable from unplaced units: the blocking set, whose ranks
    are full and receive rows from those experts only.

    ``flow[e]`` maps each holder rank (every one of them) → rows of e there; a forward edge
    e → r is unbounded, the residual edge r → e carries flow[e][r]; rank r has ``slack[r]``
    left toward the sink.
    ``sources`` (ascending experts), when given, must contain every expert with supply: the
    search then starts from those alone instead of scanning every expert.
    """
    E, R = len(flow), len(slack)
    candidates = range(E) if sources is None else sources
    while True:
        # BFS levels from every expert with unplaced rows (levels are distances: any visiting
        # order gives the same ones).
        frontier = [e for e in candidates if supply[e] > 0]
        if not frontier:
            return None
        starts = frontier
        level_e = [-1] * E
        level_r = [-1] * R
        for e in frontier:
            level_e[e] = 0
        seen_e, seen_r = list(frontier), []
        depth, found = 0, False
        while frontier:
            d1 = depth + 1
            ranks = []
            for e in frontier:
                for r in holders[e]:
                    if level_r[r] < 0:
                        level_r[r] = d1
                        ranks.append(r)
                        if slack[r] > 0:
                            found = True
            if found:
                break
            seen_r += ranks
            d2 = depth + 2
            frontier = []
            for r in ranks:
                for e in holders_of_rank[r]:
                    if level_e[e] < 0 and flow[e][r] > 0:
                        level_e[e] = d2
                        frontier.append(e)
            seen_e += frontier
            depth = d2
        if not found:
            return sorted(seen_e), sorted(seen_r)
        if not depth:
            # A rank with slack next to a source: the level graph has no backward edges, so the
            # blocking flow below reduces to filling each source's holders in order.
            for e0 in starts:
                supply[e0] = fill_holders(flow[e0], supply[e0], holders[e0], slack)
            continue
        # Blocking flow along level-increasing paths: iterative DFS with current-arc pointers,
        # sources in ascending order, holders and back edges in ascending order.
        arc_e = [0] * E  # next holder to try
        arc_r = [0] * R  # next expert to try going backward from a rank
        for e0 in starts:
            while supply[e0] > 0 and level_e[e0] == 0:
                stack = [e0]  # experts on the path; stack[i] sends rows to via[i]
                via = []
                end = -1
                while stack:
                    e = stack[-1]
                    hs = holders[e]
                    n_h = len(hs)
                    up = level_e[e] + 1
                    a = arc_e[e]
                    advanced = False
                    while a < n_h:
                        r = hs[a]
                        if level_r[r] == up:
                            if slack[r] > 0:
                                end = r
                                break
                            # go backward to an expert with rows at r, one level deeper
                            hr = holders_of_rank[r]
                            n_r = len(hr)
                            b = arc_r[r]
                            while b < n_r:
                                e2 = hr[b]
                                if level_e[e2] == up + 1 and flow[e2][r] > 0:
                                    break
                                b += 1
                            arc_r[r] = b
                            if b < n_r:
                                via.append(r)
                                stack.append(hr[b])
                                advanced = True
                                break
                        a += 1
                    arc_e[e] = a
                    if end >= 0:
                        break
                    if not advanced:
                        stack.pop()
                        level_e[e] = -2  # dead end for this phase
                        if via:
                            via.pop()
                if end < 0:
                    break
                via.append(end)
                delta = min(supply[e0], slack[end])
                for i in range(1, len(stack)):
                    k = flow[stack[i]][via[i - 1]]
                    if k < delta:
                        delta = k
                for i, e in enumerate(stack):
                    f = flow[e]
                    r = via[i]
                    f[r] += delta
                    if i:
                        f[via[i - 1]] -= delta
                supply[e0] -= delta
                slack[end] -= delta


def assign_min_peak(
    counts_ES: torch.Tensor,
    holders: Sequence[Sequence[int]] | HolderIndex,
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

    The dense form of :func:`min_peak_assignment`, which the layer calls.
    """
    return min_peak_assignment(counts_ES, holders, capacity_R, base_R).dense()


def min_peak_assignment(
    counts_ES: torch.Tensor,
    holders: Sequence[Sequence[int]] | HolderIndex,
    capacity_R: torch.Tensor | Sequence[int] | None = None,
    base_R: torch.Tensor | Sequence[int] | None = None,
) -> PairAssignment:
    """:func:`assign_min_peak` as a :class:`~lrmoe.planning.assignment.PairAssignment`: one entry for
    every (expert, holder), holders ascending."""
    if isinstance(counts_ES, torch.Tensor) and counts_ES.dtype == torch.int64:
        counts = counts_ES.numpy()  # a view, perhaps transposed: copied once, in the split
    else:
        counts = np.asarray(counts_ES, dtype=np.int64)
    E, S = counts.shape
    R = S
    n_holders = len(holders.lists if isinstance(holders, HolderIndex) else holders)
    if n_holders != E:
        raise ValueError(f"holders has {n_holders} entries, counts_ES has {E} experts")
    if counts.size and counts.min() < 0:
        raise ValueError("counts_ES must be non-negative")
    index = holder_index(holders, R)
    base = np.zeros(R, np.int64) if base_R is None else np.asarray(base_R, dtype=np.int64).copy()
    big = 1 << 40  # "no capacity": far above any row count, and sums of it cannot overflow
    cap = np.full(R, big, np.int64) if capacity_R is None else np.asarray(capacity_R, dtype=np.int64).copy()
    n_E = counts.sum(1)
    holder_lists, flat, rows = index.lists, index.rank_H, index.expert_H
    sizes, starts = index.sizes_E, index.starts_E
    if (len(flat) and (flat.min() < 0 or flat.max() >= R)) or n_E[sizes == 0].any():
        for e, hs in enumerate(holder_lists):  # the first expert at fault, in expert order
            if not hs and n_E[e] > 0:
                raise ValueError(f"expert {e} has {int(n_E[e])} pairs but no holder")
            for r in hs:
                if not 0 <= r < R:
                    raise ValueError(f"holder {r} of expert {e} is not a rank in [0, {R})")
    if (base_R is not None or capacity_R is not None) and (base > cap).any():
        r = int(np.argmax(base > cap))
        raise ValueError(f"rank {r}: base load {int(base[r])} already exceeds its capacity {int(cap[r])}")
    # (rows[j], flat[j]): expert rows[j] and one of its holders, experts then ranks ascending

    # A lower bound to start from: no rank below its base, and some holder of each expert takes
    # at least n_e / |H_e| rows on top of the smallest base among its holders.
    used = n_E > 0
    P = int(base.max()) if R else 0
    has = sizes > 0  # every used expert
    min_base = np.zeros(E, np.int64) if base_R is None else np.full(E, big, np.int64)
    if base_R is not None and has.any():
        min_base[has] = np.minimum.reduceat(base[flat], starts[has])
    if used.any():
        P = max(P, int((min_base[used] + -(-n_E[used] // sizes[used])).max()))
    single = used & (sizes == 1)  # experts with one holder must all land on it
    plain = P
    if single.any():
        only = np.bincount(flat[starts[single]], weights=n_E[single], minlength=R).astype(np.int64)
        P = plain = max(P, int((base + only).max()))
        # A sharper start: those single-holder experts on e's holders must fit there beside e,
        # so one of e's holders takes (n_e + theirs) / |H_e| on top of the smallest base. From
        # any lower bound the search meets the same optimum and so the same flow; only an
        # infeasible capacity's message depends on the peaks tried, so that case reruns from
        # the plain bound.
        multi = used & (sizes > 1)
        if multi.any():
            need = n_E[multi] + np.add.reduceat(only[flat], starts[has])[multi[has]]
            P = max(P, int((min_base[multi] + -(-need // sizes[multi])).max()))

    holders_of_rank = index.of_rank
    own = counts[rows, flat]  # rows of each expert from its holder's own rank (S == R)
    local_D = np.zeros((E, R), np.int64)
    local_D[rows, flat] = own
    before = (local_D.cumsum(0) - local_D)[rows, flat]  # rows kept local, lowest expert index first
    n_l = n_E.tolist()
    cap_l = cap.tolist()
    base_l = base.tolist()
    rows_l, flat_l = rows.tolist(), flat.tolist()

    def solve(P: int):
        """Flow from the local start at peak P, raising P until complete. Returns (P, flow)."""
        limit = np.minimum(P, cap) - base
        local = np.minimum(np.maximum(limit[flat] - before, 0), own)
        flow = [[0] * R for _ in range(E)]  # rows of expert e on rank r (holders only)
        for e, r, k in zip(rows_l, flat_l, local.tolist()):
            if k:
                flow[e][r] = k
        supply = (n_E - np.bincount(rows, local, E).astype(np.int64)).tolist()
        slack = (limit - np.bincount(flat, local, R).astype(np.int64)).tolist()
        while True:
            blocked = max_flow(flow, supply, slack, holder_lists, holders_of_rank)
            if blocked is None:
                return P, flow
            seen_e, seen_r = blocked
            need = sum(n_l[e] for e in seen_e)
            level = _level_for(need, [base_l[r] for r in seen_r], [cap_l[r] for r in seen_r])
            if level is None:
                raise ValueError(
                    f"infeasible capacity: experts {seen_e} have {need} pairs, their holders {seen_r} "
                    f"have room for {sum(max(cap_l[r] - base_l[r], 0) for r in seen_r)}"
                )
            new_P = max(P + 1, level)
            for r in range(R):
                slack[r] += min(new_P, cap_l[r]) - min(P, cap_l[r])
            P = new_P

    try:
        best, flow = solve(P)
    except ValueError:
        if plain == P:
            raise
        best = None
    if best is None:
        solve(plain)  # the same infeasibility, met along the plain bound's peaks: its message
        raise AssertionError("unreachable: the capacity is infeasible from any start")
    if best > P:  # the local start was cut at a too-low peak: start again from it at the optimum
        best, flow = solve(best)
    flow_H = np.array([flow[e][r] for e, r in zip(rows_l, flat_l)], np.int64)
    return PairAssignment(rows, flat, _split_by_source(counts, flow_H, index), E)


def _split_by_source(counts: np.ndarray, flow_H: np.ndarray, index: HolderIndex) -> np.ndarray:
    """Turn per-(expert, holder) row totals (``flow_H[h]`` rows of entry h's expert on its
    rank) into per-(entry, source) rows ``rows_HS``: each source keeps its rows local as far as
    its own rank's share allows; the rest fill the remaining shares in (source, holder) order
    (north-west corner rule, vectorised over experts)."""
    rows, cols = index.expert_H, index.rank_H
    out = np.zeros((len(rows), counts.shape[1]), np.int64)
    if not len(rows):
        return out
    keep = np.minimum(counts[rows, cols], flow_H)  # S == R: source s is rank s
    left_h = flow_H - keep
    if left_h.any():
        left_s = counts.copy()
        left_s[rows, cols] -= keep
        cs = left_s.cumsum(1)
        cs0 = cs - left_s
        first = index.starts_E[rows]  # each entry's expert's first entry
        ch = left_h.cumsum()
        ch -= ch[first] - left_h[first]
        ch0 = ch - left_h
        # rows of source s to entry h: overlap of [cs0_s, cs_s) and [ch0_h, ch_h) of h's expert
        np.minimum(cs[rows], ch[:, None], out=out)
        out -= np.maximum(cs0[rows], ch0[:, None])
        np.maximum(out, 0, out=out)
    # a source never sends rows to itself above (its own share or its own rows are used up)
    out[np.arange(len(rows)), cols] = keep
    return out
