"""lrmoe's replicas chosen by cost (lrmoe.planning.replica_search): the candidate counts, replicas
taken where the predicted time says they pay (a fast link, not a slow one) and not where their
memory would hold kept rows instead, a later search walking from the last choice to the full
search's answer, and the count searched every replan_interval steps."""

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
    """A later search scores the last choice and its neighbours, walking on only while the best
    is at the edge: under a steady load three plans, with the choice of a search over all."""
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
    first = len(scored)
    assert first >= 6, "the first search scores every candidate"
    for _ in range(planner.search.interval - 1):
        planner.plan_call(hot)
        scored.clear()
        everything = copy.deepcopy(planner)._search_replicas(in_call=True)
        scored.clear()
        planner.step_end()
    assert planner.steps == planner.search.interval
    assert 3 <= len(scored) <= 4, len(scored)
    assert planner.placement.slots == everything.slots, "the walk finds the full search's choice"


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
