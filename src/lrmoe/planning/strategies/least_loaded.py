"""LLEP-style least-loaded spilling, per call (after Least-Loaded Expert Parallelism): each rank
computes at most ``factor × mean`` rows; experts are taken by load, largest first, their owner
keeps what fits under that cap, and the overflow goes in chunks of at least a minimum GEMM size
to the rank with the fewest rows so far, which gets a copy of the expert for this call.

:func:`least_loaded_rows` is the one decision, in integers, identical on every rank: with every
rank a candidate it is the strategy's plan (where the copies go); within a placement's holders
it is the assignment rule (:func:`lrmoe.planning.pair_rules.assign_pairs`), so the plan's own
placement gets back exactly the rows that placed it, and a placement with fewer copies (a memory
cap's) sends the overflow to the least-loaded copy that is left."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from lrmoe.planning.placement import Placement
from lrmoe.planning.quota_ratio import QUOTA_EPS
from lrmoe.planning.strategies.base import PlacementStrategy

FACTOR = 1.1  # a rank's rows are capped at FACTOR × (pairs of the call / ranks)
MIN_GEMM_ROWS = 64  # the smallest chunk an expert spills (its whole overflow where that is less)


def row_cap(total: int, world: int, factor: float = FACTOR) -> int:
    """⌈factor · total / world⌉ (at least 1), with the fixed-ratio quota's ε so that a product a
    few ulps above an integer (1.1 · 120 = 132.00000000000003) stays that integer."""
    return max(1, math.ceil(factor * total / world - QUOTA_EPS))


def _chunk(left: int, room: int, min_rows: int) -> int:
    """Rows of an expert's ``left`` overflow the least-loaded rank takes, with ``room`` rows left
    under its cap: everything where that fits or no two chunks of ``min_rows`` can be cut from
    it; else its room, at least ``min_rows``, leaving at least ``min_rows`` for the next."""
    if left <= max(room, min_rows) or left < 2 * min_rows:
        return left
    return max(min_rows, min(room, left - min_rows))


def least_loaded_rows(counts_E: Sequence[int], owner_E: Sequence[int], world: int,
                      holders: Sequence[Sequence[int]] | None = None, factor: float = FACTOR,
                      min_rows: int = MIN_GEMM_ROWS) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Rows of each expert each rank computes, int64 (E, W), and the (expert, rank) copies away
    from the owner in the order they were first given rows.

    Experts by load, largest first (ties: the lower id). The owner keeps
    ``min(load, cap − its rows)``; while rows are left, the least-loaded candidate (fewest rows,
    then the lower rank) takes a chunk (:func:`_chunk`): every chunk is at least ``min_rows``, or
    the expert's whole overflow where that is smaller. Candidates: every rank (``holders``
    None), else the expert's holders. With every rank a candidate the least-loaded one always
    has room (W · cap ≥ the call's pairs), so a rank goes over the cap only where no rank had
    ``min_rows`` of room left or the rest could not be cut into chunks of ``min_rows``, and then
    by less than ``2 · min_rows``; with ``min_rows`` 1, never."""
    counts = [int(c) for c in counts_E]
    owner = [int(o) for o in owner_E]
    E = len(counts)
    cap = row_cap(sum(counts), world, factor)
    rows_EW = np.zeros((E, world), np.int64)
    load = [0] * world
    spills: list[tuple[int, int]] = []
    everyone = list(range(world))
    for e in sorted(range(E), key=lambda e: (-counts[e], e)):
        left, o = counts[e], owner[e]
        if left <= 0:
            break
        kept = min(left, max(cap - load[o], 0))
        rows_EW[e, o] += kept
        load[o] += kept
        left -= kept
        candidates = everyone if holders is None else list(holders[e])
        while left > 0:
            r = min(candidates, key=lambda q: (load[q], q))
            # a lone candidate takes every chunk: all at once
            chunk = left if len(candidates) == 1 else _chunk(left, cap - load[r], min_rows)
            if r != o and rows_EW[e, r] == 0:
                spills.append((e, r))
            rows_EW[e, r] += chunk
            load[r] += chunk
            left -= chunk
    return rows_EW, spills


def holder_rows(counts_E: torch.Tensor, placement: Placement) -> np.ndarray:
    """:func:`least_loaded_rows` within ``placement``'s holders: the rule's rows (E, W)."""
    return least_loaded_rows(counts_E.tolist(), placement.owner_E.tolist(), placement.world,
                             placement.holder_lists)[0]


class LeastLoaded(PlacementStrategy):
    """Per call: a copy wherever :func:`least_loaded_rows` spills an expert; under a cap the
    most of those copies (in the order they were made) whose plan fits."""

    varies_copies = True

    def _spills(self, counts_SE: torch.Tensor) -> list[tuple[int, int]]:
        return least_loaded_rows(counts_SE.sum(0).tolist(), self.base.owner_E.tolist(), self.base.world)[1]

    def _with(self, spills: list[tuple[int, int]]) -> Placement:
        replicas: list[list[int]] = [[] for _ in range(self.base.world)]
        for e, r in spills:
            replicas[r].append(e)
        return self.base.with_replicas(replicas)

    def call_placement(self, counts_SE: torch.Tensor, slots_R: list[int] | None) -> Placement:
        return self._with(self._spills(counts_SE))

    def fit_call(self, counts_SE, slots_R, fitter, forward_SE, training):
        spills = self._spills(counts_SE)
        _, fit = fitter.longest_prefix(lambda k: self._with(spills[:k]), len(spills), forward_SE, training)
        return fit, self.figures(fit.placement)
