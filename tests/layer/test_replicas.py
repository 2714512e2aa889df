"""Replicated expert parallelism on the real layer (symi, budgeted lrmoe): exact against the dense
reference and static, a trimmed backward on replicas equal to the reference with its kept
pairs, a memory budget respected with quotas monotone in it, a network budget
bounding the kept rows, skewed workloads (lrmoe, symi, capacity), and the bytes of a replica
refresh counted. (The planners alone: tests/planning/.)"""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig, MoELayer
from lrmoe.memory.bytes import IN_PLACE_FROM
from lrmoe.parallel import comm
from lrmoe.parallel.replicas import Replicas
from lrmoe.planning.placement import Placement
from tests.helpers.layer import close, equals_kept_reference, skewed_tokens, split_tokens
from tests.oracles.dense_moe import reference_grads

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)


def replicated_case(group, system, steps, skew, budget_bytes=None, link_gbps=None, overlap=False):
    """Run ``steps`` optimizer-free iterations (step_end between them, placement re-planned)
    and compare every call with the dense reference and the static system (``overlap``: the
    replicas' gradients finished at the backward pass's end)."""
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
    layer.overlap_replica_grads = overlap
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


@pytest.mark.parametrize("system", ["symi", "lrmoe"])
def test_replica_gradients_finished_at_the_backward_end_are_exact(pool, system):
    """With the training loop's opt-in the owners' gradients (dense reference, every step) are
    the same: the replicas' share arrives when the backward pass ends."""
    budget = (50_000_000, 1e6) if system == "lrmoe" else (None, None)
    res = pool.run(2, replicated_case, system, 3, "hot", *budget, True)
    assert any(len(h) > 1 for h in res[0][0][-1]), "replicas held"


class _Upstream(torch.autograd.Function):
    """Identity whose backward records that it ran: upstream of the layer, it runs after the
    layer's backward has returned."""

    ran: list[str] = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Upstream.ran.append("upstream")
        return g


def overlap_order_case(group, overlap: bool):
    from lrmoe.parallel.replicas import PendingGrads

    cfg, layer, xs = hot_layer(group)
    layer.overlap_replica_grads = overlap
    layer(xs).sum().backward()
    layer.step_end()  # symi holds replicas from here
    real = PendingGrads.add_into
    PendingGrads.add_into = lambda self, *a: _Upstream.ran.append("reduce") or real(self, *a)
    try:
        _Upstream.ran.clear()
        layer(_Upstream.apply(xs.clone().requires_grad_(True))).sum().backward()
    finally:
        PendingGrads.add_into = real
    assert layer.placement.num_copies > cfg.num_experts
    stage = layer.last_stats["stage_ms"]["bwd_reduce_grads"]
    return list(_Upstream.ran), stage > 0


@pytest.mark.parametrize(("overlap", "order"), [(False, ["reduce", "upstream"]), (True, ["upstream", "reduce"])])
def test_replica_gradients_wait_for_the_backward_end_only_with_the_opt_in(pool, overlap, order):
    assert pool.run(2, overlap_order_case, overlap) == [(order, True)] * 2


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


def trimmed_on_replicas_case(group, ratio):
    """A trimmed backward on replicated experts (a fast link: the hot expert replicated after the
    first call): each call's gradients are the dense reference's with its kept pairs and their
    1/π weights, pairs drawn on a replica included."""
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 40, 3, "hot")
    sizes = split_tokens(40, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system="lrmoe", group=group, budget=ClusterBudget(50_000_000, inter_node_gbps=1e6),
                     replan_interval=1, backward=BackwardConfig("local-sampled", ratio=ratio, seed=2))
    layer.load_full_state_dict(sd)
    for step in range(3):
        layer.zero_grad()
        xs = x[lo:hi].clone().requires_grad_(True)
        layer(xs).backward(g[lo:hi])
        assert int(layer.last_stats["kept_E"].sum()) < int(layer.last_stats["counts_E"].sum()), "trimmed"
        equals_kept_reference(layer, xs.grad, x, g, sd, cfg, sizes, group, f"call {step}")
        layer.step_end()
    return [len(h) for h in layer.placement.holder_lists], layer.last_stats["compaction"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("ratio", [0.3, 0.8])
def test_a_trimmed_backward_on_replicas_equals_the_kept_reference(pool, world, ratio):
    holders, compaction = pool.run(world, trimmed_on_replicas_case, ratio)[0]
    assert holders[0] > 1, "the hot expert replicated"
    assert compaction == ("in place" if ratio > IN_PLACE_FROM else "gathered")


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


# ------------------------------------------------------------------- refresh bytes, network budget


def hot_layer(group, system: str = "symi", **kwargs):
    """(cfg, layer, this rank's 8 tokens): ``system`` at 2 ranks of 8 tokens, one hot expert."""
    cfg = MoEConfig(**CFG)
    rank = comm.rank_of(group)
    sd, x, _ = skewed_tokens(cfg, 32, 2, "hot")
    layer = MoELayer(cfg, system=system, group=group, **kwargs)
    layer.load_full_state_dict(sd)
    return cfg, layer, x[rank * 8:(rank + 1) * 8]


def placement_bytes_case(group):
    """A refresh sends each replica's parameters once from its owner: count them independently."""
    cfg, layer, xs = hot_layer(group)
    rank = comm.rank_of(group)
    layer(xs).sum().backward()
    layer.step_end()  # symi re-plans and refreshes every step
    p = layer.placement
    mine = sum(1 for r in range(p.world) for e in p.replicas(r) if int(p.owner_E[e]) == rank)
    layer(xs).sum().backward()
    assert layer.last_stats["placement_bytes"] == mine * 3 * cfg.dim * cfg.ffn_dim * 4
    return mine


def test_placement_bytes_counted(pool):
    assert sum(pool.run(4, placement_bytes_case)) > 0


def replica_free_refresh_case(group):
    """lrmoe at the default link keeps owned experts only here: its step_end exchanges nothing."""
    from lrmoe.parallel import replicas

    cfg, layer, xs = hot_layer(group, "lrmoe", budget=ClusterBudget(50_000_000), replan_interval=1)
    exchanges, real = [], replicas.comm.all_to_all_start
    for _ in range(2):
        layer(xs).sum().backward()
        replicas.comm.all_to_all_start = lambda *a, **k: exchanges.append(1) or real(*a, **k)
        try:
            layer.step_end()
            layer.wait_for_replicas()
        finally:
            replicas.comm.all_to_all_start = real
    assert layer.placement.num_copies == cfg.num_experts and len(layer.replicas.experts) == 0
    return len(exchanges)


def overlapped_refresh_case(group):
    """step_end issues the refresh and returns; the next forward (or wait_for_replicas) waits."""
    from lrmoe.parallel import replicas
    from lrmoe.parallel.comm import PendingExchange

    cfg, layer, xs = hot_layer(group)
    started, waited = [], []
    real_start, real_wait = replicas.comm.all_to_all_start, PendingExchange.wait

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    PendingExchange.wait = lambda self: waited.append(self) or real_wait(self)  # held: no id reused
    try:
        layer(xs).sum().backward()
        replicas.comm.all_to_all_start = start
        layer.step_end()  # symi re-plans and refreshes every step
        replicas.comm.all_to_all_start = real_start
        refresh = started[-1]
        in_step_end = any(w is refresh for w in waited)
        layer(xs).sum().backward()
        in_forward = any(w is refresh for w in waited)
        replicas.comm.all_to_all_start = start
        layer.step_end()
        replicas.comm.all_to_all_start = real_start
        before, _ = any(w is started[-1] for w in waited), layer.wait_for_replicas()
        after = any(w is started[-1] for w in waited)
    finally:
        replicas.comm.all_to_all_start, PendingExchange.wait = real_start, real_wait
    assert layer.placement.num_copies > cfg.num_experts, "symi holds replicas here"
    return in_step_end, in_forward, before, after


def test_step_end_issues_the_refresh_and_the_next_forward_waits_for_it(pool):
    assert pool.run(2, overlapped_refresh_case) == [(False, True, False, True)] * 2


def test_a_replica_free_placement_refreshes_without_an_exchange(pool):
    assert pool.run(2, replica_free_refresh_case) == [0, 0]


def network_case(group, network_bytes, network_fraction=None):
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 256, 4, "none")
    lo, hi = rank * 256 // world, (rank + 1) * 256 // world
    budget = ClusterBudget(50_000_000, network_bytes=network_bytes, network_fraction=network_fraction)
    layer = MoELayer(cfg, system="lrmoe", group=group, budget=budget)
    layer.load_full_state_dict(sd)
    layer(x[lo:hi]).backward(g[lo:hi])
    per_row = 3 * cfg.dim * 4  # dy and x in, dx out
    assert layer.last_stats["bwd_gemm_rows"] * per_row <= (network_bytes or network_fraction * 256 * per_row)
    return int(layer.last_stats["kept_E"].sum())


def test_network_budget_bounds_kept_rows(pool):
    tight = pool.run(2, network_case, 40 * 3 * 16 * 4)[0]
    loose = pool.run(2, network_case, 10**9)[0]
    assert tight < loose == 512


def test_a_network_fraction_is_the_mean_loaded_ranks_keep_nothing_bytes(pool):
    """512 pairs over 2 ranks: 0.3 of 256 rows' x, dy and dx is the budget 0.3 · 256 · 3 · D · 4."""
    as_fraction = pool.run(2, network_case, None, 0.3)[0]
    assert as_fraction == pool.run(2, network_case, int(0.3 * 256) * 3 * 16 * 4)[0] < 512
    with pytest.raises(ValueError, match="not both"):
        ClusterBudget(memory_bytes=10**6, network_bytes=1000, network_fraction=0.5)


def out_of_order_refresh_case(group, wait):
    """Owners not in expert order (rank 0's replicas 1 and 2 come from ranks 3 and 2): the
    received rows, in source order, must land in their replica slots. ``wait``: a plain refresh,
    else a started one installed by ``ready``."""
    rank, D, F = comm.rank_of(group), 2, 3
    owner_E = torch.tensor([0, 3, 2, 1, 0, 1, 2, 3])
    owned = [tuple(e for e in range(8) if int(owner_E[e]) == r) for r in range(4)]
    extra = [(1, 2), (), (), ()]
    placement = Placement(8, tuple(owned[r] + extra[r] for r in range(4)), owner_E)
    full_gu = torch.arange(8 * 2 * F * D, dtype=torch.float32).view(8, 2 * F, D)
    full_down = -torch.arange(8 * D * F, dtype=torch.float32).view(8, D, F)
    replicas = Replicas(D, F, torch.float32)
    mine = list(owned[rank])
    if wait:
        replicas.refresh(full_gu[mine], full_down[mine], placement, rank, group)
    else:
        replicas.start_refresh(full_gu[mine], full_down[mine], placement, rank, group)
        replicas.ready()
    assert replicas.experts == extra[rank]
    assert torch.equal(replicas.gate_up_proj, full_gu[list(extra[rank])])
    assert torch.equal(replicas.down_proj, full_down[list(extra[rank])])


@pytest.mark.parametrize("wait", [True, False])
def test_refresh_puts_rows_from_several_owners_in_slot_order(pool, wait):
    pool.run(4, out_of_order_refresh_case, wait)


def test_flat_rows_lay_out_each_expert_as_its_gate_up_then_its_down():
    from lrmoe.parallel.replicas import flat_rows

    gate_up, down = torch.randn(5, 6, 4), torch.randn(5, 4, 3)
    for idx in ([3, 1, 1, 4], None, []):
        at = list(range(5)) if idx is None else idx
        want = torch.stack([torch.cat([gate_up[e].flatten(), down[e].flatten()]) for e in at]) if at else \
            torch.empty(0, 36)
        assert torch.equal(flat_rows(gate_up, down, idx), want)
