"""lrmoe's replicas chosen by cost (lrmoe.planning.replica_search): the candidate counts, replicas
taken where the predicted time says they pay (a fast link, not a slow one) and not where their
memory would hold kept rows instead, a later search walking from the last choice to the full
search's answer, the bounds that spare scoring a plan changing no choice while the simulator
counts fewer planner calls, and the count searched every replan_interval steps."""

from __future__ import annotations

import pytest
import torch

from lrmoe import ClusterBudget, MemoryBudgetExceeded, MoEConfig
from lrmoe.memory.bytes import ByteModel


def _lrmoe_planner(cap: int, link_gbps: float | None = None, dim: int = 64, ffn: int = 128):
    from lrmoe.planning.planner import LayerPlanner
    from lrmoe.systems import spec_of

    cfg = MoEConfig(dim=dim, ffn_dim=ffn, num_experts=8, top_k=2)
    return LayerPlanner(spec_of("lrmoe"), cfg, 2, budget=ClusterBudget(cap, inter_node_gbps=link_gbps))


def test_replica_candidates():
    from lrmoe.planning.replica_search import replica_candidates

    assert replica_candidates(0) == [0]
    assert replica_candidates(2) == [0, 1, 2]
    assert replica_candidates(20) == [0, 1, 2, 3, 4, 6, 8, 12, 16, 20]


@pytest.mark.parametrize("link_gbps, want_replicas", [(1e6, True), (1e-3, False)])
def test_lrmoe_replicas_follow_their_cost(link_gbps, want_replicas):
    """One hot expert, an ample cap: every plan keeps every pair, so the predicted time decides:
    replicating the hot expert pays on a fast link and not on a slow one. Re-planned every step,
    from the last call's counts; before any call, owned experts only."""
    planner = _lrmoe_planner(50_000_000, link_gbps)
    assert planner.placement.num_copies == 8 and planner.replan_interval == 1
    counts_SE = torch.tensor([[400, 10, 10, 10, 10, 10, 10, 10]] * 2)
    for _ in range(2):
        plan = planner.plan_call(counts_SE)
        assert int(plan.quota_E.sum()) == int(counts_SE.sum()), "an ample cap keeps every pair"
        planner.step_end()
    assert (len(planner.placement.holders(0)) > 1) == want_replicas
    if not want_replicas:
        assert planner.placement.num_copies == 8


def test_lrmoe_replicas_that_cost_kept_rows_are_not_taken():
    """Under a cap that binds, a replica's memory would hold kept rows instead: with a balanced
    load the search keeps owned experts only, even on a free link, and keeps at least as many
    pairs as a plan with one replica slot a rank (fixed slots) would, where that one fits at all."""
    from lrmoe.planning.planner import LayerPlanner
    from lrmoe.systems import spec_of

    counts_SE = torch.tensor([[60] * 8] * 2)
    bm = ByteModel.of(MoEConfig(dim=64, ffn_dim=128, num_experts=8, top_k=2))
    cap = 4 * bm.slot + 480 * bm.fwd_io + 320 * bm.bwd_kept  # room for about 2/3 of a rank's 480 rows
    planner = _lrmoe_planner(cap, 1e6)
    for _ in range(2):
        kept = int(planner.plan_call(counts_SE).quota_E.sum())
        planner.step_end()
    assert planner.placement.num_copies == 8, "no replica"
    assert 0 < kept < int(counts_SE.sum()), "the cap binds"
    try:
        fixed = LayerPlanner(spec_of("lrmoe"), planner.config, 2, budget=ClusterBudget(cap, slots=5))
        assert kept > int(fixed.plan_call(counts_SE).quota_E.sum())
    except MemoryBudgetExceeded:
        pass  # a replica slot does not even fit beside the forward's rows


def test_lrmoe_replica_search_walks_from_the_last_choice(monkeypatch):
    """A later search looks at the last choice and its neighbours, walking on only while the best
    is at the edge: under a steady load three plans, of which the bounds leave one to score,
    with the choice of a search over all."""
    import copy

    import lrmoe.planning.controller

    planner = _lrmoe_planner(50_000_000, 1e6)
    planner.default_slots_R = [12, 12]  # room for more candidates: 0, 1, 2, 3, 4, 6, 8
    hot = torch.tensor([[400, 200, 10, 10, 10, 10, 10, 10]] * 2)
    scored = []
    real = lrmoe.planning.controller.Controller.fit_forward
    monkeypatch.setattr(lrmoe.planning.controller.Controller, "fit_forward",
                        lambda self, *a: scored.append(1) or real(self, *a))
    planner.plan_call(hot)
    planner.step_end()
    assert 2 <= len(scored) < 7, "the first search scores two plans and bounds the other five"
    for _ in range(planner.search.interval - 1):
        planner.plan_call(hot)
        scored.clear()
        everything = copy.deepcopy(planner)._search_replicas(in_call=True)
        scored.clear()
        planner.step_end()
    assert planner.steps == planner.search.interval
    assert len(scored) == 1, len(scored)
    assert planner.placement.slots == everything.slots, "the walk finds the full search's choice"


def _choices(planner, loads, in_call: bool) -> tuple[list[int], int]:
    """The replica count a planner's search chooses after each load, and the plans it scored."""
    import lrmoe.planning.replica_search as rs

    scored, real = [], rs.ReplicaCountSearch.score
    rs.ReplicaCountSearch.score = lambda self, *a: scored.append(1) or real(self, *a)
    try:
        out = []
        for counts_SE in loads:
            planner.plan_call(counts_SE)
            if in_call:
                planner._adopt(planner._search_replicas(in_call=True))
            planner.steps = planner.search.interval - 1  # every step_end a search
            planner.step_end()
            out.append(planner.search.k)
    finally:
        rs.ReplicaCountSearch.score = real
    return out, len(scored)


_BYTES = ByteModel.of(MoEConfig(dim=64, ffn_dim=128, num_experts=8, top_k=2))
_BINDING = 4 * _BYTES.slot + 1400 * _BYTES.fwd_io + 400 * _BYTES.bwd_kept  # about a third of the rows kept


@pytest.mark.parametrize("in_call", [False, True])
@pytest.mark.parametrize("cap, link_gbps", [(50_000_000, 1e6), (50_000_000, 50.0), (_BINDING, 1e6)])
def test_bounded_search_chooses_what_scoring_every_plan_chooses(monkeypatch, in_call, cap, link_gbps):
    """The bounds only spare work: on skewed, drifting and flat loads, under an ample and a
    binding cap and on a fast and a slow link, the search (walking, or over every candidate)
    chooses the replica count the same search scoring every plan it looks at chooses, and scores
    fewer plans."""
    import lrmoe.planning.replica_search as rs

    g = torch.Generator().manual_seed(7)
    loads = [torch.tensor([[400, 200, 10, 10, 10, 10, 10, 10]] * 2)]
    loads += [(torch.rand(2, 8, generator=g) ** 4 * 300).long() + 1 for _ in range(8)]
    loads += [torch.tensor([[60] * 8] * 2)]

    def planner():
        p = _lrmoe_planner(cap, link_gbps)
        p.default_slots_R = [8, 8]
        return p

    bounded, bounded_scored = _choices(planner(), loads, in_call)
    monkeypatch.setattr(rs._Trials, "_beaten", lambda self, bound, best: False)
    every, every_scored = _choices(planner(), loads, in_call)
    assert bounded == every
    assert len(set(every)) > 1, "the loads move the choice"
    assert bounded_scored < every_scored


def test_the_walk_counts_fewer_planner_calls():
    """The simulator prices the planner calls it counts: a steady load's search step (last
    choice, one slot fewer, one more) scores one plan — one assignment, and no quota solve
    where its forward fits every rank's kept capacity — and plans one more replica placement
    than a step between searches; scoring every plan looked at assigns both replicated ones."""
    import lrmoe.planning.replica_search as rs
    from lrmoe.sim.host import PlannerCalls

    def search_step(bounded: bool):
        planner = _lrmoe_planner(50_000_000, 1e6)
        planner.default_slots_R = [12, 12]
        hot = torch.tensor([[400, 200, 10, 10, 10, 10, 10, 10]] * 2)
        for _ in range(planner.search.interval):
            planner.plan_call(hot)
            if planner.steps == planner.search.interval - 1:
                real = rs._Trials._beaten
                rs._Trials._beaten = real if bounded else (lambda self, bound, best: False)
                try:
                    with PlannerCalls() as calls:
                        planner.step_end()
                finally:
                    rs._Trials._beaten = real
            else:
                planner.step_end()
        assert planner.search.k == 1
        return calls.counts

    bounded, every = search_step(True), search_step(False)
    assert bounded == {"plan_replicas": 2, "holder_index": 1, "assign_min_peak": 1}
    assert every == {"plan_replicas": 2, "holder_index": 2, "assign_min_peak": 2}  # k = 0: owners, no assignment


def test_quotas_skip_the_solve_where_the_forward_keeps_every_pair():
    """An assignment of every pair within every rank's kept capacity is a flow keeping them all:
    the controller's quotas are then the counts, as the solve gives them, and the solve is not
    run (the simulator counts no quota call); one rank over its capacity, or an assignment of
    other counts, and it is."""
    from lrmoe.planning.balance import min_peak_assignment
    from lrmoe.planning.controller import keeps_every_pair
    from lrmoe.planning.placement import Placement, plan_replicas
    from lrmoe.planning.quotas import max_min_quotas
    from lrmoe.sim.host import PlannerCalls

    g = torch.Generator().manual_seed(0)
    kept = 0
    for trial in range(200):
        E, W = [(8, 2), (16, 4), (32, 8), (12, 5)][trial % 4]
        base = Placement.static(E, W)
        counts_SE = (torch.rand(W, E, generator=g) ** 3 * 200).long()
        slots = [o + int(torch.randint(0, 3, (1,), generator=g)) for o in base.owned_counts]
        placement = plan_replicas(base, counts_SE.sum(0).double(), slots)
        rows = (placement.owner_assignment(counts_SE) if placement.owners_only
                else min_peak_assignment(counts_SE.t(), placement.holder_index, None))
        cap = [max(1, int(n * float(torch.empty(1).uniform_(0.9, 1.3, generator=g)))) for n in rows.rows_R()]
        counts_E = counts_SE.sum(0)
        if keeps_every_pair(counts_E, rows, cap):
            kept += 1
            assert torch.equal(max_min_quotas(counts_E, placement.holder_lists, cap), counts_E)
        else:
            assert any(n > c for n, c in zip(rows.rows_R(), cap))
    assert 30 < kept < 170, "both cases drawn"
    assert not keeps_every_pair(counts_E + 1, rows, [1 << 40] * W), "other counts"

    planner = _lrmoe_planner(50_000_000)
    counts_SE = torch.tensor([[400, 200, 10, 10, 10, 10, 10, 10]] * 2)
    plan = planner.plan_call(counts_SE)
    assert torch.equal(plan.quota_E, counts_SE.sum(0))
    with PlannerCalls() as calls:
        quota_E = planner.controller.quotas(counts_SE.sum(0), plan.placement, rows=plan.assignment)
    assert torch.equal(quota_E, counts_SE.sum(0)) and not calls.counts
    with PlannerCalls() as calls:  # a capacity below the forward's rows: solved
        quota_E = planner.controller.quotas(counts_SE.sum(0), plan.placement, [300, 300], rows=plan.assignment)
    assert calls.counts == {"max_min_quotas": 1} and int(quota_E.sum()) < int(counts_SE.sum())


def test_lrmoe_replica_count_is_searched_every_replan_interval():
    """The replicas follow the load every step; their number is searched every replan_interval
    steps (default 10): a hot expert that cools keeps its replicas until the next search."""
    planner = _lrmoe_planner(50_000_000, 1e6)
    hot, flat = torch.tensor([[400, 10, 10, 10, 10, 10, 10, 10]] * 2), torch.tensor([[60] * 8] * 2)
    planner.plan_call(hot)
    planner.step_end()
    chosen = planner.search.k
    assert chosen and planner.placement.num_copies > 8
    for step in range(2, 11):
        planner.plan_call(flat)
        planner.step_end()
        if step < planner.search.interval:
            assert planner.search.k == chosen, step
    assert planner.steps == 10 and planner.search.k == 0 and planner.placement.num_copies == 8
    assert planner.state()["replica_k"] == 0
