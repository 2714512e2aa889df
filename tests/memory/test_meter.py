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
    """Peak bytes allocated during ``fn`` above what existed before (CPU allocator timeline)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    now = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action.name == "CREATE":
            now += size
        elif action.name == "DESTROY":
            now -= size
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize(
    "system,backward",
    [("static", None), ("static-recompute", None), ("lrmoe", BackwardConfig("lrm", ratio=0.25)),
     ("masked", BackwardConfig("lrm", ratio=0.25))],
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
