"""Keeping by the row, the search alone (:mod:`lrmoe.planning.row_split`): each rank's split is
within its cap and maximal (one more row kept a step richer, or a chunk one row larger, exceeds
the cap), ranks choose independently (a cold rank keeps everything), x alone is what keeping x in
chunks was, and a call every rank keeps whole runs as uncapped. (The split executed and metered
on the real layer: tests/layer/test_by_row.py.)"""

from __future__ import annotations

import random

import pytest
import torch

from lrmoe import MoEConfig
from lrmoe.memory.bytes import KEEP_X, RowSplit
from lrmoe.memory.replay import RankWork, expert_side_peak
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.peaks import RankPeaks
from lrmoe.planning.placement import Placement
from lrmoe.planning.row_split import SEARCH_CHUNK, last_fitting
from lrmoe.systems import spec_of

CFG = MoEConfig(dim=32, ffn_dim=48, num_experts=8, top_k=2)


def _peaks(system: str, world: int, cap: int) -> RankPeaks:
    return RankPeaks(spec_of(system), CFG, world, [cap] * world, keep=KEEP_X, by_row=True)


def test_last_fitting_finds_an_edge():
    for edge in (0, 1, 7, 63, 64):
        assert last_fitting(lambda n, e=edge: n <= e, 0, 64) == edge


@pytest.mark.parametrize("world", [1, 2, 4])
def test_x_alone_is_keeping_x_in_chunks(world):
    """RowSplit(0) with chunks below the rows predicts the peak keeping x of every row did."""
    for rows, chunk, bwd in [(100, 10, 7), (300, 128, 128), (57, 1, 1)]:
        old = RankWork(rows, rows, 3, 2, chunk, world, True, 0, True, KEEP_X, bwd)
        new = RankWork(rows, rows, 3, 2, chunk, world, True, 0, True, KEEP_X, bwd, RowSplit(0))
        assert expert_side_peak("static", 32, 48, 4, old) == expert_side_peak("static", 32, 48, 4, new)


@pytest.mark.parametrize("system,world", [("static", 1), ("static", 2), ("symi", 4), ("llep", 2)])
def test_split_is_within_the_cap_and_maximal(system, world):
    rng = random.Random(world)
    placement = Placement.static(CFG.num_experts, world)
    for _ in range(40):
        rows = rng.randint(1, 3 * SEARCH_CHUNK)
        full = _peaks(system, world, 1 << 40)
        top = full.peak(full.work(placement, 0, rows, True, rows, rows, RowSplit(rows)))
        least = full.peak(full.work(placement, 0, rows, True, 1, 1, RowSplit(0)))
        cap = rng.randint(least, top + 1000)
        peaks = _peaks(system, world, cap)
        chunk, bwd, peak, split = peaks.rank_fit(placement, 0, rows, True)

        def peak_of(s: RowSplit, c: int, b: int, peaks: RankPeaks = peaks, rows: int = rows) -> int:
            return peaks.peak(peaks.work(placement, 0, rows, True, c, b, s))

        assert peak == peak_of(split, chunk, bwd) <= cap, (rows, cap, split)
        assert split.acts + split.gate_up <= rows
        for richer in split.richer(rows):
            assert peak_of(richer, chunk, bwd) > cap, (rows, cap, split, richer)
        if chunk < rows and split.acts < rows:
            assert peak_of(split, chunk + 1, bwd) > cap, (rows, cap, split, chunk)
        if bwd < rows:
            assert peak_of(split, chunk, bwd + 1) > cap, (rows, cap, split, bwd)


def test_ranks_split_independently_and_keep_more_than_the_whole_call_did():
    """One hot rank: the cold one keeps every row's activations, the hot one as much as fits —
    more than keeping x alone on both, which is what the whole call did before."""
    world = 2
    placement = Placement.static(CFG.num_experts, world)
    assign_ESR = torch.zeros(CFG.num_experts, world, world, dtype=torch.long)
    assign_ESR[0, :, 0], assign_ESR[4, :, 1] = 300, 50  # expert 0 at rank 0, expert 4 at rank 1
    assignment = PairAssignment.from_dense(assign_ESR)
    recv_R = [int(n) for n in assignment.rows_R()]
    plain = RankPeaks(spec_of("static"), CFG, world, [1 << 40] * world)
    need = [plain.peak(plain.work(placement, r, n, True)) for r, n in enumerate(recv_R)]
    cap = need[1] + 3 * (need[0] - need[1]) // 4  # the cold rank fits whole, the hot one does not
    assert need[1] <= cap < need[0]
    fit = _peaks("static", world, cap).measure(placement, assignment, True)
    assert fit.ok and fit.keep == KEEP_X
    hot, cold = fit.split_R
    assert cold.acts == recv_R[1]
    assert 0 < hot.acts + hot.gate_up < recv_R[0]
    whole_call = RankPeaks(spec_of("static"), CFG, world, [cap] * world, keep=KEEP_X).measure(
        placement, assignment, True)
    assert whole_call.split_R is None and whole_call.ok


def test_a_call_every_rank_keeps_whole_runs_as_uncapped():
    world = 2
    placement = Placement.static(CFG.num_experts, world)
    assign_ESR = torch.zeros(CFG.num_experts, world, world, dtype=torch.long)
    for e in range(CFG.num_experts):
        assign_ESR[e, :, e * world // CFG.num_experts] = 10
    assignment = PairAssignment.from_dense(assign_ESR)
    fit = _peaks("static", world, 1 << 40).measure(placement, assignment, True)
    assert fit.ok and fit.keep is None and fit.split_R is None and fit.bwd_chunk_rows_R is None
