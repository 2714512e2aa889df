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

from lrmoe import MoEConfig, MoELayer
from lrmoe.memory.bytes import KEEP_X, RowSplit
from lrmoe.parallel import comm
from lrmoe.planning.peaks import RankPeaks
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import spec_of
from tests.helpers.layer import QWEN, close, make_problem, split_tokens
from tests.oracles.dense_moe import reference_grads


def _split(pattern: int, rows: int) -> RowSplit:
    """One rank's forced parts: everything, the three parts, gate/up and x, x alone."""
    third = rows // 3
    return [RowSplit(rows), RowSplit(third, third), RowSplit(0, rows // 2), RowSplit(0)][pattern % 4]


def forced_split_case(group, system: str, seed: int, shift: int):
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, seed, "hot")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    plan_forward, plans = LayerPlanner.plan_forward, []

    def forced(self, counts_SE, forward_SE=None, training=True):
        plan = plan_forward(self, counts_SE, forward_SE, training)
        rows_R = [int(n) for n in plan.assignment.rows_R()]
        plans.append(replace(plan, keep=KEEP_X, split_R=[_split(r + shift, n) for r, n in enumerate(rows_R)],
                             chunk_rows_R=[max(1, n // 4 + r) for r, n in enumerate(rows_R)],
                             bwd_chunk_rows_R=[max(1, n // 5 + 1) for n in rows_R]))
        return plans[-1]

    LayerPlanner.plan_forward = forced
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
