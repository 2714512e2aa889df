"""Demand-side balance (``BackwardConfig.balance``): no rank's backward keeps more than
(1 + balance) × the call's mean pairs a rank, the overload trimmed max–min fair, never below
``min_ratio`` of an expert's pairs; a layer under it keeps that and its gradients are the
reference's with its kept set."""

from __future__ import annotations

import math

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.planning.backward_plan import demand_balanced
from lrmoe.planning.placement import Placement
from tests.helpers.layer import QWEN, equals_kept_reference, make_problem, split_tokens
from tests.helpers.pool import RankPool


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=2)
    yield p
    p.close()


def _kept_per_rank(quota_E: torch.Tensor, placement: Placement) -> list[int]:
    return [int(quota_E[list(placement.slots[r])].sum()) for r in range(len(placement.slots))]


def test_the_overloaded_rank_is_trimmed_to_the_mean_max_min_fair():
    placement = Placement.static(8, 2)  # experts 0-3 on rank 0, 4-7 on rank 1
    counts = torch.tensor([400, 100, 50, 50, 100, 100, 100, 100])  # rank 0: 600, rank 1: 400, mean 500
    quota = demand_balanced(counts, placement, BackwardConfig(balance=0.0))
    assert _kept_per_rank(quota, placement) == [500, 400]
    ratios = quota[:4].double() / counts[:4]
    assert float(ratios.max() - ratios.min()) < 0.02, "every expert of the hot rank at one retention ratio"
    assert torch.equal(quota[4:], counts[4:]), "a rank under the mean keeps every pair"


def test_slack_and_the_floor():
    placement = Placement.static(8, 2)
    counts = torch.tensor([400, 100, 50, 50, 100, 100, 100, 100])
    assert torch.equal(demand_balanced(counts, placement, BackwardConfig(balance=0.2)), counts), "600 <= 1.2 x 500"
    floored = demand_balanced(counts, placement, BackwardConfig(balance=0.0, min_ratio=0.9))
    assert bool((floored >= torch.ceil(0.9 * counts - 1e-6)).all())
    assert _kept_per_rank(floored, placement)[0] > 500, "the floor outranks the balance"


def test_the_warm_steps_balance_by_warm_balance_alone():
    """Within ``trim_after`` the overload of the hottest experts is trimmed by ``warm_balance``
    (not ``balance``, which starts with the trimming); after them ``balance`` applies."""
    cfg = BackwardConfig(balance=0.2, warm_balance=0.0, trim_after=3, objective="time")
    assert cfg.at_step(2).balance == 0.0 and cfg.at_step(2).objective == "memory"
    assert cfg.at_step(3).balance == 0.2
    assert BackwardConfig(balance=0.2, trim_after=3).at_step(0).balance is None, "no warm balance by default"
    placement = Placement.static(8, 2)
    counts = torch.tensor([400, 100, 50, 50, 100, 100, 100, 100])
    assert _kept_per_rank(demand_balanced(counts, placement, cfg.at_step(0)), placement) == [500, 400]


@pytest.mark.parametrize("field,value", [("balance", -0.1), ("balance", True), ("warm_balance", -1.0),
                                         ("warm_balance", "0"), ("min_ratio", 0.0), ("min_ratio", 1.5)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        BackwardConfig(**{field: value})


def balanced_case(group):
    """A skewed call at 2 ranks with balance 0: every rank's kept pairs within the mean (or its
    experts' floors), the quotas the planner's, the gradients the reference's with the kept set."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 96, 4, "hot_expert")
    sizes = split_tokens(96, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(balance=0.0, min_ratio=0.25, seed=1))
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    layer(x_local).backward(g[lo:hi])
    s = layer.last_stats
    counts, quota = s["counts_E"], s["quota_E"]
    assert torch.equal(s["kept_E"], quota), "exactly the quotas kept"
    cap = math.ceil(float(counts.sum()) / world)
    floor = torch.ceil(0.25 * counts - 1e-6).long()
    for r in range(world):
        slots = list(layer.placement.slots[r])
        assert int(quota[slots].sum()) <= max(cap, int(floor[slots].sum())), (r, quota, counts)
    equals_kept_reference(layer, x_local.grad, x, g, sd, cfg, sizes, group)
    return int(counts.sum()), int(quota.sum())


def test_a_skewed_layer_keeps_the_balanced_load(pool):
    (pairs, kept), _ = pool.run(2, balanced_case)
    assert kept < pairs, "the hot rank's overload was trimmed"


def empty_rank_case(group):
    """Rank 1 routes no tokens: its strata keep all of its (no) pairs while rank 0 trims. Every
    rank must still take the same row path — the messages of a kept-in-strata backward carry
    positions, the forward's rows' do not — or the exchange fails (it did, 2026-12-02)."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 6, "none")
    sizes = split_tokens(48, world, 1)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(ratio=0.5, seed=2))
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    layer(x_local).backward(g[lo:hi])
    equals_kept_reference(layer, x_local.grad, x, g, sd, cfg, sizes, group)
    return int(layer.last_stats["quota_E"].sum()), int(layer.last_stats["counts_E"].sum())


def test_a_rank_that_keeps_all_its_pairs_exchanges_like_the_others(pool):
    (quota, pairs), _ = pool.run(2, empty_rank_case)
    assert quota < pairs
