"""The fixed-ratio quota q(ρ, c) = clip(⌈ρ·c − ε⌉, 1, c) of docs/design.md (0 where c = 0) and
the largest common ratio ρ whose quotas fit a room: the arithmetic behind
:func:`lrmoe.planning.quotas.max_min_quotas`'s rounds, in the same IEEE operations as the
reference bisection, so the same values.

This module is the quota's one home: :data:`QUOTA_EPS`, the scalar form :func:`quota_float`
(which every loop here calls), the numpy form :func:`quota_array` and the torch form
:func:`fixed_ratio_quota` give the same values for every count and ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from heapq import heapify, heappop, heapreplace

import numpy as np
import torch

QUOTA_EPS = 1e-6  # ε of q(ρ, c): keeps 0.1·30, a few ulps above 3 in floats, from becoming 4


def quota_float(rho: float, x: float) -> float:
    """q(ρ, c) of one positive count as a float, ``x`` = float(c) (exact below 2⁵³).

    The ceiling is taken as −⌊ε − ρ·x⌋: IEEE subtraction is sign-symmetric, fl(b − a) =
    −fl(a − b), and ``y // 1.0`` is ⌊y⌋ exactly, so this is ⌈fl(fl(ρ·x) − ε)⌉ — numpy's and
    torch's ceil of the same operations — without a call into math."""
    q = -((QUOTA_EPS - rho * x) // 1.0)
    return 1.0 if q < 1.0 else (x if q > x else q)


def quota_of(c: int, rho: float) -> int:
    """q(ρ, c) of one count as an int (:func:`quota_float`; 0 where c ≤ 0)."""
    return int(quota_float(rho, float(c))) if c > 0 else 0


def quota_array(c: np.ndarray, rho: float) -> np.ndarray:
    """q(ρ, c) of every count, vectorised in numpy: int64, the same IEEE operations as :func:`quota_float`."""
    q = np.minimum(np.maximum(np.ceil(rho * c.astype(np.float64) - QUOTA_EPS), 1.0), c)
    return np.where(c > 0, q, 0).astype(np.int64)


def fixed_ratio_quota(counts_E: torch.Tensor, ratio: float | Sequence[float]) -> torch.Tensor:
    """q(ρ, c) of every count of ``counts_E`` at ρ = ``ratio``, in torch on the counts' device: int64,
    the same float64 IEEE operations as :func:`quota_array` (ρ·c, − ε, ceil), so the same values.
    ``ratio`` a sequence of C ratios: the (C, E) quotas of each, in one pass."""
    c = counts_E.to(torch.float64)
    if not isinstance(ratio, float | int):  # (as float64: a float32 ρ would round to other quotas)
        ratio = torch.tensor(ratio, dtype=torch.float64, device=c.device).view(-1, 1)
    q = torch.clamp(torch.ceil(ratio * c - QUOTA_EPS), min=1.0)
    q = torch.minimum(q, c)
    return torch.where(counts_E > 0, q, torch.zeros_like(q)).to(torch.long)


_GRID = 2.0**-50  # largest_ratio's bisection settles on a multiple of this
_TOP = (1 << 50) - 1  # the largest multiple of _GRID below 1, in units of _GRID


def largest_ratio(c: np.ndarray, room: int) -> float:
    """Largest ρ in [0, 1] with Σ q(ρ, c_e) ≤ room; 0 if none: 1 itself, else the largest
    multiple of 2⁻⁵⁰ below 1 with Σ q ≤ room (what 50 halvings of [0, 1] settle on).

    q is a step function of ρ: expert e's quota passes k at ρ = (k + ε) / c_e, so the answer
    sits just below the (room − n + 1)-th of those steps, found among the few near the solution
    of the piecewise-linear relaxation; the grid points around it are checked against the exact
    sum, and the bisection runs where that check fails."""
    rho = _ratio_of([x for x in c.tolist() if x > 0], room)
    if rho is not None:
        return rho
    lo, hi = 0.0, 1.0
    for _ in range(50):  # q(ρ) is a step function; 50 halvings resolve every step
        mid = 0.5 * (lo + hi)
        if int(quota_array(c, mid).sum()) <= room:
            lo = mid
        else:
            hi = mid
    return lo


def fair_quotas(counts: list[int], floats: list[float], room: int) -> list[int]:
    """q(ρ, c) of the positive ``counts`` (each below 2⁵²; ``floats``: the same as floats) at
    ρ = :func:`largest_ratio` of them: the same float operations as :func:`quota_array`. The usual
    case in one pass: the quotas at the candidate of :func:`_ratio_of`, kept once that pass
    shows it stands (Σ q ≤ room there and > room one grid point above)."""
    total = sum(counts)
    if total <= room:  # ρ = 1
        return list(counts)
    extra = room - len(counts)
    if extra >= 0 and total < 1 << 53:  # else ρ = 0, or sums of floats are not exact
        m = int(_step(counts, extra, total) / _GRID)  # there are enough steps: Σ c > room
        if 0 < m < _TOP:
            rho = m * _GRID
            above = rho + _GRID
            quotas = []
            at = up = 0.0
            for x in floats:  # partial sums are integers below 2⁵³: exact, in any order
                q = quota_float(rho, x)
                quotas.append(int(q))
                at += q
                up += quota_float(above, x)
            if at <= room < up:
                return quotas
    rho = _ratio_of(counts, room, floats)
    if rho is None:
        rho = largest_ratio(np.array(counts, dtype=np.int64), room)
    return [quota_of(x, rho) for x in counts]


def _ratio_of(counts: list[int], room: int, floats: list[float] | None = None) -> float | None:
    """:func:`largest_ratio` of the positive ``counts`` (``floats``: the same as floats, if at
    hand), or None where its check fails.

    The candidate is the grid point just below the (room − n + 1)-th smallest step of q (see
    :func:`_step`); it stands only once the exact sum says so — Σ q ≤ room there and > room one
    grid point above — moving a few grid points where rounding put it off (else None). The sum is
    of floats while Σ c < 2⁵³ (every partial sum is then an exact integer), else of ints."""
    total = sum(counts)
    if max(counts, default=0) >= 1 << 52:
        return 0.0 if room < len(counts) else None
    if total <= room:  # q(1, x) = x: all fit
        return 1.0
    extra = room - len(counts)  # steps above one pair each that fit
    if extra < 0:
        return 0.0  # even one pair each does not fit, at any ρ > 0
    step = _step(counts, extra, total)
    if step is None:
        return None
    if floats is None:
        floats = [float(x) for x in counts]
    m = min(int(step / _GRID), _TOP)
    if total < 1 << 53 and 0 < m < _TOP:
        at, above = _sums(floats, m * _GRID, (m + 1) * _GRID)
        if at <= room < above:  # the usual case: the candidate stands
            return m * _GRID
    fits = _fits if total < 1 << 53 else _fits_exactly
    for _ in range(4):
        if m == 0 or fits(floats, m * _GRID, room):
            break
        m -= 1
    else:
        return None
    for _ in range(4):
        if m == _TOP or not fits(floats, (m + 1) * _GRID, room):
            return m * _GRID
        m += 1
    return None


def _sums(counts: list[float], rho: float, rho2: float) -> tuple[float, float]:
    """Σ_e quota_array(c_e, ρ) and the same at ρ2, over positive counts, in :func:`_fits`'s float
    operations (one pass for both)."""
    total = total2 = 0.0
    for x in counts:
        total += quota_float(rho, x)
        total2 += quota_float(rho2, x)
    return total, total2


def _fits(counts: list[float], rho: float, room: int) -> bool:
    """Σ_e quota_array(c_e, ρ) ≤ room over positive counts, in the same float operations."""
    total = 0.0
    for x in counts:
        total += quota_float(rho, x)
    return total <= room


def _fits_exactly(counts: list[float], rho: float, room: int) -> bool:
    """:func:`_fits` summed as ints, for counts whose total reaches 2⁵³."""
    total = 0
    for x in counts:
        total += int(quota_float(rho, x))
    return total <= room


def _step(counts: list[int], extra: int, total: int) -> float | None:
    """The (extra + 1)-th smallest of the steps (k + ε) / c, 1 ≤ k < c, over the counts c
    (``total`` = Σ c); None if there are not that many.

    Steps of c at or below ρ: k_c(ρ) = clip(⌊ρ·c − ε⌋, 0, c − 1), within ½ of ρ·c − ½ (ε
    aside) whether clipped or not. So at ρ₀ = (extra + 1 + n/2) / Σ c < 1 their number g lies
    within about n/2 of extra + 1 (usually within 1 or 2), and the wanted step is reached by
    walking |g − extra − 1| steps from ρ₀ in order — down through the largest steps at or below
    ρ₀, or up through the smallest above it — each count's next one kept in a heap. Rounding can
    only misplace steps within a few ulps of ρ₀ (or, for counts near 2⁵², count one too many),
    and the caller checks the result on the exact sums."""
    n = len(counts)
    if total - n <= extra:
        return None
    want = extra + 1
    if n == 1:
        return (want + QUOTA_EPS) / counts[0]
    rho = (want + 0.5 * n) / total
    ks = [int(rho * x - QUOTA_EPS) for x in counts]  # truncation is the floor here: ρ·x − ε > −1
    d = sum(ks) - want
    if d >= 0:  # drop the d largest steps at or below ρ₀: the largest left is the one
        if not d:
            return max([(k + QUOTA_EPS) / x for k, x in zip(ks, counts) if k])
        heap = [(-(k + QUOTA_EPS) / x, k, x) for k, x in zip(ks, counts) if k]
        heapify(heap)
        for _ in range(d):
            _, k, x = heap[0]
            if k > 1:
                heapreplace(heap, (-(k - 1 + QUOTA_EPS) / x, k - 1, x))
            else:
                heappop(heap)
        return -heap[0][0]
    if d == -1:  # the smallest step above ρ₀
        return min([(k + 1 + QUOTA_EPS) / x for k, x in zip(ks, counts) if k + 1 < x])
    heap = [((k + 1 + QUOTA_EPS) / x, k + 1, x) for k, x in zip(ks, counts) if k + 1 < x]
    heapify(heap)
    for _ in range(-d - 1):  # take the smallest steps above ρ₀ until `want` are counted
        _, k, x = heap[0]
        if k + 1 < x:
            heapreplace(heap, ((k + 1 + QUOTA_EPS) / x, k + 1, x))
        else:
            heappop(heap)
    return heap[0][0]
