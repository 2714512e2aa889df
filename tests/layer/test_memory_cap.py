"""One memory cap for every system on the real layer (docs/design.md "The paper's regime"): under
``ClusterBudget(memory_bytes=M)`` each system's measured expert-side peak stays within M on
every rank, call after call and step after step, or every rank raises the same
``MemoryBudgetExceeded`` before rows move; the planner's predicted peak is the measured one;
replicated systems stay exact (equal to static) with fewer copies where the cap asks for it; an
exact system that cannot keep x and the activations keeps x alone and recomputes in chunks,
and one that cannot keep x keeps nothing and moves its rows in rounds, still exact, refused only
where its experts and a one-row round do not fit; chunked passes and rounds within the cap are
exact. (What the planner alone does under the cap:
tests/planning/test_memory_cap.py.)"""

from __future__ import annotations

import pytest
import torch

from lrmoe import SYSTEMS, ClusterBudget, MemoryBudgetExceeded, MoEConfig, MoELayer
from lrmoe.memory.bytes import ByteModel
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


def cap_case(group, system: str, fraction: float, cap_bytes: int | None = None, tokens: int = N):
    """``system`` under a cap of ``fraction`` × static's largest peak (or of ``cap_bytes``), with
    static (no cap) beside it. Returns ("ok", per-call records) or ("oom", the error's fields
    and message)."""
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, tokens, SEED, "hot")
    lo, hi = rank * tokens // world, (rank + 1) * tokens // world
    static = MoELayer(cfg, group=group)
    static.load_full_state_dict(sd)
    static(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
    peaks = comm.all_gather(torch.tensor([[static.last_stats["peak_expert_side_bytes"]]]), [1] * world, group)
    cap = int(fraction * int(peaks.max())) if cap_bytes is None else cap_bytes
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
                                                      "memory_cap_bytes", "replica_slots", "keep_mode",
                                                      "fwd_chunk_rows", "bwd_chunk_rows", "recv_rows",
                                                      "exchange_rounds", "kept_acts_rows", "kept_gate_up_rows")})
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
            if not spec_of(system).compacts:  # the planner's prediction is the meter's measurement
                assert rec["predicted_peak_bytes"] == rec["peak_expert_side_bytes"], (system, rank, rec)
    return status


# One cap per world size with one hot expert, below static's peak: at 2 ranks symi fits only with
# fewer replicas than its default (6 slots → 4 and 5); at 4 ranks its default's 3 slots fit.
FRACTION = {2: 0.9, 4: 0.7}
MUST_FIT = {"static", "static-recompute", "symi", "flexmoe", "smartmoe", "ultraep", "topoep", "lrmoe", "capacity",
            "llep", "lrmoe-capacity"}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_within_the_cap_or_raises(pool, system, world):
    res = pool.run(world, cap_case, system, FRACTION[world])
    status = _check(res, system)
    if system == "static":  # below its own peak: it keeps x alone on the hot rank, recomputing
        assert status == "ok", res[0][2]
        assert any(rec.get("keep_mode") == "x" for r in res for rec in r[2]), res[0][2]
    if system in MUST_FIT:
        assert status == "ok", f"{system} should fit: {res[0][2]}"
    if system == "symi" and world == 2:
        default = LayerPlanner(spec_of("symi"), MoEConfig(**CFG), world).default_slots_R
        slots = [r[2][-1]["replica_slots"] for r in res]
        assert any(s < d for s, d in zip(slots, default)), (slots, default)


# The exact systems at half of static's peak, one hot expert: each fits by keeping x alone and
# chunking its forward and backward (no replica needed), and stays equal to uncapped static.
# (laer is not among them: its slices of every expert and their gradients, beside the experts
# it assembles, are more than half of static's peak at this shape. llep fits here with no spill
# copy — a copy weighs more than the rows it would take at 96 tokens; with its copies under half
# the peak at 256 tokens: tests/layer/test_llep.py.)
HALF = ["static", "static-recompute", "symi", "ultraep", "fastermoe", "llep"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("system", HALF)
def test_exact_systems_fit_half_of_static_peak(pool, system, world):
    res = pool.run(world, cap_case, system, 0.5)
    assert _check(res, system) == "ok", res[0][2]
    hot = max(range(world), key=lambda r: max(rec.get("recv_rows") or 0 for rec in res[r][2]))
    train = [rec for rec in res[hot][2] if rec.get("keep_mode")]
    assert all(rec["keep_mode"] == "x" for rec in train), train
    assert any(rec["bwd_chunk_rows"] < rec["recv_rows"] for rec in train), "the hot rank's backward is chunked"


# Below what keeping x fits (x and dy of every row of the hot rank beside its experts), the exact
# systems keep nothing and move each exchange in rounds, x re-sent with dy: still within the cap
# and equal to uncapped static. (The fractions sit between the least a one-row round needs and
# the least keeping x needs, at this shape: 0.32-0.47 of static's peak at 2 ranks, 0.24-0.40 at 4.)
ROUNDS_FRACTION = {2: 0.4, 4: 0.3}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("system", HALF)
def test_exact_systems_fit_in_rounds_below_what_keeping_x_fits(pool, system, world):
    res = pool.run(world, cap_case, system, ROUNDS_FRACTION[world])
    assert _check(res, system) == "ok", res[0][2]
    hot = max(range(world), key=lambda r: max(rec.get("recv_rows") or 0 for rec in res[r][2]))
    train = [rec for rec in res[hot][2] if rec.get("keep_mode")]
    assert all(rec["keep_mode"] == "nothing" and rec["exchange_rounds"] > 1 for rec in train), train
    assert all(rec["fwd_chunk_rows"] == rec["bwd_chunk_rows"] < rec["recv_rows"] for rec in train), train


def _one_row_round(world: int) -> int:
    """What a rank owning its share of the experts needs for a call in rounds of one row."""
    cfg = MoEConfig(**CFG)
    bm = ByteModel.of(cfg, selective=False)
    return cfg.num_experts // world * bm.slot + max(bm.round_forward(1), bm.round_backward(1))


def test_exact_system_refused_only_below_its_experts_and_a_one_row_round(pool):
    """static is refused only where its owned experts and the buffers of a one-row round do not
    fit: at exactly that cap every call runs, in rounds of one row on every rank with rows; a
    byte less and every rank raises, saying that nothing was kept and rows went one at a time."""
    need = _one_row_round(2)
    res = pool.run(2, cap_case, "static", 0.0, need)
    assert _check(res, "static") == "ok", res[0][2]
    train = [rec for r in res for rec in r[2] if rec.get("keep_mode")]
    assert all(rec["keep_mode"] == "nothing" and rec["fwd_chunk_rows"] == 1 for rec in train), train
    assert max(rec["peak_expert_side_bytes"] for rec in train) == need
    res = pool.run(2, cap_case, "static", 0.0, need - 1)
    assert _check(res, "static") == "oom"
    msg = res[0][2][3]
    assert "nothing kept to the backward and every exchange in rounds of one row" in msg, msg
    assert "lrmoe" in msg, "the message names the system that trims"


def lrmoe_norms_case(group, fraction: float):
    """lrmoe's ‖h‖² per pair (the LRM score's expert-side factor) from a forward under a cap of
    ``fraction`` × static's peak, and from an uncapped one on the same input."""
    import lrmoe.passes.forward as forward

    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, _ = skewed_tokens(cfg, N, SEED, "hot")
    lo, hi = rank * N // world, (rank + 1) * N // world
    cap = cap_case(group, "static", 1.0)[1]  # static's largest peak
    outputs, seen = forward.outputs, []
    forward.outputs = lambda *a: seen.append(outputs(*a)[2]) or outputs(*a)
    try:
        for budget in (ClusterBudget(memory_bytes=int(fraction * cap)), None):
            layer = MoELayer(cfg, system="lrmoe", group=group, budget=budget)
            layer.load_full_state_dict(sd)
            layer(x[lo:hi].clone().requires_grad_(True))
            seen.append(layer.last_stats.get("exchange_rounds"))
    finally:
        forward.outputs = outputs
    return seen


# lrmoe's complete forward holds x and y of every received row at once; below that it moves its
# rows in rounds as the exact systems do, ‖h‖² coming home beside y, and its backward re-sends
# the kept pairs' x (keep mode "nothing"): within the cap, where it stopped with an oom before.
@pytest.mark.parametrize("world", [2, 4])
def test_lrmoe_fits_in_rounds_where_the_exact_systems_do(pool, world):
    res = pool.run(world, cap_case, "lrmoe", ROUNDS_FRACTION[world])
    assert _check(res, "lrmoe") == "ok", res[0][2]
    hot = max(range(world), key=lambda r: max(rec.get("recv_rows") or 0 for rec in res[r][2]))
    train = [rec for rec in res[hot][2] if rec.get("keep_mode")]
    assert all(rec["keep_mode"] == "nothing" and rec["exchange_rounds"] > 1 for rec in train), train
    for capped, rounds, uncapped, whole in pool.run(world, lrmoe_norms_case, ROUNDS_FRACTION[world]):
        assert rounds > 1 and whole is None
        close("‖h‖² in rounds", capped, uncapped)


def test_laer_assembles_fewer_experts_within_the_cap(pool):
    res = pool.run(4, cap_case, "laer", 0.85)
    assert _check(res, "laer") == "ok"


@pytest.mark.parametrize("world", [2, 4])
def test_laer_fits_half_of_static_peak_where_its_slices_do(pool, world):
    """laer holds a slice of every expert and its gradient beside the experts it assembles: at 96
    tokens that alone is more than half of static's peak, so it is refused there; at 256 tokens
    (rows weigh more than experts) it fits half of static's peak, exact."""
    res = pool.run(world, cap_case, "laer", 0.5)
    assert _check(res, "laer") == "oom" and "rounds of one row" in res[0][2][3], res[0][2]
    res = pool.run(world, cap_case, "laer", 0.5, None, 256)
    assert _check(res, "laer") == "ok", res[0][2]


def _capped_beside_free(system: str, cap_of) -> tuple[dict, dict]:
    """World size 1: one training call of ``system`` without a cap and one under the cap
    ``cap_of(uncapped layer)``; asserts the capped call's dx and every gradient equal the
    uncapped call's. Returns both calls' ``last_stats`` (uncapped, capped)."""
    torch.manual_seed(0)
    cfg = MoEConfig(**CFG)
    sd, x, g = skewed_tokens(cfg, N, SEED, "hot")
    free = MoELayer(cfg, system=system)
    free.load_full_state_dict(sd)
    xf = x.clone().requires_grad_(True)
    free(xf).backward(g)
    layer = MoELayer(cfg, system=system, budget=ClusterBudget(memory_bytes=cap_of(free)))
    layer.load_full_state_dict(sd)
    xs = x.clone().requires_grad_(True)
    layer(xs).backward(g)
    close("dx", xs.grad, xf.grad)
    for name, p in layer.named_parameters():
        close(name, p.grad, dict(free.named_parameters())[name].grad)
    return dict(free.last_stats), dict(layer.last_stats)


@pytest.mark.parametrize("system", ["static", "static-recompute", "symi"])
def test_rounds_within_the_cap_are_exact(system):
    """World size 1, a cap of the experts and three rows' rounds: 96 tokens' 192 rows go in
    rounds of 3 through both passes, measured as predicted, with the uncapped call's gradients."""
    cfg = MoEConfig(**CFG)
    bm = ByteModel.of(cfg, selective=False)
    cap = cfg.num_experts * bm.slot + max(bm.round_forward(3), bm.round_backward(3))
    _, s = _capped_beside_free(system, lambda free: cap)
    assert s["keep_mode"] == "nothing" and s["fwd_chunk_rows"] == s["bwd_chunk_rows"] == 3, s
    assert s["exchange_rounds"] == -(-s["recv_rows"] // 3)
    assert s["peak_expert_side_bytes"] == s["predicted_peak_bytes"] == cap


@pytest.mark.parametrize("system", ["masked", "static-recompute", "static"])
def test_chunked_passes_within_the_cap_are_exact(system):
    """World size 1, a cap just below the unchunked call's need: the forward runs in chunks
    (masked: ‖h‖² beside every row), and where that is not enough the backward recomputes in
    chunks too (static first keeps x alone); the measured peak is the predicted one, within the
    cap, and the gradients equal the uncapped call's."""
    free, s = _capped_beside_free(system, lambda layer: layer.last_stats["peak_expert_side_bytes"] - 1)
    assert s["peak_expert_side_bytes"] == s["predicted_peak_bytes"] <= free["peak_expert_side_bytes"] - 1
    rows = s["recv_rows"]
    if system == "static":
        assert s["keep_mode"] == "x"
    if system in ("static-recompute", "static"):  # a recompute backward's peak is its recompute: chunked
        assert s["bwd_chunk_rows"] < rows, s
    else:
        assert s["fwd_chunk_rows"] < rows and s["bwd_chunk_rows"] == rows, s
