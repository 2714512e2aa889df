"""llep's decision (lrmoe.planning.strategies.least_loaded) on hand-made counts: the owner keeps
what fits under factor × mean, the overflow goes in chunks of at least the minimum GEMM size to
the least-loaded ranks, a rank goes over the cap only where the minimum chunk leaves no other
way; the rule (pair_rules) gives each copy exactly those rows, taking its own source's pairs
first; and the planner, uncapped and under a memory cap (the most copies that fit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe import ClusterBudget, MemoryBudgetExceeded, MoEConfig
from lrmoe.memory.bytes import ByteModel
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.placement import Placement
from lrmoe.planning.planner import LayerPlanner
from lrmoe.planning.strategies.least_loaded import MIN_GEMM_ROWS, holder_rows, least_loaded_rows, row_cap
from lrmoe.systems import Assignment, spec_of

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)


def _rows(counts_E, world, **kw):
    owner = Placement.static(len(counts_E), world).owner_E.tolist()
    return least_loaded_rows(counts_E, owner, world, **kw)


def test_row_cap_is_factor_times_mean():
    assert row_cap(1000, 4) == 275
    assert row_cap(480, 4) == 132  # 1.1 · 120 = 132.00000000000003 in floats: still 132
    assert row_cap(0, 4) == 1 and row_cap(10, 4, 1.0) == 3


def test_hot_expert_spills_to_the_least_loaded_ranks():
    # one expert per rank; expert 0 has 700 of the 1000 pairs: cap 275 rows a rank
    rows, spills = _rows([700, 100, 100, 100], 4)
    assert rows.tolist() == [[275, 275, 150, 0],  # the owner keeps its cap; 425 over: 275 to rank 1, 150 to rank 2
                             [0, 0, 0, 100],  # rank 1 is full: its own expert goes whole to rank 3, the least loaded
                             [0, 0, 100, 0],  # the owners of the rest keep all
                             [0, 0, 0, 100]]
    assert spills == [(0, 1), (0, 2), (1, 3)]  # copies, in the order they were made
    assert rows.sum(0).tolist() == [275, 275, 250, 200]  # static: [700, 100, 100, 100]


def test_chunks_are_at_least_the_minimum():
    rows, spills = _rows([700, 100, 100, 100], 4, min_rows=200)
    # 425 over: rank 1 takes 225, not its whole room (275), so that the 200 left make a full chunk
    assert rows[0].tolist() == [275, 225, 200, 0]
    # overflows below the minimum go whole: expert 1's 50, expert 2's 25
    assert rows[1].tolist() == [0, 50, 0, 50] and rows[2].tolist() == [0, 0, 75, 25]
    assert rows.sum(0).tolist() == [275, 275, 275, 175]
    assert spills == [(0, 1), (0, 2), (1, 3), (2, 3)]


def test_over_the_cap_only_where_the_minimum_chunk_leaves_no_way():
    # cap 61; expert 0 is 69 over, less than two chunks of 64, and no rank has 64 rows of room:
    # it goes whole to rank 1, over the cap
    rows, _ = _rows([130, 30, 30, 30], 4)
    assert rows.sum(0).tolist() == [61, 69, 60, 30]
    # with a minimum chunk of one row nobody goes over the cap
    rows, _ = _rows([130, 30, 30, 30], 4, min_rows=1)
    assert rows.sum(0).tolist() == [61, 61, 38, 60]


def test_balanced_load_spills_nothing():
    rows, spills = _rows([50] * 8, 4)
    assert spills == [] and rows.sum(0).tolist() == [100] * 4


@pytest.mark.parametrize("min_rows", [1, 8, MIN_GEMM_ROWS])
def test_random_loads(min_rows):
    rng = np.random.default_rng(min_rows)
    for _ in range(200):
        W, E = int(rng.integers(1, 9)), int(rng.integers(1, 20))
        counts = (rng.zipf(1.5, E).clip(max=2000) * rng.integers(0, 40, E)).tolist()
        base = Placement.static(E, W)
        owner = base.owner_E.tolist()
        rows, spills = least_loaded_rows(counts, owner, W, min_rows=min_rows)
        again = least_loaded_rows(counts, owner, W, min_rows=min_rows)
        assert np.array_equal(rows, again[0]) and spills == again[1], "deterministic"
        assert rows.sum(1).tolist() == counts, "every pair computed once"
        cap, load = row_cap(sum(counts), W), rows.sum(0)
        assert load.max(initial=0) <= cap + (0 if min_rows == 1 else 2 * min_rows - 2)
        for e in range(E):
            o, over = owner[e], counts[e] - rows[e, owner[e]]
            others = [int(rows[e, r]) for r in range(W) if r != o and rows[e, r]]
            assert all(n >= min(min_rows, over) for n in others), (counts, e, rows[e])
            if over:  # the owner kept what fitted: it ends at its cap or above
                assert load[o] >= cap
        away = {(e, r) for e in range(E) for r in range(W) if rows[e, r] and r != owner[e]}
        assert set(spills) == away and len(spills) == len(away), "each copy away from its owner, once"
        # within the plan's own copies the decision gives back exactly these rows (the rule's)
        placement = base.with_replicas([[e for e, q in spills if q == r] for r in range(W)])
        within, _ = least_loaded_rows(counts, owner, W, placement.holder_lists, min_rows=min_rows)
        assert np.array_equal(within, rows)
        if min_rows == MIN_GEMM_ROWS:
            assert np.array_equal(holder_rows(torch.tensor(counts), placement), rows)


def test_rule_gives_each_copy_its_rows_own_source_first():
    counts_SE = torch.tensor([[100, 0, 10, 0], [100, 10, 0, 0], [250, 30, 30, 30], [250, 60, 60, 70]])
    rows, spills = _rows(counts_SE.sum(0).tolist(), 4)
    base = Placement.static(4, 4)
    placement = base.with_replicas([[e for e, q in spills if q == r] for r in range(4)])
    assignment = assign_pairs(Assignment.LEAST_LOADED, counts_SE, placement)
    dense = assignment.dense()  # (E, S, R)
    assert torch.equal(dense.sum(1), torch.from_numpy(rows)), "each copy computes the decided rows"
    assert torch.equal(dense.sum(2), counts_SE.t()), "every pair of every source"
    own = torch.diagonal(dense, dim1=1, dim2=2)  # (E, R): pairs computed on their own source
    assert torch.equal(own, torch.minimum(counts_SE.t(), torch.from_numpy(rows)))
    assert torch.equal(assign_pairs(Assignment.LEAST_LOADED, counts_SE, placement).dense(), dense)


def test_planner_uncapped_places_the_spills():
    cfg = MoEConfig(**CFG)
    counts_SE = torch.tensor([[300] + [25] * 7] * 2)  # 950 pairs: cap 523 rows a rank
    plan = LayerPlanner(spec_of("llep"), cfg, 2).plan_call(counts_SE)
    # expert 0 keeps 523 on rank 0, its 77 over and rank 0's other experts go to rank 1
    assert plan.placement.slots == ((0, 1, 2, 3), (4, 5, 6, 7, 0, 1, 2, 3))
    assert plan.assignment.rows_R() == [523, 427] and plan.fetch
    assert plan.figures.replicas == 4


def test_planner_under_a_cap_takes_the_most_copies_that_fit():
    cfg = MoEConfig(**CFG)
    counts_SE = torch.tensor([[300] + [25] * 7] * 2)
    spec = spec_of("llep")
    _, spills = least_loaded_rows(counts_SE.sum(0).tolist(), [0] * 4 + [1] * 4, 2)
    free = LayerPlanner(spec, cfg, 2, budget=ClusterBudget(memory_bytes=10**9)).plan_call(counts_SE)
    static = LayerPlanner(spec_of("static"), cfg, 2, budget=ClusterBudget(memory_bytes=10**9)).plan_call(counts_SE)
    assert max(free.peak_R) < max(static.peak_R), "spilling lowers the peak"
    base = Placement.static(8, 2)
    seen = set()
    for fraction in (1.0, 0.7, 0.5, 0.3, 0.25):  # copies first, then rows kept richer (the fit ladder)
        cap = int(fraction * max(static.peak_R))
        plan = LayerPlanner(spec, cfg, 2, budget=ClusterBudget(memory_bytes=cap)).plan_call(counts_SE)
        assert max(plan.peak_R) <= cap
        assert torch.equal(plan.assignment.dense().sum(2), counts_SE.t()), "exact: every pair computed"
        k = plan.placement.num_copies - 8  # a prefix of the spills, in the order made
        assert plan.placement.slots == base.with_replicas([[e for e, r in spills[:k] if r == q] for q in (0, 1)]).slots
        seen.add((k, plan.keep))
    assert (4, None) in seen, "an ample cap: every copy, x and activations kept"
    assert any(k < 4 for k, _ in seen) and any(keep == "x" for _, keep in seen), seen
    # a tenth of static's peak: no copy, nothing kept, the rows in rounds; below the owned experts
    # and a one-row round, no way
    plan = LayerPlanner(spec, cfg, 2, budget=ClusterBudget(memory_bytes=int(0.1 * max(static.peak_R)))).plan_call(
        counts_SE)
    assert plan.keep == "nothing" and plan.rounds_R is not None and plan.placement.num_copies == 8
    bm = ByteModel.of(cfg, selective=False)
    least = 4 * bm.slot + max(bm.round_forward(1), bm.round_backward(1))
    with pytest.raises(MemoryBudgetExceeded):
        LayerPlanner(spec, cfg, 2, budget=ClusterBudget(memory_bytes=least - 1)).plan_call(counts_SE)
