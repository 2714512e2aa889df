"""``largest_fitting``: the largest chunk whose peak fits a cap, for any peak that grows with the
chunk (flat, linear where a chunk's transient makes the peak, stepped), against brute force; and
in a few replays where the peak is linear in the chunk."""

from __future__ import annotations

import numpy as np

from lrmoe.planning.chunks import largest_fitting


def brute(peak_of, rows: int, cap: int) -> int:
    fitting = [c for c in range(1, rows) if peak_of(c) <= cap]
    return max(fitting) if fitting else 1


def test_the_largest_fitting_chunk_for_any_growing_peak():
    gen = np.random.default_rng(0)
    for _ in range(2000):
        rows = int(gen.integers(2, 200))
        kind = gen.integers(3)
        if kind == 0:  # max(a floor, a line): a chunk's transient on top of what is held
            floor, base, slope = (int(v) for v in gen.integers(0, 1000, 3))
            table = [max(floor, base + slope * c) for c in range(rows + 1)]
        elif kind == 1:  # steps of any size, flat runs included
            table = np.cumsum(gen.integers(0, 3, rows + 1) * gen.integers(0, 50, rows + 1)).tolist()
        else:  # a line bent upward
            table = [int(3 * c + 0.05 * c * c) for c in range(rows + 1)]
        cap = int(gen.integers(min(table), max(table) + 2))
        calls = []

        def peak_of(c: int, table=table, calls=calls) -> int:
            calls.append(c)
            return table[c]

        got, peak = largest_fitting(peak_of, rows, cap)
        assert got == brute(table.__getitem__, rows, cap), (rows, cap, table)
        assert peak == table[got] and all(1 <= c < rows for c in calls)


def test_a_linear_peak_takes_a_few_replays():
    """A chunk's transient on top of what is held, alone or above a floor that makes the peak of
    the small chunks (what the backward holds): a handful of replays, not a bisection's dozen."""
    for floor in (0, 1_000_000 + 4096 * 1500):
        calls = []

        def peak_of(c: int, floor: int = floor, calls: list = calls) -> int:
            calls.append(c)
            return max(floor, 1_000_000 + 4096 * c)

        chunk, peak = largest_fitting(peak_of, 4000, 1_000_000 + 4096 * 2345 + 17)
        assert (chunk, peak) == (2345, 1_000_000 + 4096 * 2345)
        assert len(calls) <= 8, (floor, calls)  # a bisection of 4000 rows: 13
