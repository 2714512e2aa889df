"""The noise objective (``BackwardConfig(objective="noise")``): the design variance of a sampled
draw is the sampler's own Σ (1/π − 1)·s; the controller keeps the fewest pairs whose variance
stays within τ × the minibatch gradient's squared norm, step to step; a layer under it keeps every pair at its first
step, then exactly the ratio its ranks agreed on, with the reference's gradients for its kept
set, and its state survives a checkpoint."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.planning.backward_plan import quotas
from lrmoe.planning.noise_control import NOISE_RATIOS, NoiseController
from lrmoe.planning.placement import Placement
from lrmoe.planning.quota_ratio import fixed_ratio_quota
from lrmoe.selection.noise import design_variances
from lrmoe.selection.sampling import inclusion_probabilities
from tests.helpers.layer import QWEN, equals_kept_reference, make_problem, split_tokens
from tests.helpers.pool import RankPool


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=2)
    yield p
    p.close()


def sampler_variance(scores: np.ndarray, groups: np.ndarray, quota: np.ndarray, power: float) -> float:
    """Σ (1/π − 1)·s with the sampler's own π (no floor)."""
    key = scores**power
    order, pi, _ = inclusion_probabilities(key, groups, quota, 0.0)
    s = scores[order]
    return float(np.sum(np.where(pi > 0, (1 / np.where(pi > 0, pi, 1) - 1) * s, 0.0)))


@pytest.mark.parametrize("power", [0.5, 1.0, 0.0])
def test_design_variance_is_the_samplers(power):
    rng = np.random.default_rng(int(power * 10))
    sizes = np.array([9, 1, 30, 4, 0, 17])
    groups = np.repeat(np.arange(len(sizes)), sizes)
    scores = rng.lognormal(0, 2.5, sizes.sum())
    scores[3] = 0.0  # a zero score: π by what is left, never a division by zero
    quotas = np.stack([np.minimum(sizes, q) for q in (1, 3, 8)] + [sizes, (sizes + 1) // 2])
    got = design_variances(torch.from_numpy(scores), torch.from_numpy(groups), torch.from_numpy(quotas), power)
    want = [sampler_variance(scores, groups, q, power) for q in quotas]
    assert got.tolist() == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert got[3] == pytest.approx(0.0, abs=1e-9), "every pair kept: no sampling noise"


def test_design_variance_falls_as_more_pairs_are_kept():
    rng = np.random.default_rng(1)
    sizes = np.array([40, 25])
    groups = torch.from_numpy(np.repeat(np.arange(2), sizes))
    scores = torch.from_numpy(rng.lognormal(0, 1.5, sizes.sum()))
    v = design_variances(scores, groups, fixed_ratio_quota(torch.from_numpy(sizes), list(NOISE_RATIOS)), 0.5)
    assert bool((v[1:] >= v[:-1] - 1e-9).all()), "the grid runs from 1 down: variances rise along it"


def equal_scores(controller: NoiseController, n: int, grad: float) -> None:
    """One call of ``n`` pairs of score 1 in one stratum, ``n`` tokens, drawn at the controller's
    ratio, whose sampled gradient has the squared norm ``grad``."""
    sizes = torch.tensor([n])
    share = fixed_ratio_quota(sizes, controller.ratio)
    controller.add_pairs(torch.ones(n, dtype=torch.float64), torch.zeros(n, dtype=torch.long), sizes, share, n, 0.5)
    controller.add_gradient(torch.full((1,), grad**0.5))


@pytest.mark.parametrize("tau,ratio", [(1.0, 0.5), (0.25, 0.8), (0.01, 1.0), (100.0, 0.05)])
def test_the_least_ratio_within_the_threshold(tau, ratio):
    """20 equal scores: V(ρ) = 20·(20/q − 1) against E‖G_mb‖² = 20, so q ≥ 20/(1 + τ)."""
    c = NoiseController(tau)
    equal_scores(c, 20, grad=20.0)
    c.update(c.pending())
    assert c.ratio == ratio
    assert c.variance_ratio == 0.0 and c.minibatch_ratio == 0.0, "the step measured kept every pair"


def test_a_smaller_gradient_keeps_more():
    """Half the gradient's squared norm (10) asks q ≥ 13.3 at τ = 1 (ρ = 0.7, not 0.5); none at
    all keeps every pair."""
    c = NoiseController(1.0)
    equal_scores(c, 20, grad=10.0)
    c.update(c.pending())
    assert c.ratio == 0.7
    c.ratio = 1.0
    equal_scores(c, 20, grad=0.0)
    c.update(c.pending())
    assert c.ratio == 1.0


def test_drawn_noise_is_taken_off_the_sampled_gradient_and_reported():
    """A step drawn at ρ = 0.5 adds V = 20 to E‖Ĝ‖²: a sampled ‖Ĝ‖² of 40 is a minibatch gradient
    of 20; VCAS's V_mb is Σ s − 20 / N = 19."""
    c = NoiseController(1.0)
    c.ratio = 0.5
    equal_scores(c, 20, grad=40.0)
    c.update(c.pending())
    assert c.variance_ratio == pytest.approx(1.0)
    assert c.minibatch_ratio == pytest.approx(20 / 19)
    assert c.ratio == 0.5


def test_a_step_without_a_backward_changes_nothing_and_a_checkpoint_keeps_what_is_pending():
    c = NoiseController(0.5)
    c.ratio, c.variance_ratio, c.minibatch_ratio = 0.6, 0.04, 0.1
    c.update(c.pending())
    assert c.state()[:3] == (0.6, 0.04, 0.1) and not any(c.state()[3:])
    equal_scores(c, 20, grad=20.0)  # a backward whose sums the next forward has not taken yet
    restored = NoiseController(0.5)
    restored.load_state(c.state())
    assert restored.state() == c.state()
    c.update(c.pending())
    restored.update(restored.pending())
    assert restored.state() == c.state() and c.ratio != 0.6


@pytest.mark.parametrize("balance,trimmed", [(None, False), (0.0, True)])
def test_quotas_say_when_a_budget_kept_fewer_pairs_than_the_ratio(balance, trimmed):
    """The noise ratio caps the quotas; a demand-side balance (like memory) that keeps fewer is reported."""
    noise = NoiseController(0.1)
    noise.ratio = 0.8
    planner = SimpleNamespace(noise=noise, controller=None)
    counts_E = torch.tensor([100, 1, 1, 1])
    quota_E, got = quotas(planner, BackwardConfig(objective="noise", balance=balance), counts_E,
                          Placement.static(4, 2), None)
    assert got is trimmed
    assert torch.equal(quota_E, fixed_ratio_quota(counts_E, 0.8)) is not trimmed


@pytest.mark.parametrize("fields", [dict(noise_threshold=0.0),
                                    dict(noise_threshold=True),
                                    dict(objective="noise", trim_after=40)])
def test_bad_settings_are_refused(fields):
    with pytest.raises(ValueError, match="objective|noise_threshold"):
        BackwardConfig(**fields)


def noise_case(group, selection: str):
    """Step 1 keeps every pair; the ranks' step_end agree on one ratio below 1; step 2 keeps
    exactly that ratio's quotas, with the reference's gradients for its kept set; the layer's
    train state carries the ratio."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 96, 5, "hot_expert")
    sizes = split_tokens(96, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    backward = BackwardConfig(selection=selection, objective="noise", noise_threshold=2.0, seed=3)
    layer = MoELayer(cfg, system="lrmoe", group=group, backward=backward)
    layer.load_full_state_dict(sd)
    figures = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        x_local = x[lo:hi].clone().requires_grad_(True)
        layer(x_local).backward(g[lo:hi])
        s = layer.last_stats
        assert torch.equal(s["quota_E"], fixed_ratio_quota(s["counts_E"], s["trim_ratio"]))
        assert torch.equal(s["kept_E"], s["quota_E"]) and s["memory_trimmed"] is False
        figures.append((s["trim_ratio"], s.get("variance_ratio")))  # none before a backward measured it
        layer.step_end()
    equals_kept_reference(layer, x_local.grad, x, g, sd, cfg, sizes, group)
    assert layer.train_state()["noise"][:3] == layer.planner.noise.state()[:3]
    return figures


@pytest.mark.parametrize("selection", ["local-sampled", "sampled"])
def test_a_layer_trims_from_its_second_step_on_one_ratio(pool, selection):
    """A global selection (an ablation) is priced as a local-sampled draw would be: the same rule."""
    (first, second), other = pool.run(2, noise_case, selection)
    assert first == (1.0, None), "nothing measured before the first step: every pair kept"
    assert second[0] < 1.0 and second[1] == 0.0
    assert other == [first, second], "every rank set the same ratio"


def capacity_noise_case(group):
    """lrmoe over capacity's forward under the noise objective, two steps: (trim ratio, measured
    variance ratio) of each (its count exchange carries the drop's non-finite counts too)."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 96, 5, "hot_expert")
    sizes = split_tokens(96, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    backward = BackwardConfig(objective="noise", noise_threshold=2.0, seed=3)
    layer = MoELayer(cfg, system="lrmoe-capacity", group=group, capacity_factor=1.0, backward=backward)
    layer.load_full_state_dict(sd)
    figures = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        layer(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
        figures.append((layer.last_stats["trim_ratio"], layer.last_stats.get("variance_ratio")))
        layer.step_end()
    return figures


def test_a_forward_drop_trims_on_the_ratio_its_count_exchange_carried(pool):
    (first, second), other = pool.run(2, capacity_noise_case)
    assert first == (1.0, None) and second[0] < 1.0 and second[1] == 0.0
    assert other == [first, second], "every rank set the same ratio"
