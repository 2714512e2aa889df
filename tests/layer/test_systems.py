"""The replication family (fastermoe, flexmoe, smartmoe, laer, ultraep, topoep): exact like
static, placements and byte counters checked against what was exchanged, and each planner
below static's peak on a skewed workload."""

from __future__ import annotations

import pytest
import torch

from lrmoe import ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.balance import assign_min_peak
from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.replication import (
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
from lrmoe.systems import REPLICATION_FAMILY, PlacementKind, names_where
from tests.reference import reference_grads
from tests.test_counters import Recorder
from tests.test_layer import close, split_tokens
from tests.test_replicas import skewed_tokens

PER_CALL = names_where(placement=PlacementKind.PER_CALL) + names_where(placement=PlacementKind.SHARDED)

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)
FAST_LINK = 1e6  # Gbit/s: moving weights is nearly free, so cost-driven planners do move them


def _kwargs(system: str, world: int, nodes: int) -> dict:
    if system == "topoep":
        return {"budget": ClusterBudget(ranks_per_node=world // nodes)}
    if system in ("flexmoe", "fastermoe"):
        return {"budget": ClusterBudget(inter_node_gbps=FAST_LINK), "load_ema": 0.0}
    if system == "smartmoe":  # a trace whose steps alternate between two hot experts
        trace = torch.ones(6, CFG["num_experts"])
        trace[::2, 0] = 40
        trace[1::2, 5] = 40
        return {"routing_trace": trace}
    return {}


def family_case(group, system: str, steps: int, nodes: int):
    """``steps`` forward+backward calls with step_end between, each against the dense reference
    and static; every byte the layer reports against the bytes all_to_all_single carried."""
    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**CFG)
        world, rank = comm.world_size(group), comm.rank_of(group)
        sd, x, g = skewed_tokens(cfg, 48, 5, "hot")
        sizes = split_tokens(48, world, None)
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        layer = MoELayer(cfg, system=system, group=group, **_kwargs(system, world, nodes))
        layer.load_full_state_dict(sd)
        static = MoELayer(cfg, group=group)
        static.load_full_state_dict(sd)
        ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg)
        rec = Recorder(mp, rank)
        seen = []
        refreshed = 0  # bytes the last step_end sent (replica refresh)
        for _ in range(steps):
            layer.zero_grad()
            static.zero_grad()
            rec.take()
            xs = x[lo:hi].clone().requires_grad_(True)
            out = layer(xs)
            fwd_a2a, _ = rec.take()
            out.backward(g[lo:hi])
            bwd_a2a, _ = rec.take()
            s = dict(layer.last_stats)
            xr = x[lo:hi].clone().requires_grad_(True)
            static(xr).backward(g[lo:hi])
            close("out", out.detach(), ref_out[lo:hi])
            close("dx", xs.grad, ref_dx[lo:hi])
            grads, sgrads = layer.gather_full_grads(), static.gather_full_grads()
            for name, want in ref_grads.items():
                close(f"grad {name}", grads[name], want)
                close(f"vs static {name}", grads[name], sgrads[name], atol=1e-5)
            # Parameter moves are placement bytes: the last step_end's refresh (per-step planners)
            # or this forward's own fetches (per-call planners); the rest is fwd/bwd bytes.
            in_call = sum(a for a, _ in fwd_a2a) - s["fwd_a2a_bytes"]
            assert s["placement_bytes"] == refreshed + in_call
            assert in_call == 0 if system not in PER_CALL else refreshed == 0
            assert s["bwd_a2a_bytes"] == sum(a for a, _ in bwd_a2a)
            assert s["bwd_a2a_recv_bytes"] == sum(r for _, r in bwd_a2a)
            seen.append({"stats": {k: v for k, v in s.items() if not torch.is_tensor(v)},
                         "slots": [list(sl) for sl in layer.placement.slots]})
            rec.take()
            layer.step_end()
            refreshed = sum(a for a, _ in rec.take()[0])
        return seen
    finally:
        mp.undo()


def _param_bytes(cfg: MoEConfig) -> int:
    return 3 * cfg.dim * cfg.ffn_dim * 4


@pytest.mark.parametrize("system", REPLICATION_FAMILY)
def test_family_equals_static_at_world_4(pool, system):
    res = pool.run(4, family_case, system, 3, 2)
    cfg = MoEConfig(**CFG)
    last = [r[-1] for r in res]
    slots = last[0]["slots"]
    assert all(r["slots"] == slots for r in last), "every rank plans the same placement"
    moved = sum(r["stats"]["placement_bytes"] for r in last)
    if system == "laer":  # each assembled expert: W-1 remote slices of 1/W of its parameters
        assert moved == sum(len(s) for s in slots) * 3 * _param_bytes(cfg) // 4
        assert last[0]["stats"]["optimizer_bytes"] == 2 * _param_bytes(cfg) * cfg.num_experts // 4
    elif system in ("fastermoe", "ultraep"):  # every replica fetched from its owner in this call
        replicas = sum(len(s) for s in slots) - cfg.num_experts
        assert replicas > 0, f"{system} replicates the hot expert"
        assert moved == replicas * _param_bytes(cfg)
    if system == "fastermoe":
        assert last[0]["stats"]["shadowed_experts"] >= 1
        assert all(0 in s for s in slots), "the hot expert is shadowed on every rank"
    if system in ("flexmoe", "smartmoe", "topoep"):
        assert any(len(s) > 2 for s in slots), f"{system} holds replicas after re-planning"
    if system == "flexmoe":  # each new copy would carry two Adam moments along (modelled)
        steps = [[set(s) for s in step["slots"]] for step in res[0]]
        for k in range(1, len(steps)):
            created = sum(len(steps[k][r] - steps[k - 1][r]) for r in range(4))
            bound = sum(r[k]["stats"]["bound_optimizer_bytes"] for r in res)
            assert bound == created * 2 * _param_bytes(cfg)
    if system == "topoep":
        s = last[1]["stats"]
        assert 0 <= s["fwd_a2a_inter_bytes"] <= s["fwd_a2a_bytes"]


def test_topoep_two_nodes_of_one(pool):
    res = pool.run(2, family_case, "topoep", 3, 2)
    for r in res:  # one rank per node: everything that leaves a rank crosses nodes
        s = r[-1]["stats"]
        assert s["fwd_a2a_inter_bytes"] == s["fwd_a2a_bytes"] and s["bwd_a2a_inter_bytes"] == s["bwd_a2a_bytes"]


def laer_state_case(group):
    cfg = MoEConfig(**CFG)
    torch.manual_seed(1)
    sd = MoELayer(cfg).state_dict()
    layer = MoELayer(cfg, system="laer", group=group)
    layer.load_full_state_dict(sd)
    W = comm.world_size(group)
    assert layer.experts.gate_up_proj.shape == (cfg.num_experts, 2 * cfg.ffn_dim // W, cfg.dim)
    return all(torch.equal(v, sd[k]) for k, v in layer.full_state_dict().items())


def test_laer_state_dict_round_trip(pool):
    assert all(pool.run(4, laer_state_case))


def test_bad_family_arguments():
    cfg = MoEConfig(**CFG)
    with pytest.raises(ValueError, match="ranks_per_node"):
        MoELayer(cfg, system="topoep")
    with pytest.raises(ValueError, match="routing_trace"):
        MoELayer(cfg, system="static", routing_trace=torch.ones(2, 8))
    with pytest.raises(ValueError, match=r"routing trace must be \(steps, 8\)"):
        MoELayer(cfg, system="smartmoe", routing_trace=torch.ones(2, 5))
    with pytest.raises(ValueError, match="ranks_per_node"):
        ClusterBudget(ranks_per_node=0)
    with pytest.raises(ValueError, match="inter_node_gbps"):
        ClusterBudget(inter_node_gbps=-1.0)
    # every system takes a budget since the memory cap applies to all (issue 14)
    assert MoELayer(cfg, system="capacity", budget=ClusterBudget(ranks_per_node=1)).planner.memory_R is None


# ------------------------------------------------------------------ planners on a skewed load
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
