"""Replicated expert parallelism (symi, budgeted lrmoe), the controller, capacity dropping."""

from __future__ import annotations

import pytest
import torch

from lrmoe import ClusterBudget, MemoryBudgetExceeded, MoEConfig, MoELayer
from lrmoe.memory.bytes import ByteModel
from lrmoe.parallel import comm
from lrmoe.planning.controller import Controller, max_min_quotas
from lrmoe.planning.placement import Placement, plan_replicas
from tests.reference import reference_grads
from tests.test_layer import close, make_problem, split_tokens

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)


def skewed_tokens(cfg, n, seed, skew):
    """Inputs whose routing is skewed: 'hot' pushes most tokens to expert 0."""
    sd, x, g = make_problem(cfg, n, seed, "none")
    if skew == "hot":
        u = torch.ones(cfg.dim) / cfg.dim**0.5
        x = x + 2.0 * u
        sd["router.weight"][0] = 4.0 * u
    return sd, x, g


def replicated_case(group, system, steps, skew, budget_bytes=None, link_gbps=None):
    """Run ``steps`` optimizer-free iterations (step_end between them, placement re-planned)
    and compare every call with the dense reference and the static system."""
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 40, 3, skew)
    sizes = split_tokens(40, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    kwargs = {}
    if budget_bytes is not None:
        kwargs = dict(budget=ClusterBudget(budget_bytes, inter_node_gbps=link_gbps), replan_interval=1)
    layer = MoELayer(cfg, system=system, group=group, **kwargs)
    layer.load_full_state_dict(sd)
    static = MoELayer(cfg, group=group)
    static.load_full_state_dict(sd)
    holders_seen = []
    for _ in range(steps):
        for lay in (layer, static):
            lay.zero_grad()
        xs = x[lo:hi].clone().requires_grad_(True)
        out = layer(xs)
        out.backward(g[lo:hi])
        xr = x[lo:hi].clone().requires_grad_(True)
        static(xr).backward(g[lo:hi])
        ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg)
        close("out", out.detach(), ref_out[lo:hi])
        close("dx", xs.grad, ref_dx[lo:hi])
        grads = layer.gather_full_grads()
        sgrads = static.gather_full_grads()
        for name, want in ref_grads.items():
            close(f"grad {name}", grads[name], want)
            close(f"vs static {name}", grads[name], sgrads[name], atol=1e-5)
        if budget_bytes is not None:
            assert layer.last_stats["peak_expert_side_bytes"] <= budget_bytes
            assert torch.equal(layer.last_stats["kept_E"], layer.last_stats["counts_E"])
        holders_seen.append([list(h) for h in layer.placement.holder_lists])
        layer.step_end()
        static.step_end()
    return holders_seen, layer.last_stats.get("placement_bytes", 0)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("skew", ["none", "hot"])
def test_symi_equals_static_and_reference(pool, world, skew):
    res = pool.run(world, replicated_case, "symi", 3, skew)
    holders = res[0][0]
    assert any(len(h) > 1 for h in holders[-1]), "symi holds replicas"
    if skew == "hot":
        assert len(holders[-1][0]) > 1, "the hot expert gets replicated"


@pytest.mark.parametrize("world", [2, 4])
def test_budgeted_lrmoe_with_ample_budget_is_exact(pool, world):
    """Exact with and without replicas: a link fast enough that replicating the hot expert pays
    (the cost search takes replicas), and the default link, at which at these tiny shapes a
    replica's refresh costs more than the rows it moves (owned experts only)."""
    fast = pool.run(world, replicated_case, "lrmoe", 3, "hot", 50_000_000, 1e6)
    assert [len(h) for h in fast[0][0][0]] == [1] * 8, "no replicas before the first call's counts"
    assert len(fast[0][0][-1][0]) > 1, "the hot expert replicated"
    slow = pool.run(world, replicated_case, "lrmoe", 2, "hot", 50_000_000)
    assert all(len(h) == 1 for h in slow[0][0][-1])


def test_replica_planner():
    base = Placement.static(8, 4)
    load = torch.tensor([100.0, 1, 1, 1, 1, 1, 1, 1])
    p = plan_replicas(base, load, [3, 3, 3, 3])
    assert len(p.holders(0)) == 4, "the hot expert is copied to every rank"
    assert all(len(s) <= 3 for s in p.slots)
    assert all(p.owned(r) == base.owned(r) for r in range(4)), "ownership never moves"
    assert p.slots[0][:2] == (0, 1) and p.replicas(0) == tuple(sorted(p.replicas(0)))
    with pytest.raises(ValueError, match="owns"):
        plan_replicas(base, load, [1, 3, 3, 3])


# ------------------------------------------------------------------- controller


def test_max_min_quotas_properties():
    counts = torch.tensor([100, 50, 10, 0, 40])
    holders = [[0], [0, 1], [1], [1], [2]]
    q = max_min_quotas(counts, holders, [60, 30, 100])
    assert (q <= counts).all() and q[3] == 0
    assert q[4] == 40, "an expert on an idle rank keeps everything"
    assert int(q[:3].sum()) == 90, "the bottleneck ranks are filled"
    ratios = q[:3].double() / counts[:3].double()
    assert ratios.max() - ratios.min() < 0.05, "max-min fair: one ratio for the bottleneck"
    # ample capacity: exact
    assert torch.equal(max_min_quotas(counts, holders, [1000] * 3), counts)
    # monotone in capacity
    prev = torch.zeros(5, dtype=torch.long)
    for cap in (10, 20, 40, 80, 160, 320):
        q = max_min_quotas(counts, holders, [cap] * 3)
        assert (q >= prev).all()
        prev = q
    with pytest.raises(ValueError, match="one pair of every expert"):
        max_min_quotas(counts, holders, [1, 0, 5])


def test_controller_budget_errors():
    cfg = MoEConfig(**CFG)
    slot = ByteModel.of(cfg).slot
    with pytest.raises(ValueError, match="memory budget too small"):
        Controller(cfg, ClusterBudget(slot), 2).slots(Placement.static(8, 2))
    with pytest.raises(ValueError, match="memory_bytes"):
        ClusterBudget(0)
    with pytest.raises(ValueError, match="slots"):
        ClusterBudget(10**6, slots=[1, 0])
    # every system takes the memory cap (issue 14); one below the owned experts fails at build
    MoELayer(cfg, system="static", budget=ClusterBudget(10**6))
    with pytest.raises(MemoryBudgetExceeded, match="memory budget too small"):
        MoELayer(cfg, system="static", budget=ClusterBudget(slot))


def budget_case(group, fraction):
    """lrmoe with a budget of ``fraction`` x static's peak: quotas, memory, gradients."""
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    n = 512  # enough rows that token buffers, not parameters, dominate the static peak
    sd, x, g = skewed_tokens(cfg, n, 5, "hot")
    lo, hi = rank * n // world, (rank + 1) * n // world
    static = MoELayer(cfg, group=group)
    static.load_full_state_dict(sd)
    static(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
    peak = comm.all_reduce_sum(torch.tensor(static.last_stats["peak_expert_side_bytes"]), group)
    budget = int(fraction * int(peak) / world)  # a fraction of the mean static peak, every rank
    layer = MoELayer(cfg, system="lrmoe", group=group, budget=ClusterBudget(budget))
    layer.load_full_state_dict(sd)
    xs = x[lo:hi].clone().requires_grad_(True)
    layer(xs).backward(g[lo:hi])
    s = layer.last_stats
    assert s["peak_expert_side_bytes"] <= budget, (s["peak_expert_side_bytes"], budget)
    assert (s["quota_E"] <= s["counts_E"]).all()
    assert torch.equal(s["kept_E"], s["quota_E"])
    # the gradients are those of the dense reference with exactly the kept pairs and weights
    keep = torch.cat(comm_gather_bool(layer.last_kept, group))
    scale = comm.all_gather(layer.last_scale, [int(n) for n in comm.all_gather(
        torch.tensor([[hi - lo]]), [1] * world, group).flatten()], group)  # the default samples: 1/π
    ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg, keep_TK=keep, scale_TK=scale)
    close("dx", xs.grad, ref_dx[lo:hi])
    grads = layer.gather_full_grads()
    for name, want in ref_grads.items():
        close(f"grad {name}", grads[name], want)
    return int(s["kept_E"].sum()), int(s["counts_E"].sum()), s["forward_pairs_computed"]


def comm_gather_bool(mask: torch.Tensor, group) -> list[torch.Tensor]:
    world = comm.world_size(group)
    sizes = comm.all_gather(torch.tensor([[mask.shape[0]]]), [1] * world, group).flatten().tolist()
    full = comm.all_gather(mask.to(torch.uint8), sizes, group).bool()
    return list(full.split(sizes))


@pytest.mark.parametrize("world", [2, 4])
def test_budget_respected_and_quotas_monotone(pool, world):
    kept = [sum(r[0] for r in pool.run(world, budget_case, f)) / world for f in (0.55, 0.75, 2.0)]
    total = pool.run(world, budget_case, 2.0)[0][1]
    assert kept[0] <= kept[1] <= kept[2], kept
    assert kept[2] == total, "ample budget keeps every pair"
    assert kept[0] < total, "a tight budget trims the backward"


# ------------------------------------------------------------------- skewed workloads


def skew_case(group, system, pattern):
    cfg = MoEConfig(**CFG)
    rank = comm.rank_of(group)
    torch.manual_seed(0)
    sd = MoELayer(cfg).state_dict()
    budget = 400_000
    kw = dict(budget=ClusterBudget(budget), replan_interval=1) if system == "lrmoe" else {}
    layer = MoELayer(cfg, system=system, group=group, **kw)
    layer.load_full_state_dict(sd)
    peaks, rows = [], []
    for step in range(3):
        n = 16
        if pattern == "empty-rank" and rank == 1:
            n = 0
        elif pattern == "hot-rank" and rank == 0:
            n = 48
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(n, cfg.dim, generator=gen)
        if pattern in ("hot-expert", "moving", "one-expert"):
            hot = step % cfg.num_experts if pattern == "moving" else 0
            with torch.no_grad():
                layer.router.weight[hot] = 6.0 * torch.ones(cfg.dim) / cfg.dim**0.5
                if pattern == "one-expert":
                    layer.router.weight[[e for e in range(8) if e != hot]] = -6.0 / cfg.dim**0.5
            x = x + 2.0 / cfg.dim**0.5
        x.requires_grad_(True)
        out = layer(x)
        out.backward(torch.randn_like(out))
        assert torch.isfinite(x.grad).all()
        if system == "lrmoe":
            assert layer.last_stats["peak_expert_side_bytes"] <= budget
        peaks.append(layer.last_stats["peak_expert_side_bytes"])
        rows.append(layer.last_stats["recv_rows"])
        layer.step_end()
    return max(peaks), max(rows)


@pytest.mark.parametrize("system", ["lrmoe", "symi", "capacity"])
@pytest.mark.parametrize("pattern", ["hot-expert", "hot-rank", "empty-rank", "moving", "one-expert"])
def test_skewed_workloads(pool, system, pattern):
    res = pool.run(4, skew_case, system, pattern)
    assert all(peak > 0 for peak, _ in res)


# ------------------------------------------------------------------- capacity factor


def capacity_case(group, factor):
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 48, 7, "hot")
    lo, hi = rank * 48 // world, (rank + 1) * 48 // world
    layer = MoELayer(cfg, system="capacity", group=group, capacity_factor=factor)
    layer.load_full_state_dict(sd)
    xs = x[lo:hi].clone().requires_grad_(True)
    out = layer(xs)
    out.backward(g[lo:hi])
    # reference: every expert keeps its ceil(C·P/E) most probable pairs, dropped pairs vanish
    # from both passes (router weight included)
    with torch.no_grad():
        from tests.reference import route

        w, ids = route(x, {k: v for k, v in sd.items()}, cfg)
    cap = int(torch.tensor(factor * ids.numel() / cfg.num_experts).ceil())
    keep = torch.zeros_like(ids, dtype=torch.bool)
    for e in range(cfg.num_experts):
        where = (ids == e).nonzero()
        order = torch.argsort(w[where[:, 0], where[:, 1]].double(), descending=True, stable=True)
        top = where[order[:cap]]
        keep[top[:, 0], top[:, 1]] = True
    assert torch.equal(layer.last_kept, keep[lo:hi])
    params = {k: v.detach().clone().requires_grad_("bias" not in k) for k, v in sd.items()}
    xr = x.clone().requires_grad_(True)
    ref = _dropped_reference(xr, params, cfg, keep)
    ref.backward(g)
    close("out", out.detach(), ref.detach()[lo:hi])
    close("dx", xs.grad, xr.grad[lo:hi])
    grads = layer.gather_full_grads()
    for name, p in params.items():
        if p.requires_grad:
            close(f"grad {name}", grads[name], p.grad)
    return int(keep[lo:hi].sum())


def _dropped_reference(x, params, cfg, keep):
    from tests.reference import expert_outputs, route

    w, ids = route(x, params, cfg)
    y, _ = expert_outputs(x, params)
    t = torch.arange(x.shape[0]).unsqueeze(1).expand_as(ids)
    return (w.unsqueeze(-1) * y[ids, t] * keep.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_capacity_factor_drops_in_both_passes(pool, world):
    kept = sum(pool.run(world, capacity_case, 1.0))
    assert kept < 48 * 2


def placement_bytes_case(group):
    """A refresh sends each replica's parameters once from its owner: count them independently."""
    cfg = MoEConfig(**CFG)
    rank = comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 32, 2, "hot")
    layer = MoELayer(cfg, system="symi", group=group)
    layer.load_full_state_dict(sd)
    layer(x[rank * 8:(rank + 1) * 8]).sum().backward()
    layer.step_end()  # symi re-plans and refreshes every step
    p = layer.placement
    mine = sum(1 for r in range(p.world) for e in p.replicas(r) if int(p.owner_E[e]) == rank)
    layer(x[rank * 8:(rank + 1) * 8]).sum().backward()
    assert layer.last_stats["placement_bytes"] == mine * 3 * cfg.dim * cfg.ffn_dim * 4
    return mine


def test_placement_bytes_counted(pool):
    assert sum(pool.run(4, placement_bytes_case)) > 0


def network_case(group, network_bytes):
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 256, 4, "none")
    lo, hi = rank * 256 // world, (rank + 1) * 256 // world
    layer = MoELayer(cfg, system="lrmoe", group=group,
                     budget=ClusterBudget(50_000_000, network_bytes=network_bytes))
    layer.load_full_state_dict(sd)
    layer(x[lo:hi]).backward(g[lo:hi])
    per_row = 3 * cfg.dim * 4  # dy and x in, dx out
    assert layer.last_stats["bwd_gemm_rows"] * per_row <= network_bytes
    return int(layer.last_stats["kept_E"].sum())


def test_network_budget_bounds_kept_rows(pool):
    tight = pool.run(2, network_case, 40 * 3 * 16 * 4)[0]
    loose = pool.run(2, network_case, 10**9)[0]
    assert tight < loose == 512


# ------------------------------------------------------------- lrmoe's replicas chosen by cost


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

    import lrmoe.planning.planner

    planner = _lrmoe_planner(50_000_000, 1e6)
    planner.default_slots_R = [12, 12]  # room for more candidates: 0, 1, 2, 3, 4, 6, 8
    hot = torch.tensor([[400, 200, 10, 10, 10, 10, 10, 10]] * 2)
    scored = []
    real = lrmoe.planning.planner.LayerPlanner._controller_forward
    monkeypatch.setattr(lrmoe.planning.planner.LayerPlanner, "_controller_forward",
                        lambda self, *a: scored.append(1) or real(self, *a))
    planner.plan_call(hot)
    planner.step_end()
    first = len(scored)
    assert first >= 6, "the first search scores every candidate"
    for _ in range(planner.search_interval - 1):
        planner.plan_call(hot)
        scored.clear()
        everything = copy.deepcopy(planner)._controller_replicas(in_call=True)
        scored.clear()
        planner.step_end()
    assert planner.steps == planner.search_interval
    assert 3 <= len(scored) <= 4, len(scored)
    assert planner.placement.slots == everything.slots, "the walk finds the full search's choice"


def test_lrmoe_replica_count_is_searched_every_replan_interval():
    """The replicas follow the load every step; their number is searched every replan_interval
    steps (default 10): a hot expert that cools keeps its replicas until the next search."""
    planner = _lrmoe_planner(50_000_000, 1e6)
    hot, flat = torch.tensor([[400, 10, 10, 10, 10, 10, 10, 10]] * 2), torch.tensor([[60] * 8] * 2)
    planner.plan_call(hot)
    planner.step_end()
    chosen = planner._replica_k
    assert chosen and planner.placement.num_copies > 8
    for step in range(2, 11):
        planner.plan_call(flat)
        planner.step_end()
        if step < planner.search_interval:
            assert planner._replica_k == chosen, step
    assert planner.steps == 10 and planner._replica_k == 0 and planner.placement.num_copies == 8
    assert planner.state()["replica_k"] == 0
