"""The backward's part of a call's plan, planned after the forward's (lrmoe.planning.backward_plan),
is the plan a single planning pass gave before the split, bit for bit: quotas, kept capacities,
keep mode, figures, a local selection's strata and the kept pairs' assignment, for every kind of
backward, capped and not, over calls whose placements change step by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.memory.bytes import KEEP_NOTHING
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import spec_of
from tests.oracles.single_pass_plan import single_pass

CFG = MoEConfig(dim=16, ffn_dim=24, num_experts=8, top_k=2)
WORLD = 4


def split(planner: LayerPlanner, counts_SE: torch.Tensor) -> dict:
    """The same call planned as the layer plans it now: the forward's plan, then the backward's."""
    forward = planner.plan_forward(counts_SE)
    assert forward.quota_E is None and forward.strata is None and not forward.backward_planned
    plan = forward.with_backward(planner.plan_backward(forward), planner.spec)
    return {"placement": plan.placement.slots, "assignment": plan.assignment.rows_HS, "chunks": plan.chunk_rows_R,
            "kept_capacity_R": plan.kept_capacity_R, "quota_E": plan.quota_E, "keep": plan.keep,
            "figures": plan.figures, "fetch": plan.fetch, "rounds": plan.rounds_R, "strata": plan.strata,
            "kept": plan.kept_assignment}


def _same(a, b, what: str) -> None:
    if isinstance(a, (torch.Tensor, np.ndarray)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), what
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), what
        for name in a.__dataclass_fields__:
            _same(getattr(a, name), getattr(b, name), f"{what}.{name}")
    else:
        assert a == b, (what, a, b)


CASES = [  # system, selection, memory cap (bytes a rank, None: uncapped), fixed slots, network bytes
    ("lrmoe", "local-sampled", None, None, None),
    ("lrmoe", "local", 90_000, 5, None),  # x and x+acts
    ("lrmoe", "local-sampled", 70_000, None, 2000),  # nothing (re-spread), x and x+acts
    ("lrmoe", "lrm", 70_000, None, 2000),
    ("masked", "local-sampled", None, None, None),
    ("symi", "lrm", 30_000, None, None),  # nothing (in rounds) and x
    ("static", "lrm", 60_000, None, None),
]


@pytest.mark.parametrize("system,selection,cap,slots,network", CASES)
def test_split_plan_equals_the_single_pass(system, selection, cap, slots, network):
    budget = None if cap is None else ClusterBudget(memory_bytes=cap, slots=slots, network_bytes=network)
    make = lambda: LayerPlanner(spec_of(system), CFG, WORLD, rank=1, budget=budget,  # noqa: E731
                                backward=BackwardConfig(selection, ratio=0.6))
    old, new = make(), make()
    gen = np.random.default_rng(0)
    keeps = set()
    for step in range(12):
        skew = gen.dirichlet(np.full(CFG.num_experts, 0.7))  # a load that moves: replicas re-planned
        counts_SE = torch.from_numpy(gen.multinomial(24 * CFG.top_k, skew, size=WORLD).astype(np.int64))
        want, got = single_pass(old, counts_SE), split(new, counts_SE)
        for key in want:
            _same(want[key], got[key], f"step {step} {key}")
        keeps.add(got["keep"])
        assert old.step_end() == new.step_end()
    if network is not None:
        assert KEEP_NOTHING in keeps, "the re-spread kept assignment was exercised"


def test_plan_call_is_both_parts_and_a_forward_only_call_has_none():
    planner = LayerPlanner(spec_of("lrmoe"), CFG, WORLD, backward=BackwardConfig("local-sampled", ratio=0.5))
    counts_SE = torch.full((WORLD, CFG.num_experts), 3, dtype=torch.int64)
    plan = planner.plan_call(counts_SE)
    assert plan.backward_planned and int(plan.quota_E.sum()) < int(counts_SE.sum()) and plan.strata is not None
    assert plan.figures.keep_mode == plan.keep
    evaluation = planner.plan_call(counts_SE, training=False)
    assert evaluation.quota_E is None and evaluation.strata is None and evaluation.figures.keep_mode is None
