"""Keeping by the row: how much of one rank's received rows keeps what to the backward under its
cap (docs/design.md "Keep by the row"). Pure search over a peak function, so the byte model it
is given (:meth:`lrmoe.planning.peaks.RankPeaks.peak`) is the only thing that decides.

Each row's parts, richest first: x and the four activations (nothing recomputed), x and gate/up
(silu and h recomputed), x alone (gate/up/h recomputed). A gate/up row saves the backward two
GEMMs for half the bytes of an activations row, which saves it two elementwise ops more: so the
rows are first raised from x to gate/up, as many as fit, and only then from gate/up to the
activations, and again while either raise fits (a chunk's transients shrink as its part does,
so the bytes are not monotone in the parts). The result is maximal: raising any one more row a
step exceeds the cap (a test checks it), and the chunks are the largest that fit beside the
kept rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lrmoe.memory.bytes import RowSplit

# Rows a chunk while the parts are chosen; the chunks then grow to the largest that fits beside
# the chosen parts. On configs/paper.toml's hot rank under 0.65x of static's peak, the backward
# took 110 / 100 / 100 / 107 ms at 128 / 512 / 1024 / 2048 (plain, uncapped: 85): small chunks
# cost more in per-chunk work than the rows they let keep save in recompute, large ones keep too
# few rows (benchmarks/bench_capped.py's shape, 2 ranks, CPU).
SEARCH_CHUNK = 512

PeakOf = Callable[[RowSplit, int, int], int]  # (split, forward chunk, backward chunk) -> peak bytes


@dataclass(frozen=True)
class ByRow:
    """One rank's parts and chunks, and its predicted peak."""

    split: RowSplit
    chunk: int  # forward rows computed at once (recomputed parts)
    bwd_chunk: int  # backward rows worked at once
    peak: int


def last_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The n in [lo, hi] found by bisection with ``fits(n)`` and not ``fits(n + 1)`` (n = hi where
    ``fits(hi)``); ``fits(lo)`` must hold."""
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def fit_by_row(peak_of: PeakOf, rows: int, cap: int) -> ByRow:
    """The richest split of ``rows`` rows within ``cap`` (:func:`richest`) at chunks of
    :data:`SEARCH_CHUNK` rows (or, where not even x alone fits at those, the largest smaller
    chunks that fit it), then the largest forward and backward chunks beside it. The peak is
    over the cap where not even x alone in chunks of one row fits."""
    x_alone = RowSplit(0)
    chunk = bwd_chunk = max(1, min(SEARCH_CHUNK, rows))

    def fits(split: RowSplit, c: int, b: int) -> bool:
        return peak_of(split, c, b) <= cap

    if not fits(x_alone, chunk, bwd_chunk):
        if not fits(x_alone, 1, 1):
            return ByRow(x_alone, 1, 1, peak_of(x_alone, 1, 1))
        chunk = last_fitting(lambda c: fits(x_alone, c, 1), 1, chunk)
        bwd_chunk = last_fitting(lambda b: fits(x_alone, chunk, b), 1, bwd_chunk)
    split = richest(lambda s: fits(s, chunk, bwd_chunk), rows)
    chunk = last_fitting(lambda c: fits(split, c, bwd_chunk), chunk, max(rows, chunk))
    bwd_chunk = last_fitting(lambda b: fits(split, chunk, b), bwd_chunk, max(rows, bwd_chunk))
    return ByRow(split, chunk, bwd_chunk, peak_of(split, chunk, bwd_chunk))


def richest(fits: Callable[[RowSplit], bool], rows: int) -> RowSplit:
    """From x alone (which must fit): the most rows raised x → gate/up, then the most of those
    raised gate/up → activations, again until no single raise fits."""
    split = RowSplit(0)
    while True:
        acts = split.acts
        kept = last_fitting(lambda k: fits(RowSplit(acts, k - acts)), acts + split.gate_up, rows)  # noqa: B023
        acts = last_fitting(lambda a: fits(RowSplit(a, kept - a)), acts, kept)  # noqa: B023
        split = RowSplit(acts, kept - acts)
        if not any(fits(richer) for richer in split.richer(rows)):
            return split
