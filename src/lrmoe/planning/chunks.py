"""How many rows a capped call computes at once: the largest chunk whose predicted peak fits a
cap (:func:`largest_fitting`, for every system's fit), a compacting backward's recompute chunks
(``BackwardConfig.recompute_chunk``) and, keeping gate/up, its forward's chunks. The peaks come
from :class:`lrmoe.planning.peaks.RankPeaks`, which replays the layer's meter on numbers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Protocol

from lrmoe.memory.bytes import KEEP_X_GATE_UP
from lrmoe.memory.replay import RankWork
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.placement import Placement


class RankPeaks(Protocol):
    """What chunk sizing reads of :class:`lrmoe.planning.peaks.RankPeaks` (a protocol: that
    module fits its plans with :func:`largest_fitting`, so this one imports nothing of it)."""

    world: int
    memory_R: list[int]

    def work(self, placement: Placement, r: int, rows: int, training: bool, chunk: int | None = None) -> RankWork: ...

    def peak(self, work: RankWork) -> int: ...

SECANT_PROBES = 3  # rounds of line guesses before largest_fitting bisects



def largest_fitting(peak_of: Callable[[int], int], rows: int, cap: int) -> tuple[int, int]:
    """(the largest chunk below ``rows`` whose peak ``peak_of(chunk)`` fits ``cap``, its peak); one
    row and its peak where none does. ``peak_of`` grows with the chunk. A chunk's transients grow
    linearly on top of what is held, so the peak is a line where they make it and flat elsewhere:
    the bracket is first narrowed where the line through its ends meets the cap (and the chunk
    above, which closes it where the guess is exact), then bisected — a handful of replays
    instead of a dozen."""
    lo, at_lo = 1, peak_of(1)
    if at_lo > cap or rows <= 2:
        return lo, at_lo
    up, at_up = rows - 1, peak_of(rows - 1)
    if at_up <= cap:
        return up, at_up
    for _ in range(SECANT_PROBES):  # peak_of(lo) <= cap < peak_of(up) throughout
        if up - lo <= 1:
            break
        guess = lo + (cap - at_lo) * (up - lo) // (at_up - at_lo)  # (at_up > cap >= at_lo)
        for mid in (guess, guess + 1):
            if lo < mid < up:
                at = peak_of(mid)
                if at > cap:
                    up, at_up = mid, at
                    break
                lo, at_lo = mid, at
    while up - lo > 1:
        mid = (lo + up) // 2
        at = peak_of(mid)
        if at <= cap:
            lo, at_lo = mid, at
        else:
            up, at_up = mid, at
    return lo, at_lo



# Keeping gate/up, a forward computes silu, h and y at least this many rows at a time (all of them
# where it has fewer): in smaller chunks its down products would turn into many small GEMMs, and
# keeping x alone (its forward chunked as the controller allows) fits instead. Chosen, not tuned.
GATE_UP_LEAST_CHUNK = 256



def gate_up_least_chunks(chunk_rows_R: list[int] | None, fwd_R: list[int]) -> list[int]:
    """The least rows each rank's forward computes silu, h and y of at once keeping gate/up: all
    of them on a rank whose forward the plan does not chunk (it computes all four activations at
    once, its backward planned meanwhile, and keeps gate/up of them:
    :func:`lrmoe.passes.forward.plans_backward_first`), else :data:`GATE_UP_LEAST_CHUNK`."""
    chunk_R = chunk_rows_R or [None] * len(fwd_R)
    return [int(n) if c is None or c >= n else min(GATE_UP_LEAST_CHUNK, int(n)) for c, n in zip(chunk_R, fwd_R)]



def gate_up_chunks(peaks: RankPeaks | None, placement: Placement, assignment: PairAssignment,
                   chunk_rows_R: list[int] | None, bwd_R: list[int]) -> list[int] | None:
    """Rows each rank's forward computes silu, h and y of at once beside every row's gate/up
    (a compacting call keeping x and gate/up, at most ``bwd_R`` kept rows): on a rank whose
    forward the plan (``chunk_rows_R``) chunks, all of them where that fits, else the largest
    chunk that does; all of them elsewhere (:func:`gate_up_least_chunks`). The plan's chunks
    without a cap."""
    if peaks is None:
        return chunk_rows_R
    fwd_R = [int(n) for n in assignment.rows_R()]
    least_R = gate_up_least_chunks(chunk_rows_R, fwd_R)
    chunked = [r for r in range(peaks.world) if least_R[r] < fwd_R[r]]
    works = [replace(peaks.work(placement, r, fwd_R[r], True), bwd_rows=int(bwd_R[r]), keep=KEEP_X_GATE_UP)
             for r in chunked]
    out = list(fwd_R)
    for r, c in zip(chunked, _largest_chunks(peaks, works, [fwd_R[r] for r in chunked], "chunk_rows", chunked)):
        out[r] = c
    return out



def recompute_chunks(peaks: RankPeaks | None, placement: Placement, assignment: PairAssignment,
                     chunk_rows_R: list[int] | None, keep: str, bwd_R: list[int], least: int) -> list[int]:
    """Rows each rank's compacting backward recomputes at once, keeping ``keep`` (x, or nothing)
    with at most ``bwd_R`` kept rows (``BackwardConfig.recompute_chunk``): without a cap
    ``least``; under one every kept row at once where that fits (``bwd_R``'s count), else the
    largest chunk that does (the kept capacities reserved room for ``least`` rows)."""
    if peaks is None:
        return [least] * len(placement.slots)
    fwd_R = assignment.rows_R()
    chunk_R = chunk_rows_R or [None] * peaks.world
    works = [replace(peaks.work(placement, r, int(fwd_R[r]), True, chunk_R[r]), bwd_rows=int(bwd_R[r]), keep=keep)
             for r in range(peaks.world)]
    return _largest_chunks(peaks, works, [int(n) for n in bwd_R], "bwd_chunk_rows", range(peaks.world))



def _largest_chunks(peaks: RankPeaks, works: list[RankWork], rows_R: list[int], field: str,
                    ranks: Iterable[int]) -> list[int]:
    """Per rank of ``ranks``, its ``rows_R`` rows where its work (``field`` unset: all at once)
    fits its cap, else the largest ``field`` chunk whose peak does."""
    out = []
    for r, work, rows in zip(ranks, works, rows_R):
        def peak_of(c: int, work: RankWork = work) -> int:
            return peaks.peak(replace(work, **{field: c}))

        rows = max(rows, 1)
        fits_whole = peaks.peak(work) <= peaks.memory_R[r]
        out.append(rows if fits_whole or rows == 1 else largest_fitting(peak_of, rows, peaks.memory_R[r])[0])
    return out
