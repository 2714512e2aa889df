"""llep on the real layer at 2 and 4 gloo ranks with one hot expert, uncapped and under a cap of
half static's uncapped peak: output, dx and every parameter gradient equal static's; the copies
are the planner's (spills of the call's own counts, fetched in the forward); the byte counters
follow the plan — ``placement_bytes`` the copies this rank's experts sent, ``bwd_a2a_bytes`` dy
out, dx back and each copy's weight gradient returned to its owner — and equal what
``all_to_all_single`` carried. (The decision on hand-made counts: tests/planning/test_least_loaded.py.)"""

from __future__ import annotations

import pytest
import torch

from lrmoe import ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import spec_of
from tests.helpers.layer import Recorder, close, skewed_tokens
from tests.oracles.dense_moe import route

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)
N = 256  # tokens over all ranks: enough rows that spilling them pays for the copies under half the peak
SEED = 5
RTOL = 1e-5


def _counts_SE(x: torch.Tensor, sd: dict, cfg: MoEConfig, world: int) -> torch.Tensor:
    _, ids = route(x, sd, cfg)
    return torch.stack([torch.bincount(ids[r * N // world:(r + 1) * N // world].reshape(-1),
                                       minlength=cfg.num_experts) for r in range(world)])


def llep_case(group, fraction: float | None):
    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**CFG)
        world, rank = comm.world_size(group), comm.rank_of(group)
        sd, x, g = skewed_tokens(cfg, N, SEED, "hot")
        lo, hi = rank * N // world, (rank + 1) * N // world
        static = MoELayer(cfg, group=group)
        static.load_full_state_dict(sd)
        xr = x[lo:hi].clone().requires_grad_(True)
        ref = static(xr)
        ref.backward(g[lo:hi])
        peaks = comm.all_gather(torch.tensor([[static.last_stats["peak_expert_side_bytes"]]]), [1] * world, group)
        budget = None if fraction is None else ClusterBudget(memory_bytes=int(fraction * int(peaks.max())))
        layer = MoELayer(cfg, system="llep", group=group, budget=budget)
        layer.load_full_state_dict(sd)
        rec = Recorder(mp, rank)
        xs = x[lo:hi].clone().requires_grad_(True)
        out = layer(xs)
        fwd = rec.take()[0]
        out.backward(g[lo:hi])
        bwd = rec.take()[0]
        s = dict(layer.last_stats)
        close("out", out.detach(), ref.detach(), RTOL)
        close("dx", xs.grad, xr.grad, RTOL)
        mine, theirs = dict(layer.named_parameters()), dict(static.named_parameters())
        for name in ("router.weight",):  # replicated on every rank: this rank's own part
            close(f"local {name}", mine[name].grad, theirs[name].grad, RTOL)
        grads, sgrads = layer.gather_full_grads(), static.gather_full_grads()
        assert grads.keys() == sgrads.keys()
        for name, want in sgrads.items():
            close(f"vs static {name}", grads[name], want, RTOL)
        plan = LayerPlanner(spec_of("llep"), cfg, world, budget=budget).plan_call(_counts_SE(x, sd, cfg, world))
        return {"stats": {k: v for k, v in s.items() if not torch.is_tensor(v)},
                "slots": [list(sl) for sl in layer.placement.slots],
                "plan_slots": [list(sl) for sl in plan.placement.slots],
                "rows_SR": plan.assignment.rows_SR().tolist(), "owner_E": plan.placement.owner_E.tolist(),
                "fwd_sent": sum(a for a, _ in fwd), "bwd_sent": sum(a for a, _ in bwd),
                "bwd_recv": sum(b for _, b in bwd), "cap": None if budget is None else budget.memory_bytes}
    finally:
        mp.undo()


@pytest.mark.parametrize("fraction", [None, 0.5])
@pytest.mark.parametrize("world", [2, 4])
def test_llep_equals_static_with_its_byte_counters(pool, world, fraction):
    res = pool.run(world, llep_case, fraction)
    cfg = MoEConfig(**CFG)
    row, params = cfg.dim * 4, 3 * cfg.dim * cfg.ffn_dim * 4  # an x / dy / dx row; one copy's parameters
    slots, owner = res[0]["slots"], res[0]["owner_E"]
    assert all(r["slots"] == slots == r["plan_slots"] for r in res), "every rank places what the planner plans"
    replicas = [[e for e in sl if owner[e] != q] for q, sl in enumerate(slots)]
    assert sum(map(len, replicas)) > 0, "the hot call spills copies"
    rows_SR = res[0]["rows_SR"]
    for q, r in enumerate(res):
        s = r["stats"]
        # copies fetched in this forward from their owners: parameter bytes, not forward bytes
        sent_copies = sum(owner[e] == q for rep in replicas for e in rep)
        assert s["placement_bytes"] == sent_copies * params == r["fwd_sent"] - s["fwd_a2a_bytes"]
        # backward: dy to where the forward computed each pair, dx back, each copy's gradient to its owner
        dy = sum(rows_SR[q][d] for d in range(world) if d != q)
        dx = sum(rows_SR[src][q] for src in range(world) if src != q)
        assert s["bwd_a2a_bytes"] == (dy + dx) * row + len(replicas[q]) * params == r["bwd_sent"]
        assert s["bwd_a2a_recv_bytes"] == r["bwd_recv"]
        assert s["replicas"] == sum(map(len, replicas)) and s["replica_slots"] == len(slots[q])
        if r["cap"] is not None:
            assert s["peak_expert_side_bytes"] == s["predicted_peak_bytes"] <= r["cap"], s
            assert s["keep_mode"] == "x", "half static's peak: x alone kept, the activations recomputed"
