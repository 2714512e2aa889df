"""The fuzz over random small configurations against the dense reference: one case, run 40 times
by the suite (tests/layer/test_reliability.py) and as long as asked by ``python -m tests.fuzz_long``;
and the layer of any system that the complete reference judges."""

from __future__ import annotations

import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.systems import SYSTEMS, spec_of
from tests.helpers.layer import close
from tests.oracles.dense_moe import reference_grads

ALL_SYSTEMS = SYSTEMS


def any_system_layer(cfg, system, group, ratio=1.0):
    """A layer of ``system`` with the arguments it needs; at ``ratio`` 1 every system keeps
    every pair (capacity: nothing overflows), so the complete reference applies."""
    kw, spec = {}, spec_of(system)
    if spec.selective:
        kw["backward"] = BackwardConfig(ratio=ratio)
    if spec.forward_drop:
        kw["capacity_factor"] = 100.0  # nothing overflows: the complete reference applies
    if system == "topoep":
        kw["budget"] = ClusterBudget(ranks_per_node=1)
    return MoELayer(cfg, system=system, group=group, **kw)


def fuzz_case(group, E, K, D, skew, system, shape3d, seed):
    world, rank = comm.world_size(group), comm.rank_of(group)
    cfg = MoEConfig(dim=D, ffn_dim=12 if system == "laer" else D, num_experts=E, top_k=K)  # laer: F % W == 0
    torch.manual_seed(seed)
    sd = MoELayer(cfg).state_dict()
    gen = torch.Generator().manual_seed(seed + 1)
    n = 6 * world
    x = torch.randn(n, D, generator=gen)
    g = torch.randn(n, D, generator=gen)
    if skew:
        u = torch.ones(D) / D**0.5
        x = x + skew * u
        sd["router.weight"][0] = 4.0 * u
    lo, hi = rank * 6, (rank + 1) * 6
    layer = any_system_layer(cfg, system, group)
    layer.load_full_state_dict(sd)
    xs = x[lo:hi].clone().requires_grad_(True)
    inp = xs.view(2, 3, D) if shape3d else xs
    layer(inp).reshape(-1, D).backward(g[lo:hi])
    ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg)
    close("dx", xs.grad, ref_dx[lo:hi])
    grads = layer.gather_full_grads()
    for name, want in ref_grads.items():
        close(name, grads[name], want)
    return True
