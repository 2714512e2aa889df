"""One memory cap for every system on the real layer (docs/design.md "The paper's regime"): under
``ClusterBudget(memory_bytes=M)`` each system's measured expert-side peak stays within M on
every rank, call after call and step after step, or every rank raises the same
``MemoryBudgetExceeded`` before rows move; the planner's predicted peak is the measured one;
replicated systems stay exact (equal to static) with fewer copies where the cap asks for it; a
chunked forward within the cap is exact. (What the planner alone does under the cap:
tests/planning/test_memory_cap.py.)"""

from __future__ import annotations

import pytest
import torch

from lrmoe import SYSTEMS, ClusterBudget, MemoryBudgetExceeded, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import BackwardKind, spec_of
from tests.helpers.layer import close, skewed_tokens, system_kwargs

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)
N = 96  # tokens over all ranks: the hot expert's rows weigh as much as a rank's parameters
SEED = 5
STEPS, CALLS = 2, 2  # optimizer steps (step_end between) and training calls per step


def _exact(system: str) -> bool:
    """Systems whose gradients equal static's (every pair in both passes)."""
    spec = spec_of(system)
    return not spec.forward_drop and spec.backward is not BackwardKind.SELECTIVE


def _budget(system: str, world: int, cap: int) -> tuple[ClusterBudget, dict]:
    kw = system_kwargs(system, world, 2 if world == 4 else 1)
    extra = kw.pop("budget", None)
    topo = {} if extra is None else {"ranks_per_node": extra.ranks_per_node, "inter_node_gbps": extra.inter_node_gbps}
    return ClusterBudget(memory_bytes=cap, **topo), kw


def cap_case(group, system: str, fraction: float):
    """``system`` under a cap of ``fraction`` × static's largest peak, with static (no cap) beside
    it. Returns ("ok", per-call records) or ("oom", the error's fields and message)."""
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, N, SEED, "hot")
    lo, hi = rank * N // world, (rank + 1) * N // world
    static = MoELayer(cfg, group=group)
    static.load_full_state_dict(sd)
    static(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
    peaks = comm.all_gather(torch.tensor([[static.last_stats["peak_expert_side_bytes"]]]), [1] * world, group)
    cap = int(fraction * int(peaks.max()))
    budget, kw = _budget(system, world, cap)
    records = []
    try:
        layer = MoELayer(cfg, system=system, group=group, budget=budget, **kw)
        layer.load_full_state_dict(sd)
        for _ in range(STEPS):
            for _ in range(CALLS):
                layer.zero_grad()
                static.zero_grad()
                xs = x[lo:hi].clone().requires_grad_(True)
                out = layer(xs)
                out.backward(g[lo:hi])
                s = dict(layer.last_stats)
                if _exact(system):
                    xr = x[lo:hi].clone().requires_grad_(True)
                    ref = static(xr)
                    ref.backward(g[lo:hi])
                    close("out", out.detach(), ref.detach())
                    close("dx", xs.grad, xr.grad)
                    grads, sgrads = layer.gather_full_grads(), static.gather_full_grads()
                    for name, want in sgrads.items():
                        close(f"vs static {name}", grads[name], want, atol=1e-5)
                records.append({k: s.get(k) for k in ("peak_expert_side_bytes", "predicted_peak_bytes",
                                                      "memory_cap_bytes", "replica_slots")})
            with torch.no_grad():  # an evaluation call: the forward alone, within the cap too
                layer(x[lo:hi])
            e = dict(layer.last_stats)
            records.append({k: e.get(k) for k in ("peak_expert_side_bytes", "predicted_peak_bytes",
                                                  "memory_cap_bytes", "replica_slots")})
            layer.step_end()
            static.step_end()
    except MemoryBudgetExceeded as err:
        return "oom", cap, (err.rank, err.needed, err.cap, str(err)), len(records)
    return "ok", cap, records, len(records)


def _check(res: list, system: str) -> str:
    status = res[0][0]
    assert all(r[0] == status for r in res), f"{system}: ranks disagree {[r[0] for r in res]}"
    cap = res[0][1]
    if status == "oom":
        # the same error at the same call on every rank, naming a rank, its need and the cap
        assert all(r[2] == res[0][2] and r[3] == res[0][3] for r in res), system
        rank, needed, got_cap, msg = res[0][2]
        assert got_cap == cap and needed > cap and 0 <= rank < len(res)
        assert f"rank {rank} needs {needed} bytes" in msg and str(cap) in msg and "would help" in msg
        return status
    for rank, r in enumerate(res):
        assert len(r[2]) == STEPS * (CALLS + 1)
        for rec in r[2]:
            assert rec["peak_expert_side_bytes"] <= cap, (system, rank, rec, cap)
            assert rec["memory_cap_bytes"] == cap and rec["replica_slots"] >= 1
            if system != "lrmoe":  # the planner's prediction is the meter's measurement
                assert rec["predicted_peak_bytes"] == rec["peak_expert_side_bytes"], (system, rank, rec)
    return status


# One cap per world size with one hot expert: below static's peak, where symi fits only with
# fewer replicas than its default (2 ranks: 6 slots → 4 and 5; 4 ranks: 3 slots → some 2).
FRACTION = {2: 0.9, 4: 0.7}
MUST_FIT = {"symi", "flexmoe", "smartmoe", "ultraep", "topoep", "lrmoe", "capacity"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_within_the_cap_or_raises(pool, system, world):
    res = pool.run(world, cap_case, system, FRACTION[world])
    status = _check(res, system)
    if system == "static":
        assert status == "oom", "the cap is below static's peak"
        assert "static-recompute" in res[0][2][3], "the message says what would help"
    if system in MUST_FIT:
        assert status == "ok", f"{system} should fit: {res[0][2]}"
    if system == "symi":
        default = LayerPlanner(spec_of("symi"), MoEConfig(**CFG), world).default_slots_R
        slots = [r[2][-1]["replica_slots"] for r in res]
        assert any(s < d for s, d in zip(slots, default)), (slots, default)


def test_laer_assembles_fewer_experts_within_the_cap(pool):
    res = pool.run(4, cap_case, "laer", 0.85)
    assert _check(res, "laer") == "ok"


@pytest.mark.parametrize("system", ["masked", "static-recompute"])
def test_chunked_forward_within_the_cap_is_exact(system):
    """World size 1, a cap just below the unchunked forward's need: the forward runs in chunks
    (masked: ‖h‖² beside every row) or, where chunks cannot help, the call is refused."""
    torch.manual_seed(0)
    cfg = MoEConfig(**CFG)
    sd, x, g = skewed_tokens(cfg, N, SEED, "hot")
    free = MoELayer(cfg, system=system)
    free.load_full_state_dict(sd)
    xf = x.clone().requires_grad_(True)
    free(xf).backward(g)
    need = free.last_stats["peak_expert_side_bytes"]
    layer = MoELayer(cfg, system=system, budget=ClusterBudget(memory_bytes=need - 1))
    layer.load_full_state_dict(sd)
    xs = x.clone().requires_grad_(True)
    if system == "static-recompute":  # its backward recomputes every row at once: no chunk helps
        with pytest.raises(MemoryBudgetExceeded):
            layer(xs)
        return
    out = layer(xs)
    out.backward(g)
    s = layer.last_stats
    # only the forward's chunks differ from the unchunked call, whose peak is ``need``
    assert s["peak_expert_side_bytes"] == s["predicted_peak_bytes"] <= need - 1
    close("dx", xs.grad, xf.grad)
    for name, p in layer.named_parameters():
        close(name, p.grad, dict(free.named_parameters())[name].grad)
