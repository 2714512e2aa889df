"""Budgets → expert slots, forward chunking, and per-expert backward quotas.

Our formulation (the paper's exact one is not public), per rank r with memory budget M_r for
the layer's expert side and dtype size s:

- an expert slot (a copy's parameters plus its gradient buffer) costs ``2·3·D·F·s``;
- the complete forward holds every received row's x and y (``2·D·s`` per row, plus 8 bytes of
  ‖h‖² for the selective systems) and, per row being computed, gate, up, silu(gate) and h
  (``4·F·s``): where all rows do not fit, they are computed in chunks that do;
- a kept backward row holds dy, x and the recomputed gate, up, silu, h: ``(2·D + 4·F)·s``;
- with replicas, their gradients travel to owners through a buffer of one copy's parameters
  per replica, and the owned weights are copied once more into the concatenated slot weights.

So rank r can keep ``cap_r = (M_r − slots − replica buffers) / ((2D + 4F)·s)`` backward rows,
further bounded by the network budget N_r / (3·D·s) (dy and x in, dx out per kept row).

Quotas are max–min fair: the largest common retention ratio ρ with q_e = q(ρ, c_e) (the fixed-
ratio quota) such that the kept pairs can be spread over each expert's holders within every
cap_r (a max-flow), found by progressive filling — a blocking set of experts whose holders are
full gets the largest ratio their capacity allows and is frozen, the rest continue — then
leftover capacity is filled. Deterministic and identical on every rank.
"""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.balance import experts_of_ranks, holder_lists_of, max_flow
from lrmoe.config import ClusterBudget, MoEConfig
from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.meter import ByteModel
from lrmoe.placement import Placement

# Share of the memory left after owned experts that a budget-derived plan may give to replicas.
REPLICA_MEMORY_SHARE = 0.25


class Controller:
    """Turns a :class:`ClusterBudget` into slots, forward chunks and backward quotas."""

    def __init__(self, config: MoEConfig, budget: ClusterBudget, world: int) -> None:
        self.config, self.budget, self.world = config, budget, world
        self.memory_R, self.network_R, self.fixed_slots_R = budget.per_rank(world)
        self.costs = ByteModel.of(config)

    # ------------------------------------------------------------------ slots
    def slots(self, base: Placement) -> list[int]:
        """Expert slots per rank: the budget's fixed slots, or owned experts plus a share of the
        remaining memory. Raises :class:`MemoryBudgetExceeded` if a rank cannot hold one copy of
        each expert it owns."""
        out = []
        for r in range(self.world):
            owned = len(base.owned(r))
            need = owned * self.costs.slot
            if self.memory_R[r] < need:
                raise MemoryBudgetExceeded(r, need, self.memory_R[r], f"its {owned} owned experts need "
                                           f"{self.costs.slot} bytes each (parameters + gradients)", "its experts")
            if self.fixed_slots_R is not None:
                slots = self.fixed_slots_R[r]
            else:
                spare = (self.memory_R[r] - need) * REPLICA_MEMORY_SHARE
                slots = owned + int(spare // self.costs.slot)
            out.append(min(max(slots, owned), self.config.num_experts))
        return out

    def _slot_bytes(self, placement: Placement, r: int) -> int:
        return self.costs.slots_reserved(len(placement.slots[r]), len(placement.owned(r)))

    def check_slots(self, placement: Placement) -> None:
        for r in range(self.world):
            used = self._slot_bytes(placement, r)
            if used > self.memory_R[r]:
                raise MemoryBudgetExceeded(r, used, self.memory_R[r], "fewer replica slots would help: "
                                           "ClusterBudget(slots=...)", f"its {len(placement.slots[r])} expert slots")

    # ------------------------------------------------------------------ forward
    def forward_chunk_rows(self, placement: Placement, rank: int, recv_rows: int) -> int:
        """Rows the complete forward may compute at once on ``rank`` within its budget; raises
        :class:`MemoryBudgetExceeded` where not even one row fits beside every received row's x, y."""
        slots = self._slot_bytes(placement, rank)
        room = self.memory_R[rank] - slots - recv_rows * self.costs.fwd_io
        chunk = room // self.costs.fwd_compute
        if recv_rows and chunk < 1:
            raise MemoryBudgetExceeded(
                rank, slots + recv_rows * self.costs.fwd_io + self.costs.fwd_compute, self.memory_R[rank],
                f"its slots take {slots} and its {recv_rows} received rows {recv_rows * self.costs.fwd_io} (x and y), "
                f"one row computed needs {self.costs.fwd_compute}; a larger cap or fewer tokens per call would help"
                + (", or fewer replica slots (ClusterBudget(slots=...))" if placement.replicas(rank) else ""),
                "the complete forward")
        return int(max(min(chunk, recv_rows), 1))

    def forward_rows_capacity(self, placement: Placement, rank: int) -> int:
        """Most received rows whose x and y fit on ``rank`` beside one row being computed (the
        bound :meth:`forward_chunk_rows` needs), for a forward assignment within the budget."""
        room = self.memory_R[rank] - self._slot_bytes(placement, rank) - self.costs.fwd_compute
        return int(max(room, 0) // self.costs.fwd_io)

    # ------------------------------------------------------------------ backward
    def kept_capacity(self, placement: Placement) -> list[int]:
        """Backward rows each rank can keep within its memory (and network) budget."""
        caps = []
        # a kept row's dy, x and recomputed activations; at least dy, x and x's slot-major copy
        per_row = max(self.costs.bwd_kept, 3 * self.costs.row)
        for r in range(self.world):
            room = self.memory_R[r] - self._slot_bytes(placement, r)
            cap = max(room, 0) // per_row
            if self.network_R is not None:
                cap = min(cap, self.network_R[r] // self.costs.bwd_wire)
            caps.append(int(cap))
        return caps

    def quotas(self, counts_E: torch.Tensor, placement: Placement, cap_R: list[int] | None = None
               ) -> torch.Tensor:
        """Max–min fair quotas (int64, E) for the global per-expert counts of one call; raises
        :class:`MemoryBudgetExceeded` where the budget cannot keep one pair of every expert with
        pairs (its rank: the one holding the most such experts beyond its kept capacity)."""
        cap_R = self.kept_capacity(placement) if cap_R is None else cap_R
        try:
            return max_min_quotas(counts_E, placement.holder_lists, cap_R)
        except ValueError as e:
            busy = [sum(1 for e_ in placement.slots[r] if int(counts_E[e_]) > 0) for r in range(self.world)]
            r = max(range(self.world), key=lambda r: (busy[r] - cap_R[r], -r))
            per_row = max(self.costs.bwd_kept, 3 * self.costs.row)
            raise MemoryBudgetExceeded(
                r, self._slot_bytes(placement, r) + max(busy[r], cap_R[r] + 1) * per_row, self.memory_R[r],
                f"{e}; a larger cap or fewer replica slots would help", "one kept pair per expert") from None


def max_min_quotas(counts_E: torch.Tensor, holders: list[list[int]], cap_R: list[int]) -> torch.Tensor:
    """Max–min fair quotas by progressive filling, then leftover capacity filled.

    Each round looks for the largest ratio ρ at which every unfrozen expert can keep
    q(ρ, c_e) pairs (frozen ones keeping theirs). From ρ = 1 it runs a max-flow; a blocked
    flow names a set A of experts whose holders N(A) are full and serve A alone, so any
    feasible ρ satisfies Σ_{A} q ≤ cap(N(A)): ρ drops to the largest value meeting that and
    the flow is tried again. Every ρ tried bounds the answer from above, so the first feasible
    one is the round's ρ; the last blocking set is tight there and its unfrozen experts freeze.
    Every expert with pairs keeps at least one; a capacity too small for that is an error.

    How it is computed: a blocking set is the source side of the minimal minimum cut, the same
    for every maximum flow of the trial's targets, and it can only shrink when targets drop. So
    each trial solves the max-flow only among the experts of an earlier blocking set that bounds
    it (the previous round's first set for a round's first trial, the previous trial's set
    within a round), from whatever flow the last trial left. Leftover capacity is then handed
    out in the max-flow's path order, which depends on the whole history of the flow: where any
    is left for a frozen expert, the reference (:func:`_max_min_quotas_by_flows`) runs instead.
    """
    counts = counts_E.to(torch.long)
    c = counts.numpy()
    E, R = counts.numel(), len(cap_R)
    holder_lists = holder_lists_of(holders)
    cap = [int(x) for x in cap_R]
    if (c < 0).any() or (c >= 1 << 52).any() or any(x < 0 or x != y for x, y in zip(cap, cap_R)) or any(
            hs and (hs[0] < 0 or hs[-1] >= R) for hs in holder_lists):
        return _max_min_quotas_by_flows(counts_E, holders, cap_R)
    holders_of_rank = experts_of_ranks(holder_lists, R)
    c_l = c.tolist()
    c_f = [float(x) for x in c_l]

    # One flow carried through every trial (any flow gives the same blocking sets, so it only
    # needs to be valid): a trial moves it to its targets on its domain and augments.
    flow = [[0] * R for _ in range(E)]  # rows of expert e on rank r (holders only)
    placed = [0] * E
    slack = list(cap)

    def trial_cut(fl, pl, sl, target, domain):
        """Move the flow to ``target`` on ``domain`` (every expert whose blocking status may
        change) and return the blocking set (experts, ranks) or None."""
        supply = [0] * E
        for e in domain:
            t, p = target[e], pl[e]
            if p > t:  # hand rows back, highest rank first
                excess, f = p - t, fl[e]
                for r in reversed(holder_lists[e]):
                    k = f[r]
                    if k:
                        d = k if k < excess else excess
                        f[r] = k - d
                        sl[r] += d
                        excess -= d
                        if not excess:
                            break
            elif p < t:
                supply[e] = t - p
        for e in domain:  # rows that fit on a holder directly go there first
            s = supply[e]
            if s:
                f = fl[e]
                for r in holder_lists[e]:
                    k = sl[r]
                    if k > 0:
                        d = s if s < k else k
                        f[r] += d
                        sl[r] = k - d
                        s -= d
                        if not s:
                            break
                supply[e] = s
        blocked = max_flow(fl, supply, sl, holder_lists, holders_of_rank, domain)
        for e in domain:
            pl[e] = target[e] - supply[e]
        return blocked

    frozen = [False] * E
    target = list(c_l)  # q(1, c) = c for every count below 2⁵²: unfrozen experts stay at c
    domain = list(range(E))
    while True:
        rho, tight = 1.0, None
        trial = list(target)
        blocked = trial_cut(flow, placed, slack, trial, domain)
        first = True
        while blocked is not None:
            seen_e, seen_r = blocked
            if first:  # the next round's trials are bounded by this round's first set
                domain, first = seen_e, False
            active = [e for e in seen_e if not frozen[e]]
            room = sum(cap[r] for r in seen_r) - sum(target[e] for e in seen_e if frozen[e])
            if not active or len(active) > room:  # q(0, c) = 1: an active expert has c > 0
                need = sum(target[e] if frozen[e] else _quota_of(c_l[e], 0.0) for e in seen_e)
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts {seen_e} "
                    f"need at least {need} kept rows, "
                    f"their holders {seen_r} can keep {sum(cap[r] for r in seen_r)}"
                )
            rho = _ratio_of([c_l[e] for e in active], room)  # active experts have pairs
            if rho is None:
                rho = _largest_ratio(c[active], room)
            tight = active
            for e in active:
                q = -((1e-6 - rho * c_f[e]) // 1.0)  # _quota_of(c_e, rho), inline
                trial[e] = int(1.0 if q < 1.0 else (c_f[e] if q > c_f[e] else q))
            blocked = trial_cut(flow, placed, slack, trial, seen_e)
        if tight is None:
            target = trial
            break
        for e in tight:
            target[e] = trial[e]  # the quota at the round's ρ
            frozen[e] = True
    # Leftover capacity for frozen experts: where none is reachable (the usual case) the
    # quotas are the targets; else the reference's flow decides who gets it.
    wanted = [c_l[e] - target[e] for e in range(E)]
    left = list(wanted)
    short = [e for e in range(E) if left[e]]
    if short:
        max_flow(flow, left, slack, holder_lists, holders_of_rank, short)
        if left != wanted:
            return _max_min_quotas_by_flows(counts_E, holders, cap_R)
    return torch.from_numpy(np.array(target, dtype=np.int64))


def _max_min_quotas_by_flows(counts_E: torch.Tensor, holders: list[list[int]], cap_R: list[int]) -> torch.Tensor:
    """The reference implementation of :func:`max_min_quotas`: one flow carried through every
    trial and the leftover fill. Used where the leftover fill hands out rows (its result depends
    on that flow) or on inputs outside the fast path (negative counts or capacities)."""
    counts = counts_E.to(torch.long)
    c = counts.numpy()
    E, R = counts.numel(), len(cap_R)
    holders_of_rank = experts_of_ranks(holders, R)

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
        return max_flow(flow, supply, slack, holders, holders_of_rank)

    frozen = np.zeros(E, bool)
    target = c.copy()
    while True:
        rho, tight = 1.0, None
        while True:
            trial = np.where(frozen, target, _quota(c, rho))
            blocked = place(trial)
            if blocked is None:
                break
            seen_e, seen_r = blocked
            seen = np.zeros(E, bool)
            seen[seen_e] = True
            active = seen & ~frozen
            room = sum(cap_R[r] for r in seen_r) - int(target[seen & frozen].sum())
            if not active.any() or int(_quota(c[active], 0.0).sum()) > room:
                raise ValueError(
                    f"budget too small to keep one pair of every expert with tokens: experts {seen_e} "
                    f"need at least {int(np.where(frozen, target, _quota(c, 0.0))[seen].sum())} kept rows, "
                    f"their holders {seen_r} can keep {sum(cap_R[r] for r in seen_r)}"
                )
            rho, tight = _largest_ratio(c[active], room), active
        if tight is None:
            target = trial
            break
        target = np.where(tight, _quota(c, rho), target)
        frozen |= tight
    # leftover capacity: frozen experts take what their holders still have room for
    max_flow(flow, (c - target).tolist(), slack, holders, holders_of_rank)
    return torch.tensor([sum(f.values()) for f in flow], dtype=torch.long)


def _quota(c: np.ndarray, rho: float) -> np.ndarray:
    """The fixed-ratio quota of docs/design.md, vectorised in numpy (see selection.fixed_ratio_quota)."""
    q = np.minimum(np.maximum(np.ceil(rho * c.astype(np.float64) - 1e-6), 1.0), c)
    return np.where(c > 0, q, 0).astype(np.int64)


def _quota_of(c: int, rho: float) -> int:
    """:func:`_quota` of one count, in plain floats (the same IEEE operations, so the same value)."""
    if c <= 0:
        return 0
    q = -(-(rho * float(c) - 1e-6) // 1.0)  # ceil, as a float like np.ceil
    return int(min(max(q, 1.0), float(c)))


_GRID = 2.0**-50  # _largest_ratio's bisection settles on a multiple of this
_TOP = (1 << 50) - 1  # the largest multiple of _GRID below 1, in units of _GRID


def _largest_ratio(c: np.ndarray, room: int) -> float:
    """Largest ρ in [0, 1] with Σ q(ρ, c_e) ≤ room; 0 if none: 1 itself, else the largest
    multiple of 2⁻⁵⁰ below 1 with Σ q ≤ room (what 50 halvings of [0, 1] settle on).

    q is a step function of ρ: expert e's quota passes k at ρ = (k + 10⁻⁶) / c_e, so the answer
    sits just below the (room − n + 1)-th of those steps, found among the few near the solution
    of the piecewise-linear relaxation; the grid points around it are checked against the exact
    sum, and the bisection runs where that check fails."""
    rho = _ratio_of([x for x in c.tolist() if x > 0], room)
    if rho is not None:
        return rho
    lo, hi = 0.0, 1.0
    for _ in range(50):  # q(ρ) is a step function; 50 halvings resolve every step
        mid = 0.5 * (lo + hi)
        if int(_quota(c, mid).sum()) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def _ratio_of(counts: list[int], room: int) -> float | None:
    """:func:`_largest_ratio` of the positive ``counts``, or None where its check fails."""
    if sum(counts) <= room and max(counts, default=0) < 1 << 52:  # q(1, x) = x: all fit
        return 1.0
    extra = room - len(counts)  # steps above one pair each that fit
    if extra < 0:
        return 0.0  # even one pair each does not fit, at any ρ > 0
    step = _step(counts, extra) if max(counts) < 1 << 52 else None
    if step is None:
        return None
    floats = [float(x) for x in counts]
    m = min(int(step / _GRID), _TOP)
    for _ in range(4):
        if m == 0 or _fits(floats, m * _GRID, room):
            break
        m -= 1
    else:
        return None
    for _ in range(4):
        if m == _TOP or not _fits(floats, (m + 1) * _GRID, room):
            return m * _GRID
        m += 1
    return None


def _fits(counts: list[float], rho: float, room: int) -> bool:
    """Σ_e _quota(c_e, ρ) ≤ room over positive counts, in the same float operations."""
    total = 0.0
    for x in counts:
        q = -((1e-6 - rho * x) // 1.0)  # ceil(ρ·x − 1e-6): fl(b − a) = −fl(a − b)
        total += 1.0 if q < 1.0 else (x if q > x else q)
    return total <= room


def _step(counts: list[int], extra: int) -> float | None:
    """The (extra + 1)-th smallest of the steps (k + 10⁻⁶) / c, 1 ≤ k < c, over the counts c;
    None if there are not that many (or, rarely, if rounding hides it: the caller then bisects).

    Steps of c at or below ρ: clip(⌊ρ·c − 10⁻⁶⌋, 0, c − 1), within 1 of the relaxation
    f(ρ) = Σ min(ρ·c, c − 1) (10⁻⁶ aside), which is piecewise linear: counts at or below
    1 / (1 − ρ) are capped. The wanted step lies between f⁻¹(extra) and f⁻¹(extra + 1 + n),
    where at most about 2n + 1 steps lie: list those and pick."""
    n = len(counts)
    if sum(counts) - n <= extra:
        return None
    xs = sorted(counts)
    suffix = [0] * (n + 1)
    for j in range(n - 1, -1, -1):
        suffix[j] = suffix[j + 1] + xs[j]
    bounds = []
    j = capped = 0  # xs[:j] capped at c − 1, contributing `capped`
    for y in (extra, extra + 1 + n):
        while True:
            if suffix[j] == 0:
                rho = 1.0
                break
            rho = (y - capped) / suffix[j]
            if j < n and rho >= 1.0 - 1.0 / xs[j]:
                capped += xs[j] - 1
                j += 1
                continue
            break
        bounds.append(min(max(rho, 0.0), 1.0))
    lo, hi = bounds
    below = 0
    window = []
    for x in counts:
        k_lo = int(lo * x - 1e-6)  # steps of x at or below lo (truncation is the floor here)
        k_lo = 0 if k_lo < 0 else (x - 1 if k_lo >= x else k_lo)
        k_hi = int(hi * x - 1e-6)
        k_hi = 0 if k_hi < 0 else (x - 1 if k_hi >= x else k_hi)
        below += k_lo
        if k_hi > k_lo:
            window += [(k + 1e-6) / x for k in range(k_lo + 1, k_hi + 1)]
    i = extra - below  # position of the wanted step among those in (lo, hi]
    if not 0 <= i < len(window):
        return None
    window.sort()
    return window[i]
