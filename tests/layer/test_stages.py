"""Where a call's time went (``last_stats["stage_ms"]``, :mod:`lrmoe.passes.stages`): the stages
of each pass add up to that pass's own time, and the stages a system runs are the ones it has."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.passes.stages import STAGES

CFG = dict(dim=16, ffn_dim=24, num_experts=6, top_k=2)


def stages_case(group, system: str, ratio: float):
    from lrmoe.parallel import comm

    rank = comm.rank_of(group)
    cfg = MoEConfig(**CFG)
    torch.manual_seed(0)
    sd = MoELayer(cfg).state_dict()
    layer = MoELayer(cfg, system=system, group=group, backward=BackwardConfig(ratio=ratio))
    layer.load_full_state_dict(sd)
    torch.manual_seed(100 + rank)
    x = torch.randn(24, cfg.dim, requires_grad=True)
    out = layer(x)
    fwd = dict(layer.last_stats["stage_ms"])
    out.backward(torch.randn_like(out))
    s = layer.last_stats
    both = s["stage_ms"]
    assert set(both) <= set(STAGES) and all(v >= 0 for v in both.values())
    assert {k: both[k] for k in fwd} == fwd, "the backward adds its stages to the forward's"
    for pass_, total in (("fwd_", s["fwd_ms"]), ("bwd_", s["bwd_ms"])):
        staged = sum(v for k, v in both.items() if k.startswith(pass_))
        assert 0.8 * total <= staged <= total, (pass_, staged, total)
    return sorted(both)


@pytest.mark.parametrize(("system", "ratio", "compacts"), [("static", 1.0, False), ("lrmoe", 0.5, True)])
def test_stages_add_up_to_each_pass(pool, system, ratio, compacts):
    names = pool.run(2, stages_case, system, ratio)[0]
    assert {"fwd_plan", "fwd_dispatch", "fwd_compute", "fwd_combine", "bwd_select", "bwd_compute",
            "bwd_home"} <= set(names)
    assert ("bwd_compact" in names) == compacts
