"""Where a call's time went (``last_stats["stage_ms"]``, :mod:`lrmoe.passes.stages`): the stages
of each pass add up to that pass's own time, and the stages a system runs are the ones it has."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.passes.stages import STAGES

CFG = dict(dim=16, ffn_dim=24, num_experts=6, top_k=2)


def one_call(group, system: str, backward: BackwardConfig) -> tuple[MoELayer, dict[str, float]]:
    """One training call of a small layer on this rank's tokens; returns the layer (its stats
    the whole call's) and the forward's stage times."""
    from lrmoe.parallel import comm

    cfg = MoEConfig(**CFG)
    torch.manual_seed(0)
    sd = MoELayer(cfg).state_dict()
    layer = MoELayer(cfg, system=system, group=group, backward=backward)
    layer.load_full_state_dict(sd)
    torch.manual_seed(100 + comm.rank_of(group))
    out = layer(torch.randn(24, cfg.dim, requires_grad=True))
    fwd = dict(layer.last_stats["stage_ms"])
    out.backward(torch.randn_like(out))
    return layer, fwd


def stages_case(group, system: str, ratio: float):
    layer, fwd = one_call(group, system, BackwardConfig(ratio=ratio))
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


def meanwhile_case(group):
    """A channel's ``meanwhile`` work runs inside its next exchange, which still delivers the rows;
    work that raises lets the exchange finish (the next one lines up on every rank); what no
    exchange took runs at ``flush``."""
    from lrmoe.parallel import comm
    from lrmoe.parallel.comm import Channel, WireCounter

    rank, world = comm.rank_of(group), comm.world_size(group)
    channel = Channel(group, WireCounter())
    done = []
    channel.meanwhile.append(lambda: done.append("work"))
    send = torch.full((world, 3), float(rank))
    got = channel.all_to_all(send, [1] * world, [1] * world)
    assert done == ["work"] and got[:, 0].tolist() == [float(s) for s in range(world)]

    def fails() -> None:
        raise RuntimeError("work failed")

    channel.meanwhile.append(fails)
    with pytest.raises(RuntimeError, match="work failed"):
        channel.all_to_all(send, [1] * world, [1] * world)
    assert channel.meanwhile == []
    again = channel.all_to_all(send + 1, [1] * world, [1] * world)  # the failed exchange finished on every rank
    assert again[:, 0].tolist() == [s + 1.0 for s in range(world)]
    channel.meanwhile.append(lambda: done.append("flushed"))
    channel.flush()
    return done


def test_meanwhile_work_runs_inside_the_next_exchange(pool):
    assert pool.run(2, meanwhile_case) == [["work", "flushed"]] * 2


def test_work_set_aside_counts_for_its_own_stage():
    from lrmoe.passes.stages import StageClock

    clock = StageClock()
    clock.start()
    clock.aside("fwd_plan_backward", 0.5)  # half a second of planning inside the exchange below
    clock.lap("fwd_combine")
    assert clock.ms["fwd_plan_backward"] == 500.0
    assert -500.0 < clock.ms["fwd_combine"] < -499.0, "the exchange's lap leaves out the work done in it"


def noise_stages_case(group):
    layer, fwd = one_call(group, "lrmoe", BackwardConfig(objective="noise"))
    bwd = layer.last_stats["stage_ms"]
    return fwd["fwd_plan_backward"], bwd["bwd_select"], bwd["bwd_noise"], layer.planner.noise.pending()[0]


def test_deferred_planning_and_noise_measurement_keep_their_stages(pool):
    """The backward's plan (inside the combine's exchange) and the noise measurement (inside the
    backward's dispatch) are done in the call and counted in their own stages: the scoring and
    draw in ``bwd_select``, the measurement in ``bwd_noise``."""
    for plan_ms, select_ms, noise_ms, scores in pool.run(2, noise_stages_case):
        assert plan_ms > 0 and select_ms > 0 and noise_ms > 0
        assert scores > 0, "the call's scores reached the noise controller"
