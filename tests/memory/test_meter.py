"""peak_expert_side_bytes against the allocator (the torch profiler's memory timeline on CPU).

The layer's figure counts the expert side only; the allocator sees everything the call
allocates. So the check is two-sided: the layer never claims more than was allocated, and
what the allocator saw beyond it is bounded by the home side (``home_bytes``) plus a few
(T, D) buffers (the router's work, dx, the upstream gradient's gathers). A meter that forgot
the activations, the received rows or the recompute would fall outside the bounds.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lrmoe import BackwardConfig, MoEConfig, MoELayer


def allocator_peak(fn) -> int:
    """Peak bytes allocated during ``fn`` above what existed before: the CPU allocator's memory
    events in time order (allocations positive, frees negative; the profiler drops frees of
    blocks allocated before it started). Read from the raw events rather than the profiler's
    memory timeline, whose graph analysis fails on some op sequences in a long-lived worker."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize(
    "system,backward",
    [("static", None), ("static-recompute", None), ("lrmoe", BackwardConfig("lrm", ratio=0.25)),
     ("masked", BackwardConfig("lrm", ratio=0.25)),
     ("lrmoe", BackwardConfig("local-sampled", ratio=0.9))],  # kept rows compacted in place
)
def test_peak_matches_allocator(system, backward):
    torch.manual_seed(0)
    cfg = MoEConfig(dim=64, ffn_dim=128, num_experts=8, top_k=2)
    layer = MoELayer(cfg, system=system, backward=backward)
    T = 2048
    x, g = torch.randn(T, cfg.dim), torch.randn(T, cfg.dim)
    layer(x.clone().requires_grad_(True)).backward(g)  # gradient buffers exist, as in training
    layer.zero_grad(set_to_none=False)
    xi = x.clone().requires_grad_(True)
    seen = allocator_peak(lambda: layer(xi).backward(g))
    s = layer.last_stats
    param_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    transient = s["peak_expert_side_bytes"] - 2 * param_bytes  # parameters and grads pre-exist
    slack = s["home_bytes"] + 4 * T * cfg.dim * 4
    assert transient <= seen, f"the layer claims {transient} B, the allocator saw {seen} B"
    assert seen - transient <= slack, f"{seen - transient} B unaccounted for, over {slack} B of home side"



def replica_case(group) -> dict:
    """symi at 2 ranks with one hot expert, so ranks hold replicas: the meter's forward peak and
    the allocator's peak over one training call's forward, with what existed before it."""
    from lrmoe.parallel import comm
    from tests.helpers.layer import skewed_tokens

    cfg = MoEConfig(dim=32, ffn_dim=1024, num_experts=8, top_k=2)  # the weights dominate the rows
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = skewed_tokens(cfg, 512, 3, "hot")
    layer = MoELayer(cfg, system="symi", group=group)
    layer.load_full_state_dict(sd)
    lo, hi = rank * len(x) // world, (rank + 1) * len(x) // world
    for _ in range(2):  # the load observed, replicas placed and fetched, gradient buffers exist
        layer(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
        layer.step_end()
    xi = x[lo:hi].clone().requires_grad_(True)
    out = []
    seen = allocator_peak(lambda: out.append(layer(xi)))
    peak = layer.last_stats["peak_expert_side_bytes"]  # the forward's, before the backward runs
    out[0].backward(g[lo:hi])
    owned = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    replicas = sum(b.numel() * b.element_size() for b in (layer.replicas.gate_up_proj, layer.replicas.down_proj))
    return {"peak": peak, "home": layer.last_stats["home_bytes"], "seen": seen, "owned": owned,
            "replicas": replicas, "tokens": hi - lo, "dim": cfg.dim}


def test_forward_with_replicas_matches_allocator(pool):
    """With replicas the owned and the replica weights are read in place, as two sets: the
    meter counts every copy once (its parameters and gradient buffer), and the allocator sees
    no copy of any weight during the forward, only its rows and activations (a concatenation of
    the slot weights, or a meter charging one, would fall outside the bounds)."""
    results = pool.run(2, replica_case)
    assert any(res["replicas"] for res in results), "the hot expert is replicated"
    for r, res in enumerate(results):
        transient = res["peak"] - 2 * (res["owned"] + res["replicas"])  # every copy and its gradient buffer
        assert 0 < transient <= res["seen"], (r, res)
        # beyond the meter: the home side and the exchanges' buffers (gloo's threads allocate
        # some too, so this varies by a few rows), far less than one concatenation of the weights
        assert res["seen"] - transient < res["owned"] // 2, (r, res["seen"] - transient, res)
