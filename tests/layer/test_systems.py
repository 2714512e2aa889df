"""The replication family (fastermoe, flexmoe, smartmoe, laer, ultraep, topoep, llep) on the real layer:
exact like static, placements and byte counters checked against what was exchanged, LAER's
sharded state dict, and the family's argument errors. (Each planner below static's peak on a
skewed workload: tests/planning/test_replication.py.)"""

from __future__ import annotations

import pytest
import torch

from lrmoe import ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.systems import REPLICATION_FAMILY, PlacementKind, names_where
from tests.helpers.layer import Recorder, close, skewed_tokens, split_tokens, system_kwargs
from tests.oracles.dense_moe import reference_grads

PER_CALL = names_where(placement=PlacementKind.PER_CALL) + names_where(placement=PlacementKind.SHARDED)

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)


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
        layer = MoELayer(cfg, system=system, group=group, **system_kwargs(system, world, nodes))
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
    elif system in ("fastermoe", "ultraep", "llep"):  # every replica fetched from its owner in this call
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
    # every system takes a budget since the memory cap applies to all
    assert MoELayer(cfg, system="capacity", budget=ClusterBudget(ranks_per_node=1)).planner.memory_R is None
