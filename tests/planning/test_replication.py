"""The replication family's planners (lrmoe.planning.strategies) on a skewed load: fastermoe's
shadowing, flexmoe's re-placement when the gain beats the cost, smartmoe's pool, LAER's layout,
ultraep's per-call plan, topoep's node-local matching, each below static's peak; and
shadow_experts and localize against the planners before the speed-ups
(tests/oracles/planners.py), bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.balance import assign_min_peak
from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.strategies import (
    CostModel,
    flexmoe_replan,
    laer_layout,
    local_assignment,
    localize,
    pick_from_pool,
    placement_pool,
    predicted_rank_load,
    shadow_experts,
)
from tests.helpers.planning import paper_scale, random_counts, random_holders, same_outcome
from tests.oracles.planners import ref_localize, ref_shadow_experts

E, W = 16, 4
BASE = Placement.static(E, W)
SLOTS = [6] * W  # 4 owned + 2 replica slots


def skewed_counts(seed: int = 0, zipf: float = 1.5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** zipf
    return torch.stack([torch.multinomial(p, 4000, replacement=True, generator=gen).bincount(minlength=E)
                        for _ in range(W)])  # (S, E)


def peak_rows(assign_ESR: torch.Tensor) -> int:
    return int(assign_ESR.sum((0, 1)).max())


def static_peak(counts_SE: torch.Tensor) -> int:
    return peak_rows(BASE.owner_assignment(counts_SE).dense())


def test_fastermoe_shadows_hot_experts_below_static_peak():
    counts_SE = skewed_counts()
    cost = CostModel(dim=64, ffn_dim=64, elem_bytes=4, gemm_flops=1e10, link_gbps=100)
    shadow = shadow_experts(counts_SE, BASE, cost)
    assert 0 in shadow
    placement = BASE.with_replicas([[e for e in shadow if int(BASE.owner_E[e]) != r] for r in range(W)])
    assign = local_assignment(counts_SE, placement).dense()
    assert torch.equal(assign.sum(2), counts_SE.t())
    assert peak_rows(assign) < static_peak(counts_SE)
    cheap_compute = CostModel(dim=64, ffn_dim=64, elem_bytes=4, gemm_flops=1e18, link_gbps=1e-3)
    assert shadow_experts(torch.ones(W, E, dtype=torch.long), BASE, cheap_compute) == []


def test_flexmoe_replaces_only_when_gain_beats_cost():
    counts_SE = skewed_counts()
    load = counts_SE.sum(0).to(torch.float64)
    fast = CostModel(dim=64, ffn_dim=64, elem_bytes=4, link_gbps=1e6)
    plan, created = flexmoe_replan(BASE, load, SLOTS, fast, horizon=10)
    assert created > 0 and plan.num_copies == E + created
    assign = assign_min_peak(counts_SE.t(), plan.holder_lists)
    assert peak_rows(assign) < static_peak(counts_SE)
    assert all(len(plan.slots[r]) <= SLOTS[r] for r in range(W))
    slow = CostModel(dim=64, ffn_dim=64, elem_bytes=4, link_gbps=1e-6)
    assert flexmoe_replan(BASE, load, SLOTS, slow, horizon=10) == (BASE, 0)


def test_smartmoe_pool_and_pick():
    hot0 = skewed_counts(0).sum(0).to(torch.float64)
    hot9 = hot0.roll(9)  # the same skew on other experts
    trace = torch.stack([hot0, hot9] * 4)
    pool = placement_pool(trace, BASE, SLOTS, 4)
    assert 2 <= len({p.slots for p in pool}) <= 4
    for load in (hot0, hot9):
        chosen = pool[pick_from_pool(pool, load)]
        assert max(predicted_rank_load(chosen, load.tolist())) < max(predicted_rank_load(BASE, load.tolist()))
    counts_SE = skewed_counts()
    assign = assign_min_peak(counts_SE.t(), pool[pick_from_pool(pool, hot0)].holder_lists)
    assert peak_rows(assign) < static_peak(counts_SE)


def test_laer_layout_min_peak_without_owners():
    counts_SE = skewed_counts()
    layout = laer_layout(counts_SE.sum(0), BASE, SLOTS)
    assert all(len(s) <= 6 for s in layout.slots)
    assert all(len(h) >= 1 for h in layout.holder_lists), "every expert with pairs is assembled somewhere"
    assign = assign_min_peak(counts_SE.t(), layout.holder_lists)
    assert peak_rows(assign) < static_peak(counts_SE)
    sparse = torch.zeros(E, dtype=torch.long)
    sparse[3] = 10
    assert [len(h) for h in laer_layout(sparse, BASE, SLOTS).holder_lists] == [0, 0, 0, W] + [0] * (E - 4)


def test_ultraep_per_call_plan_below_static_peak():
    counts_SE = skewed_counts(3)
    plan = plan_replicas(BASE, counts_SE.sum(0).to(torch.float64), SLOTS)
    assign = assign_min_peak(counts_SE.t(), plan.holder_lists)
    assert peak_rows(assign) < static_peak(counts_SE)


def test_topoep_same_peak_fewer_cross_node_rows():
    W8 = 8
    base = Placement.static(E, W8)
    node_of = [r // 4 for r in range(W8)]
    gen = torch.Generator().manual_seed(0)
    counts_SE = torch.randint(0, 50, (W8, E), generator=gen)
    counts_SE[:, 0] += 400
    plan = plan_replicas(base, counts_SE.sum(0).to(torch.float64), [4] * W8, node_of)
    nodes_of_hot = {node_of[r] for r in plan.holders(0)}
    assert nodes_of_hot == {0, 1}, "the hot expert gets a copy in both nodes"
    plain = assign_min_peak(counts_SE.t(), plan.holder_lists)
    local = localize(PairAssignment.from_dense(plain), node_of).dense()
    assert torch.equal(local.sum(1), plain.sum(1)) and torch.equal(local.sum(2), plain.sum(2))
    on_source = torch.minimum(plain.sum(2), plain.sum(1))  # most rows each rank can keep itself
    assert torch.equal(torch.diagonal(local, dim1=1, dim2=2), on_source)
    # inside a node, every row that can stay does: cross-node rows per expert and node are the
    # node's surplus of sources over holders, no more
    node = torch.tensor(node_of)
    for n in (0, 1):
        surplus = (local.sum(2)[:, node == n].sum(1) - local.sum(1)[:, node == n].sum(1)).clamp(min=0)
        assert torch.equal(local[:, node == n][:, :, node != n].sum((1, 2)), surplus)
    cross = torch.tensor(node_of)[:, None] != torch.tensor(node_of)[None, :]

    def cross_rows(a):
        return int((a * cross).sum())

    assert cross_rows(local) <= cross_rows(plain)
    assert peak_rows(local) < peak_rows(base.owner_assignment(counts_SE).dense())


def test_localize_undoes_a_cross_node_matching():
    # one expert on ranks 1 (node 0) and 2 (node 1); source 0 sent to rank 2 and source 3 to rank 1
    assign = torch.zeros(1, 4, 4, dtype=torch.long)
    assign[0, 0, 2] = assign[0, 3, 1] = 10
    assign[0, 1, 1] = 5  # rank 1's own rows stay
    local = localize(PairAssignment.from_dense(assign), [0, 0, 1, 1]).dense()
    want = torch.zeros_like(assign)
    want[0, 0, 1] = want[0, 3, 2] = 10
    want[0, 1, 1] = 5
    assert torch.equal(local, want)


# ------------------------------------------------------------------ against the frozen planners


def test_shadow_experts_matches_reference():
    rng = np.random.default_rng(4)
    for case in range(200):
        W = int(rng.integers(1, 9))
        E = int(rng.integers(1, 25))
        counts = torch.from_numpy(random_counts(rng, (W, E)) * int(rng.choice([1, 100, 10_000])))
        if case % 10 == 0:
            counts = counts.to(torch.float64) / 3  # not whole numbers: recomputed each trial
        cost = CostModel(dim=int(rng.choice([64, 2048])), ffn_dim=int(rng.choice([128, 768])), elem_bytes=2,
                         link_gbps=float(rng.choice([1.0, 100.0, 10_000.0])))
        base = Placement.static(E, W)
        same_outcome(ref_shadow_experts, shadow_experts, counts, base, cost)
    counts_SE, base, _ = paper_scale(0)
    for gbps in (25.0, 100.0, 400.0):
        same_outcome(ref_shadow_experts, shadow_experts, counts_SE, base, CostModel(2048, 768, 2, link_gbps=gbps))


def test_localize_matches_reference():
    rng = np.random.default_rng(5)
    for case in range(200):
        R = int(rng.integers(1, 10))
        E = int(rng.integers(1, 20))
        counts = torch.from_numpy(random_counts(rng, (E, R)))
        assign = assign_min_peak(counts, random_holders(rng, E, R))
        node_of = rng.integers(0, 3, R).tolist()  # nodes need not be contiguous blocks
        if case % 2:
            node_of = sorted(node_of)
        same_outcome(ref_localize, dense_localize, assign, node_of)
    counts_SE, _, placement = paper_scale(1)
    assign = assign_min_peak(counts_SE.t(), placement.holder_lists)
    for per_node in (1, 8, 64):
        same_outcome(ref_localize, dense_localize, assign, [r // per_node for r in range(64)])


def dense_localize(assign_ESR: torch.Tensor, node_of: list[int]) -> torch.Tensor:
    """:func:`localize` on the compact form, compared in the reference's dense form."""
    return localize(PairAssignment.from_dense(assign_ESR), node_of).dense()
