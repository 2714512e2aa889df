"""Keeping by the row on the real layer (docs/design.md "Keep by the row"): with every rank's
:class:`RowSplit` forced, ranks keeping different parts in one call (all activations, the three
parts, gate/up and x, x alone) and chunks that cut through the parts, the layer's output, dx and
every weight gradient equal the independent dense reference at worlds 1, 2 and 4 for static,
symi, llep and laer, and the meter measures what the byte model predicts for each rank. (Under a
real cap, each rank's split chosen by the planner: tests/layer/test_memory_cap.py; the search
itself: tests/planning/test_row_split.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.memory.bytes import KEEP_X, RowSplit
from lrmoe.memory.meter import MemoryMeter
from lrmoe.parallel import comm
from lrmoe.passes.by_row import backward_by_row, forward_by_row
from lrmoe.planning.peaks import RankPeaks
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import spec_of
from tests.helpers.layer import QWEN, close, make_problem, split_tokens
from tests.oracles.dense_moe import reference_grads


def _split(pattern: int, rows: int) -> RowSplit:
    """One rank's forced parts: everything, the three parts, gate/up and x, x alone."""
    third = rows // 3
    return [RowSplit(rows), RowSplit(third, third), RowSplit(0, rows // 2), RowSplit(0)][pattern % 4]


def _forcing(plans: list, shift: int, **extra):
    """``LayerPlanner.plan_forward`` with every rank's split forced (:func:`_split`), chunks that
    cut through the parts, and ``extra`` fields; each plan appended to ``plans``."""
    plan_forward = LayerPlanner.plan_forward

    def forced(self, counts_SE, forward_SE=None, training=True):
        plan = plan_forward(self, counts_SE, forward_SE, training)
        rows_R = [int(n) for n in plan.assignment.rows_R()]
        plans.append(replace(plan, split_R=[_split(r + shift, n) for r, n in enumerate(rows_R)],
                             chunk_rows_R=[max(1, n // 4 + r) for r, n in enumerate(rows_R)],
                             bwd_chunk_rows_R=[max(1, n // 5 + 1) for n in rows_R], **extra))
        return plans[-1]

    return forced


def forced_split_case(group, system: str, seed: int, shift: int):
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, seed, "hot")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    plan_forward, plans = LayerPlanner.plan_forward, []
    LayerPlanner.plan_forward = _forcing(plans, shift, keep=KEEP_X)
    try:
        layer = MoELayer(cfg, system=system, group=group)
        layer.load_full_state_dict(sd)
        xs = x[lo:hi].clone().requires_grad_(True)
        out = layer(xs)
        out.backward(g[lo:hi])
    finally:
        LayerPlanner.plan_forward = plan_forward
    ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg)
    close("out", out.detach(), ref_out[lo:hi])
    close("dx", xs.grad, ref_dx[lo:hi])
    grads = layer.gather_full_grads()
    for name, want in ref_grads.items():
        close(f"grad {name}", grads[name], want)
    stats, plan = layer.last_stats, plans[-1]
    peaks = RankPeaks(spec_of(system), cfg, world, [0] * world, keep=KEEP_X, by_row=True)
    predicted = peaks.peak(peaks.work(plan.placement, rank, stats["recv_rows"], True, plan.chunk_rows_R[rank],
                                      plan.bwd_chunk_rows_R[rank], plan.split_R[rank]))
    return plan.split_R[rank], stats["peak_expert_side_bytes"], predicted


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("system", ["static", "symi", "llep", "laer"])
def test_forced_splits_match_the_dense_reference(pool, system, world):
    for shift in range(1 if world == 4 else 4):  # at world 4 the ranks already take the four patterns
        res = pool.run(world, forced_split_case, system, 3, shift)
        for split, measured, predicted in res:
            assert measured == predicted, (system, world, split, measured, predicted)
        if world > 1:
            assert len({r[0] for r in res}) > 1, "ranks keep different parts in one call"


def lrmoe_split_case(group, selection: str, shift: int):
    """lrmoe keeping by the row (its kept rows read through their indices) beside lrmoe keeping
    every activation, same seeds: the same kept pairs, so the same output, dx and gradients."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 3, "hot")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    plan_forward, plans = LayerPlanner.plan_forward, []
    forced = _forcing(plans, shift)

    def run(force: bool):
        layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(selection, ratio=0.6))
        layer.load_full_state_dict(sd)
        xs = x[lo:hi].clone().requires_grad_(True)
        LayerPlanner.plan_forward = forced if force else plan_forward
        try:
            out = layer(xs)
            out.backward(g[lo:hi])
        finally:
            LayerPlanner.plan_forward = plan_forward
        return out.detach(), xs.grad, layer.gather_full_grads(), dict(layer.last_stats)

    out, dx, grads, stats = run(True)
    ref_out, ref_dx, ref_grads, ref_stats = run(False)
    assert torch.equal(stats["kept_E"], ref_stats["kept_E"]) and stats["kept_E"].sum() < stats["counts_E"].sum()
    close("out", out, ref_out)
    close("dx", dx, ref_dx)
    for name, want in ref_grads.items():
        close(f"grad {name}", grads[name], want)
    plan = plans[-1]
    peaks = RankPeaks(spec_of("lrmoe"), cfg, world, [0] * world, keep=KEEP_X, by_row=True)
    predicted = peaks.peak(peaks.work(plan.placement, rank, stats["recv_rows"], True, plan.chunk_rows_R[rank],
                                      plan.bwd_chunk_rows_R[rank], plan.split_R[rank]))
    return plan.split_R[rank], stats["peak_expert_side_bytes"], predicted


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("selection", ["local-sampled", "lrm"])
def test_lrmoe_kept_rows_by_the_row_equal_keeping_every_activation(pool, selection, world):
    """Local selections tell the expert side its kept rows with dy, global ones by a mask: both
    read the kept rows' parts through their indices; the meter stays within the bound the
    controller plans with (every forward row a possible kept one)."""
    for shift in range(1 if world == 4 else 2):
        for split, measured, predicted in pool.run(world, lrmoe_split_case, selection, shift):
            assert measured <= predicted, (selection, world, split, measured, predicted)


def test_kept_rows_out_of_saved_order_read_through_a_sort():
    """``backward_by_row`` with its kept rows not ascending (dy's order differs from the saved
    rows'): each dx lands on its own dy row and the weight gradients are those of the ascending
    order (the layouts keep them ascending today; the sort keeps a future layout correct)."""
    torch.manual_seed(0)
    L, D, F, R = 3, 8, 12, 30
    gate_up, down = torch.randn(L, 2 * F, D) * 0.3, torch.randn(L, D, F) * 0.3
    counts_L, x_RD = torch.tensor([12, 10, 8]), torch.randn(R, D)
    kept = forward_by_row(x_RD, gate_up, down, counts_L, RowSplit(9, 8), 5, torch.empty(R, D), None, MemoryMeter(0))
    kept_rows = torch.tensor([1, 4, 5, 9, 11, 12, 13, 17, 20, 22, 26, 29])  # 5 / 4 / 3 kept a slot, ascending
    kept_L, dy = torch.tensor([5, 4, 3]), torch.randn(len(kept_rows), D)
    perm = torch.tensor([2, 0, 4, 1, 3, 8, 5, 7, 6, 11, 9, 10])  # shuffled within each slot
    want_dx, *want = backward_by_row(dy.clone(), x_RD, gate_up, down, kept_L, kept, 4, None, MemoryMeter(0), kept_rows)
    dx, *got = backward_by_row(dy[perm].clone(), x_RD, gate_up, down, kept_L, kept, 4, None, MemoryMeter(0),
                               kept_rows[perm])
    close("dx", dx, want_dx[perm])
    for name, g, w in zip(("gate_up", "down"), got, want):
        close(name, g, w)
