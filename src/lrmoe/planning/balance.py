"""Integer min-peak assignment of token–expert pairs to the ranks holding each expert.

Given ``counts_ES[e, s]`` pairs of expert e originating at rank s and the ranks holding a copy
of each expert, choose how many pairs each holder computes so that the peak per-rank load
``base_R + rows_R`` is the smallest possible (a rank's rows from its own tokens count), then
prefer keeping rows on their source rank.

Method: a parametric max-flow on the bipartite graph experts → holders, specialised for its
shape (:func:`lrmoe.planning.flow.max_flow`). Rows travel along augmenting paths
e₀ → r₁ → e₁ → r₂ … → r_k (forward edges are unbounded; going back from a rank to an expert
moves rows that expert already has there to another of its holders). The search starts from a
lower bound on the peak P and a flow that keeps rows local, augments to a maximum flow, and,
while rows are left over, reads the blocking set off the residual graph: the experts A still
reachable from an unplaced row and their holders N(A) receive rows from A only, so any
assignment needs Σ_{e∈A} n_e ≤ Σ_{r∈N(A)} (min(P, cap_r) − base_r). P jumps to the least value
meeting that bound and the flow resumes from where it was (capacities only grow). Every P tried
is a lower bound of the optimum, so the first P with a complete flow is optimal. Integral
capacities give integral flows. Everything is deterministic (lowest index first), so every rank
computes the same assignment. The result is a :class:`~lrmoe.planning.assignment.PairAssignment`
(rows per (expert, holder) and source); :func:`assign_min_peak` gives it as a dense (E, S, R)
tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.flow import max_flow
from lrmoe.planning.holders import HolderIndex, holder_index


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
    every (expert, holder), holders ascending.

    The search from the sharper lower bound of :meth:`_PeakSearch.lower_bounds` meets the same
    optimum, and so the same flow, as from the plain one; only an infeasible capacity's message
    depends on the peaks tried, so that case reruns from the plain bound."""
    search = _PeakSearch(*_checked(counts_ES, holders, capacity_R, base_R), base_R is not None)
    P, plain = search.lower_bounds()
    try:
        best, flow = search.solve(P)
    except ValueError:
        if plain == P:
            raise
        best = None
    if best is None:
        search.solve(plain)  # the same infeasibility, met along the plain bound's peaks: its message
        raise AssertionError("unreachable: the capacity is infeasible from any start")
    if best > P:  # the local start was cut at a too-low peak: start again from it at the optimum
        best, flow = search.solve(best)
    return search.assignment(flow)


_NO_CAP = 1 << 40  # "no capacity": far above any row count, and sums of it cannot overflow


def _checked(counts_ES: torch.Tensor, holders: Sequence[Sequence[int]] | HolderIndex,
             capacity_R: torch.Tensor | Sequence[int] | None, base_R: torch.Tensor | Sequence[int] | None,
             ) -> tuple[np.ndarray, HolderIndex, np.ndarray, np.ndarray, np.ndarray]:
    """The inputs of :func:`min_peak_assignment` as (counts (E, S), holder index, base (R,),
    capacity (R,), pairs per expert (E,)), int64 arrays of their own; ``ValueError`` naming the
    first fault, in expert order, of inputs no assignment can meet."""
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
    cap = np.full(R, _NO_CAP, np.int64) if capacity_R is None else np.asarray(capacity_R, dtype=np.int64).copy()
    n_E, flat = counts.sum(1), index.rank_H
    if (len(flat) and (flat.min() < 0 or flat.max() >= R)) or n_E[index.sizes_E == 0].any():
        for e, hs in enumerate(index.lists):  # the first expert at fault, in expert order
            if not hs and n_E[e] > 0:
                raise ValueError(f"expert {e} has {int(n_E[e])} pairs but no holder")
            for r in hs:
                if not 0 <= r < R:
                    raise ValueError(f"holder {r} of expert {e} is not a rank in [0, {R})")
    if (base_R is not None or capacity_R is not None) and (base > cap).any():
        r = int(np.argmax(base > cap))
        raise ValueError(f"rank {r}: base load {int(base[r])} already exceeds its capacity {int(cap[r])}")
    return counts, index, base, cap, n_E


class _PeakSearch:
    """The parametric max-flow of this module on one checked input: the lower bound to start
    from, the flow at a peak P (local rows first), and P raised past each blocking set.

    (``rows[j]``, ``flat[j]``): expert rows[j] and one of its holders, experts then ranks
    ascending (the holder index's entries)."""

    def __init__(self, counts: np.ndarray, index: HolderIndex, base: np.ndarray, cap: np.ndarray,
                 n_E: np.ndarray, based: bool) -> None:
        self.counts, self.index, self.base, self.cap, self.n_E = counts, index, base, cap, n_E
        self.based = based  # base_R was given (else every base is 0)
        self.E, self.R = counts.shape[0], len(base)
        rows, flat = index.expert_H, index.rank_H
        self.own = counts[rows, flat]  # rows of each expert from its holder's own rank (S == R)
        local_D = np.zeros((self.E, self.R), np.int64)
        local_D[rows, flat] = self.own
        self.before = (local_D.cumsum(0) - local_D)[rows, flat]  # rows kept local, lowest expert index first
        self.n_l, self.cap_l, self.base_l = self.n_E.tolist(), cap.tolist(), base.tolist()
        self.rows_l, self.flat_l = rows.tolist(), flat.tolist()

    def lower_bounds(self) -> tuple[int, int]:
        """(P, plain): lower bounds on the optimal peak, P the sharper. Plain: no rank below its
        base, and some holder of each expert takes at least n_e / |H_e| rows on top of the
        smallest base among its holders; experts with one holder all land on it.

        Sharper: those single-holder experts on e's holders must fit there beside e, so one of
        e's holders takes (n_e + theirs) / |H_e| on top of the smallest base."""
        n_E, base, index, R = self.n_E, self.base, self.index, self.R
        flat, sizes, starts = index.rank_H, index.sizes_E, index.starts_E
        used = n_E > 0
        P = int(base.max()) if R else 0
        has = sizes > 0  # every used expert
        min_base = np.full(self.E, _NO_CAP, np.int64) if self.based else np.zeros(self.E, np.int64)
        if self.based and has.any():
            min_base[has] = np.minimum.reduceat(base[flat], starts[has])
        if used.any():
            P = max(P, int((min_base[used] + -(-n_E[used] // sizes[used])).max()))
        single = used & (sizes == 1)  # experts with one holder must all land on it
        plain = P
        if single.any():
            only = np.bincount(flat[starts[single]], weights=n_E[single], minlength=R).astype(np.int64)
            P = plain = max(P, int((base + only).max()))
            multi = used & (sizes > 1)
            if multi.any():
                need = n_E[multi] + np.add.reduceat(only[flat], starts[has])[multi[has]]
                P = max(P, int((min_base[multi] + -(-need // sizes[multi])).max()))
        return P, plain

    def solve(self, P: int) -> tuple[int, list[list[int]]]:
        """Flow from the local start at peak P, raising P until complete. Returns (P, flow)."""
        flow, supply, slack = self.local_start(P)
        holder_lists, holders_of_rank, cap_l = self.index.lists, self.index.of_rank, self.cap_l
        while True:
            blocked = max_flow(flow, supply, slack, holder_lists, holders_of_rank)
            if blocked is None:
                return P, flow
            new_P = max(P + 1, self.peak_past(*blocked))
            for r in range(self.R):  # capacities only grow: the flow resumes from where it was
                slack[r] += min(new_P, cap_l[r]) - min(P, cap_l[r])
            P = new_P

    def local_start(self, P: int) -> tuple[list[list[int]], list[int], list[int]]:
        """(flow, supply, slack) at peak P with rows kept on their source rank as far as each
        holder's room min(P, cap_r) − base_r allows, lowest expert index first."""
        E, R, rows, flat = self.E, self.R, self.index.expert_H, self.index.rank_H
        limit = np.minimum(P, self.cap) - self.base
        local = np.minimum(np.maximum(limit[flat] - self.before, 0), self.own)
        flow = [[0] * R for _ in range(E)]  # rows of expert e on rank r (holders only)
        for e, r, k in zip(self.rows_l, self.flat_l, local.tolist()):
            if k:
                flow[e][r] = k
        supply = (self.n_E - np.bincount(rows, local, E).astype(np.int64)).tolist()
        slack = (limit - np.bincount(flat, local, R).astype(np.int64)).tolist()
        return flow, supply, slack

    def peak_past(self, seen_e: list[int], seen_r: list[int]) -> int:
        """The least peak at which the blocking set's ranks N(A) have room for its experts' pairs
        (they receive rows from A only: Σ_{e∈A} n_e ≤ Σ_{r∈N(A)} (min(P, cap_r) − base_r));
        ``ValueError`` where no peak does."""
        n_l, cap_l, base_l = self.n_l, self.cap_l, self.base_l
        need = sum(n_l[e] for e in seen_e)
        level = _level_for(need, [base_l[r] for r in seen_r], [cap_l[r] for r in seen_r])
        if level is None:
            raise ValueError(
                f"infeasible capacity: experts {seen_e} have {need} pairs, their holders {seen_r} "
                f"have room for {sum(max(cap_l[r] - base_l[r], 0) for r in seen_r)}"
            )
        return level

    def assignment(self, flow: list[list[int]]) -> PairAssignment:
        """The complete flow's rows per (expert, holder), split over the source ranks."""
        flow_H = np.array([flow[e][r] for e, r in zip(self.rows_l, self.flat_l)], np.int64)
        index = self.index
        return PairAssignment(index.expert_H, index.rank_H, _split_by_source(self.counts, flow_H, index), self.E)


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
