"""The capacity system (a capacity factor): every expert keeps its ceil(C·P/E) most probable
pairs, and a dropped pair vanishes from both passes, router weight included, against the dense
reference with the same drops. lrmoe-capacity: the same forward, lrmoe's backward over the pairs
it computed (exactly capacity's gradients where it keeps them all; a trimmed one keeps its
quota of them and nothing the forward dropped)."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm
from tests.helpers.layer import close, skewed_tokens

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)


def capacity_case(group, factor, system="capacity", backward=None):
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 48, 7, "hot")
    lo, hi = rank * 48 // world, (rank + 1) * 48 // world
    layer = MoELayer(cfg, system=system, group=group, capacity_factor=factor, backward=backward)
    layer.load_full_state_dict(sd)
    xs = x[lo:hi].clone().requires_grad_(True)
    out = layer(xs)
    out.backward(g[lo:hi])
    # reference: every expert keeps its ceil(C·P/E) most probable pairs, dropped pairs vanish
    # from both passes (router weight included)
    with torch.no_grad():
        from tests.oracles.dense_moe import route

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
    from tests.oracles.dense_moe import expert_outputs, route

    w, ids = route(x, params, cfg)
    y, _ = expert_outputs(x, params)
    t = torch.arange(x.shape[0]).unsqueeze(1).expand_as(ids)
    return (w.unsqueeze(-1) * y[ids, t] * keep.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_capacity_factor_drops_in_both_passes(pool, world):
    kept = sum(pool.run(world, capacity_case, 1.0))
    assert kept < 48 * 2


def test_lrmoe_capacity_keeping_every_computed_pair_is_capacity(pool):
    """At ratio 1 lrmoe's backward keeps every pair the forward computed: capacity's drops, outputs
    and gradients, on 2 ranks."""
    kept = sum(pool.run(2, capacity_case, 1.0, "lrmoe-capacity", BackwardConfig("local-sampled", ratio=1.0)))
    assert kept < 48 * 2


def trimmed_case(group, factor, ratio):
    """(pairs the forward computed, pairs the backward kept, dropped pairs it kept) on this rank."""
    cfg = MoEConfig(**CFG)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 48, 7, "hot")
    lo, hi = rank * 48 // world, (rank + 1) * 48 // world
    capacity = MoELayer(cfg, system="capacity", group=group, capacity_factor=factor)
    layer = MoELayer(cfg, system="lrmoe-capacity", group=group, capacity_factor=factor,
                     backward=BackwardConfig("local-sampled", ratio=ratio))
    for m in (capacity, layer):
        m.load_full_state_dict(sd)
        m(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
    computed, kept = capacity.last_kept, layer.last_kept
    return int(computed.sum()), int(kept.sum()), int((kept & ~computed).sum()), layer.last_stats["bwd_a2a_bytes"], \
        capacity.last_stats["bwd_a2a_bytes"]


def test_lrmoe_capacity_trims_within_the_forward_drop(pool):
    """Trimmed to half, the backward keeps half of what capacity's forward computed (each expert's
    quota rounded), none of the pairs it dropped, and sends fewer dy bytes than capacity."""
    out = pool.run(2, trimmed_case, 1.0, 0.5)
    computed, kept = sum(o[0] for o in out), sum(o[1] for o in out)
    assert computed < 48 * 2
    assert abs(kept - computed / 2) <= CFG["num_experts"]
    assert all(o[2] == 0 for o in out)
    assert sum(o[3] for o in out) < sum(o[4] for o in out)


def test_lrmoe_capacity_refuses_a_global_selection():
    with pytest.raises(ValueError, match="local selection"):
        MoELayer(MoEConfig(**CFG), system="lrmoe-capacity", backward=BackwardConfig("sampled", ratio=0.5))


def test_a_factor_past_the_expert_count_keeps_every_pair():
    """``capacity@1e300`` overflowed the quota's conversion inside the ranks; a factor of E or
    more drops nothing, whatever its size."""
    from lrmoe.planning.planner import LayerPlanner
    from lrmoe.systems import spec_of

    counts_SE = torch.tensor([[30, 0, 2, 0, 0, 0, 0, 0], [10, 1, 0, 0, 0, 0, 0, 5]])
    for factor in (8.0, 1e300):
        planner = LayerPlanner(spec_of("capacity"), MoEConfig(**CFG), 2, capacity_factor=factor)
        assert torch.equal(planner.forward_quota(counts_SE), counts_SE.sum(0))
    planner = LayerPlanner(spec_of("capacity"), MoEConfig(**CFG), 2, capacity_factor=1.0)
    assert planner.forward_quota(counts_SE).tolist() == [6, 1, 2, 0, 0, 0, 0, 5]  # ⌈48 / 8⌉ = 6
