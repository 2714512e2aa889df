"""Dinic's max-flow on the bipartite graph experts → holders, in place on plain lists: the one
flow every planner of this package runs (:mod:`lrmoe.planning.balance`'s parametric min-peak
search, :mod:`lrmoe.planning.quotas`' progressive filling).

The residual graph. A forward edge e → r (r a holder of e) is unbounded; the residual edge
r → e carries the rows e already has on r (``flow[e][r]``), so going back from a rank to an
expert moves those rows to another of the expert's holders; rank r has ``slack[r]`` left toward
the sink. Rows travel along augmenting paths e₀ → r₁ → e₁ → r₂ … → r_k ending at a rank with
slack. Dinic's phases, each a function below: BFS levels from the experts with unplaced rows
(:func:`_levels`); a blocking flow along level-increasing paths found by DFS
(:func:`_blocking_flow`), each path taking its bottleneck (:func:`_augment`); and, once the BFS
reaches no rank with slack, the blocking set read off what it did reach: those ranks are full
and receive rows from those experts only (a rank with rows of another expert would have led the
search to it).

Everything runs lowest index first, so the flow is deterministic: every rank computes the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from lrmoe.planning.holders import fill_holders

Blocked = tuple[list[int], list[int]]  # a blocking set: (experts, ranks), each ascending


def max_flow(flow: list, supply: list[int], slack: list[int], holders: list[list[int]],
             holders_of_rank: list[list[int]], sources: Sequence[int] | None = None) -> Blocked | None:
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
    candidates = range(len(flow)) if sources is None else sources
    while True:
        starts = [e for e in candidates if supply[e] > 0]
        if not starts:
            return None
        level_e, level_r, depth, blocked = _levels(starts, flow, slack, holders, holders_of_rank)
        if blocked is not None:
            return blocked
        if not depth:
            # A rank with slack next to a source: the level graph has no backward edges, so the
            # blocking flow reduces to filling each source's holders in order.
            for e0 in starts:
                supply[e0] = fill_holders(flow[e0], supply[e0], holders[e0], slack)
            continue
        _blocking_flow(starts, level_e, level_r, flow, supply, slack, holders, holders_of_rank)


# The phases below take the residual graph's lists as arguments rather than as a state object's
# attributes: max_min_quotas runs a max-flow per trial, dozens per call, and attribute loads and
# an object per call were a measurable share of it.


def _levels(starts: list[int], flow: list, slack: list[int], holders: list[list[int]],
            holders_of_rank: list[list[int]]) -> tuple[list[int], list[int], int, Blocked | None]:
    """BFS levels from the experts ``starts`` with unplaced rows: (level of each expert, of each
    rank — −1 where not reached —, depth, blocked). Experts sit at even levels, ranks at odd; the
    search stops at the first level holding a rank with slack (at depth + 1), and where it never
    gets there, what it reached is the blocking set ``blocked`` (else None). Levels are
    distances, so any visiting order gives the same ones."""
    level_e = [-1] * len(flow)
    level_r = [-1] * len(slack)
    for e in starts:
        level_e[e] = 0
    frontier = starts
    seen_e, seen_r = list(frontier), []
    depth = 0
    while frontier:
        d1 = depth + 1
        ranks = []
        found = False
        for e in frontier:
            for r in holders[e]:
                if level_r[r] < 0:
                    level_r[r] = d1
                    ranks.append(r)
                    if slack[r] > 0:
                        found = True
        if found:
            return level_e, level_r, depth, None
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
    return level_e, level_r, depth, (sorted(seen_e), sorted(seen_r))


def _blocking_flow(starts: list[int], level_e: list[int], level_r: list[int], flow: list, supply: list[int],
                   slack: list[int], holders: list[list[int]], holders_of_rank: list[list[int]]) -> None:
    """Push rows from the ``starts`` along level-increasing paths e₀ → r₁ → e₁ → … → r_k (r_k a
    rank with slack) until the level graph has none: iterative DFS from each source in
    ascending order while it has rows, with current-arc pointers (every edge is tried once a
    phase), holders and back edges in ascending order. Dead ends get level −2: out of the
    phase. (One call a phase, the DFS inline: most searches end at a dead end, and a call per
    search was a measurable share of max_min_quotas.)"""
    arc_e = [0] * len(flow)  # next holder to try
    arc_r = [0] * len(slack)  # next expert to try going backward from a rank
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
            _augment(stack, via, flow, supply, slack)


def _augment(stack: list[int], via: list[int], flow: list, supply: list[int], slack: list[int]) -> None:
    """Push the path's bottleneck along it — the least of the source's supply, the last rank's
    slack and the rows each later expert has on the rank before it: every expert on the path
    then has that many rows one rank further along."""
    e0, end = stack[0], via[-1]
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
