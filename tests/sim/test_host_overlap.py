"""Host planning on the critical path (lrmoe.sim.cost.host_on_path): the backward's plan, which
the layer plans once the forward's exchanges and expert compute are issued, adds only what
outlasts that device work; what the forward waits for adds in full; a CPU adds everything."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lrmoe.sim.config import SimConfig, routing_counts
from lrmoe.sim.cost import a2a_seconds, layer_seconds
from lrmoe.sim.hardware import H200
from lrmoe.sim.layer_calls import SystemPlanner

CFG = SimConfig(model="qwen3-30b-a3b", gpus=16, memory_caps_gib=(60.0,), steps=2, layers=1, tokens_per_gpu=1024)


def _calls(system: str):
    spec, W = CFG.spec, CFG.gpus
    counts = routing_counts(CFG)[0]
    planner = SystemPlanner(system, spec.moe_config(), W, memory_bytes=40 * 2**30, selection="local-sampled")
    return [planner.call(counts[t % counts.shape[0], 0], 2) for t in range(3)]


def _window(call) -> float:
    """The forward's device work after its plan: its exchanges but the count all-gather, and its compute."""
    spec, W = CFG.spec, CFG.gpus
    t = layer_seconds(replace(call, host_s=0.0, deferred_host_s=0.0), spec, H200)
    return t["fwd_compute"] + t["fwd_a2a"] - a2a_seconds(np.full((W, W), spec.num_experts * 8), H200)


def test_the_backward_plan_is_counted_apart_from_what_the_forward_waits_for():
    lrmoe, symi = _calls("lrmoe")[-1], _calls("symi")[-1]
    # (no quota solve: under an ample budget the forward's assignment keeps every pair, Controller.quotas)
    assert lrmoe.deferred_planner_calls == {"strata": 1}, lrmoe.deferred_planner_calls
    assert lrmoe.planner_calls["strata"] == 1 and "max_min_quotas" not in lrmoe.planner_calls
    assert lrmoe.deferred_host_s > 0
    assert symi.deferred_host_s == 0 and symi.deferred_planner_calls == {}
    t = layer_seconds(lrmoe, CFG.spec, H200)
    assert t["host_total"] == pytest.approx(lrmoe.host_s + lrmoe.deferred_host_s)


def test_deferred_planning_adds_only_what_outlasts_the_forwards_device_work():
    call = _calls("lrmoe")[-1]
    window = _window(call)
    assert window > 0
    short = replace(call, host_s=2e-3, deferred_host_s=0.5 * window)
    assert layer_seconds(short, CFG.spec, H200)["host"] == pytest.approx(2e-3), "hidden: the forward part alone"
    long = replace(call, host_s=2e-3, deferred_host_s=window + 3e-3)
    assert layer_seconds(long, CFG.spec, H200)["host"] == pytest.approx(5e-3), "the excess over the window"
    cpu = replace(H200, host_overlaps=False)  # the same cores plan and compute
    t = layer_seconds(short, CFG.spec, cpu)
    assert t["host"] == pytest.approx(2e-3 + 0.5 * window) == t["host_total"]
    base = layer_seconds(replace(call, host_s=0.0, deferred_host_s=0.0), CFG.spec, H200)
    assert layer_seconds(long, CFG.spec, H200)["total"] == pytest.approx(base["total"] + 5e-3)
