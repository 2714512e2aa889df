"""The sampled selections (``sampled``, ``local-sampled``; lrmoe.selection.sampling): the sample
keeps exactly the quota over any score range, a fixed-size backward keeps exactly q_e per expert
over all ranks (the local one with no exchange before the rows), its gradients equal the
reference's with exactly its kept pairs and weights 1/π, and the estimator is unbiased."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.memory.bytes import IN_PLACE_FROM
from lrmoe.parallel import comm
from lrmoe.selection.sampling import inclusion_probabilities, sample
from tests.helpers.layer import QWEN, Recorder, close, make_problem, split_tokens
from tests.oracles.dense_moe import reference_grads


def test_sample_keeps_exactly_the_quota_over_any_score_range():
    """Scores spanning 25 orders of magnitude (a real stratum's): the tail sums of the capped π
    lose their small terms in rounding; the π are put back to sum to q, so exactly q are kept."""
    scores = torch.tensor([0.85, 3.8e-05, 1.9e-14, 3.9e-10, 2.8e-3, 1.2e-07, 1.4e-08, 1.8e-19, 2.3e-08,
                           3.6e-18, 1.2e-08, 1.1e-19, 3.8e-05, 4.3e-25, 1.8e-11, 1.4e-10], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        big = torch.rand(1000, generator=gen, dtype=torch.float64) * 1e3 if trial % 2 else scores.new_zeros(0)
        s = torch.cat([big, scores[torch.randperm(16, generator=gen)]])
        groups = torch.cat([torch.zeros(len(big), dtype=torch.long), torch.ones(16, dtype=torch.long)])
        q = int(torch.randint(1, 17, (1,), generator=gen))
        keep, pi = sample(s, groups, torch.tensor([min(5, len(big)), q]), torch.rand(2, generator=gen,
                                                                                    dtype=torch.float64), 0.01)
        assert int(keep[groups == 1].sum()) == q, (trial, q)
        assert abs(float(pi[groups == 1].sum()) - q) < 1e-9 and bool(((pi >= 0) & (pi <= 1)).all())
    keep, pi = sample(scores, torch.zeros(16, dtype=torch.long), torch.tensor([16]), torch.tensor([0.6]), 0.01)
    assert bool(keep.all()) and bool((pi == 1).all()), "q = n keeps every pair, π = 1"


def sampled_case(group, selection, seed):
    """Kept set and the backward's exchanges of one fixed-size sampled backward."""
    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**QWEN)
        world, rank = comm.world_size(group), comm.rank_of(group)
        rec = Recorder(mp, rank)
        sd, x, g = make_problem(cfg, 64, 3, "none")
        lo, hi = rank * 64 // world, (rank + 1) * 64 // world
        layer = MoELayer(cfg, system="lrmoe", group=group,
                         backward=BackwardConfig(selection=selection, ratio=0.3, seed=seed))
        layer.load_full_state_dict(sd)
        out = layer(x[lo:hi])
        rec.take()
        out.backward(g[lo:hi])
        a2a, _ = rec.take()
        ids = layer.router(x[lo:hi]).ids_TK
        kept_local_E = torch.bincount(ids[layer.last_kept], minlength=cfg.num_experts)
        return kept_local_E, layer.last_stats["quota_E"], layer.last_stats["kept_E"], a2a
    finally:
        mp.undo()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("selection", ["sampled", "local-sampled"])
def test_fixed_size_sampling_keeps_exactly_the_quota(pool, world, selection):
    for seed in range(3):
        res = pool.run(world, sampled_case, selection, seed)
        quota = res[0][1]
        assert torch.equal(sum(r[0] for r in res), quota), "exactly q_e kept per expert, over all ranks"
        assert all(torch.equal(r[2], quota) for r in res), "kept_E reports it on every rank"
    if selection == "local-sampled" and world > 1:
        # nothing crosses ranks before the rows (no count, mask or score exchange): dy out with
        # each kept row's 4-byte position, dx back over the same rows
        row = QWEN["dim"] * 4
        for r in res:
            assert len(r[3]) == 2, r[3]
            (dy_sent, dy_recv), (dx_sent, dx_recv) = r[3]
            assert dy_sent * row == dx_recv * (row + 4) and dy_recv * row == dx_sent * (row + 4), r[3]


def weighted_case(group, selection, ratio):
    """A sampled backward's gradients equal the reference's with exactly its kept pairs and weights
    (its kept rows gathered at 0.3, compacted in place at 0.8)."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 5, "none")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(selection, ratio=ratio, seed=3))
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    layer(x_local).backward(g[lo:hi])
    assert layer.last_stats["compaction"] == ("in place" if ratio > IN_PLACE_FROM else "gathered")
    keep = comm.all_gather(layer.last_kept, sizes, group)
    scale = comm.all_gather(layer.last_scale, sizes, group)
    assert not bool(keep.all()) and bool((scale[keep] >= 1).all()) and bool((scale[~keep] == 0).all())
    _, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg, keep_TK=keep, scale_TK=scale)
    close("dx", x_local.grad, ref_dx[lo:hi])
    grads = layer.gather_full_grads()
    for name, want in ref_grads.items():
        close(f"grad {name}", grads[name], want)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("selection", ["sampled", "local-sampled"])
@pytest.mark.parametrize("ratio", [0.3, 0.8])
def test_weighted_gradients_equal_reference(pool, world, selection, ratio):
    pool.run(world, weighted_case, selection, ratio)


@pytest.mark.parametrize("selection", ["sampled", "local-sampled"])
def test_sampled_is_unbiased(selection):
    """Mean over seeds of every gradient approaches the full gradient, judged by the
    estimator's own variance: with z = (mean − full) / (standard error of the mean), an
    unbiased estimator gives E[z²] = 1 per element; a 10% bias gives far more."""
    cfg = MoEConfig(**{**QWEN, "num_experts": 4})
    sd, x, g = make_problem(cfg, 24, 9, "none")
    full = MoELayer(cfg, system="static")
    full.load_full_state_dict(sd)
    xf = x.clone().requires_grad_(True)
    full(xf).backward(g)
    want = {"x": xf.grad, **{k: p.grad for k, p in full.named_parameters()}}

    samples = {k: [] for k in want}
    n = 200
    for seed in range(n):
        layer = MoELayer(cfg, system="lrmoe", backward=BackwardConfig(selection, ratio=0.4, seed=seed,
                                                                      p_min=0.05))
        layer.load_full_state_dict(sd)
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(g)
        samples["x"].append(xi.grad)
        for k, p in layer.named_parameters():
            samples[k].append(p.grad)
        assert not bool(layer.last_kept.all())
    for k, ws in want.items():
        stack = torch.stack(samples[k]).double()
        mean, sem = stack.mean(0), stack.std(0) / n**0.5
        varies = sem > 1e-9
        assert bool(((mean - ws.double()).abs()[~varies] < 1e-5).all()), k
        if k == "router.weight":  # exact for every pair, never sampled
            assert not bool(varies.any())
            continue
        z2 = ((mean - ws.double())[varies] / sem[varies]).square().mean().item()
        assert z2 < 2.0, f"{k}: mean squared z {z2:.2f}, biased"
        biased = ((0.9 * mean - ws.double())[varies] / sem[varies]).square().mean().item()
        assert biased > 4.0, f"{k}: the test cannot see a 10% bias ({biased:.2f})"


def _oracle_pi(s: list[float], q: int, floor: float) -> list[float]:
    """One group's π by the definition, pair by pair (scores descending): the first m pairs
    capped at 1 while s_m·(q − m) ≥ Σ_{i ≥ m} s_i, the rest q − m in proportion to their scores,
    then mixed with the uniform q/n by λ = min(1, floor·n/q)."""
    n = len(s)
    if q == 0:
        return [0.0] * n
    if q >= n:
        return [1.0] * n
    m = 0
    while m < q and sum(s[m:]) > 0 and s[m] * (q - m) >= sum(s[m:]):
        m += 1
    rest = sum(s[m:])
    pi = [1.0] * m + [(q - m) * x / rest if rest > 0 else (q - m) / (n - m) for x in s[m:]]
    lam = min(1.0, floor * n / q)
    return [(1 - lam) * p + lam * q / n for p in pi]


@pytest.mark.parametrize("floor", [0.0, 0.01, 0.3])
def test_inclusion_probabilities_match_the_definition(floor):
    """π per pair against a per-group oracle, capped pairs, all-zero groups and whole groups
    included: Σπ = q and unbiasedness hold for any π, so they cannot tell a wrong π from a right one."""
    gen = torch.Generator().manual_seed(3)
    sizes = [7, 1, 0, 12, 5, 9, 3]
    quota = [3, 1, 0, 12, 0, 4, 2]
    groups = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    scores = torch.exp(3 * torch.randn(len(groups), generator=gen, dtype=torch.float64))
    scores[groups == 5] = 0.0  # no score to share by: uniform
    scores[0] = 1e3  # a pair capped at 1
    order, pi, _ = inclusion_probabilities(scores.numpy(), groups.numpy(), torch.tensor(quota).numpy(), floor)
    got = torch.zeros(len(groups), dtype=torch.float64)
    got[torch.from_numpy(order)] = torch.from_numpy(pi)
    for g, q in enumerate(quota):
        idx = (groups == g).nonzero().flatten()
        ranked = idx[torch.argsort(scores[idx], descending=True, stable=True)]
        want = _oracle_pi(scores[ranked].tolist(), q, floor)
        assert got[ranked].tolist() == pytest.approx(want, rel=1e-12, abs=1e-15), g
