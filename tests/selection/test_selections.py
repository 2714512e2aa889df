"""The selections (lrmoe.selection) through the layer and on their own: random and
local keep exactly q_e (local: each rank its largest-remainder share), the largest-remainder
split and the quota's rounding, bad backward configs, non-finite scores kept and reported (and
kept first within a local selection's shares), squared norms that never overflow."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.selection import fixed_ratio_quota, largest_remainder, scaled_squared_norms, squared_norms
from tests.helpers.layer import QWEN, make_problem


def selection_case(group, selection, seed):
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 64, 3, "none")
    lo, hi = rank * 64 // world, (rank + 1) * 64 // world
    layer = MoELayer(cfg, system="lrmoe", group=group,
                     backward=BackwardConfig(selection=selection, ratio=0.3, seed=seed))
    layer.load_full_state_dict(sd)
    layer(x[lo:hi]).backward(g[lo:hi])
    ids = layer.router(x[lo:hi]).ids_TK
    kept_local_E = torch.bincount(ids[layer.last_kept], minlength=cfg.num_experts)
    return layer.last_kept, kept_local_E, layer.last_stats["quota_E"], layer.last_stats["kept_E"], ids


@pytest.mark.parametrize("world", [1, 2, 4])
def test_random_and_local_selection(pool, world):
    a = pool.run(world, selection_case, "random", 1)
    b = pool.run(world, selection_case, "random", 1)
    c = pool.run(world, selection_case, "random", 2)
    for r in range(world):
        assert torch.equal(a[r][0], b[r][0]), "same seed, same kept set"
    assert any(not torch.equal(a[r][0], c[r][0]) for r in range(world)), "seed changes the set"
    assert torch.equal(a[0][3], a[0][2]), "random keeps exactly q_e"
    assert torch.equal(sum(r[1] for r in a), a[0][2])

    loc = pool.run(world, selection_case, "local", 0)
    quota = loc[0][2]
    counts_SE = torch.stack([torch.bincount(r[4].flatten(), minlength=8) for r in loc])
    share = largest_remainder(quota, counts_SE)
    for r in range(world):
        assert torch.equal(loc[r][1], share[r]), "each rank keeps its largest-remainder share"
    assert torch.equal(share.sum(0), quota)


def test_largest_remainder():
    counts = torch.tensor([[3, 0, 5], [3, 2, 5], [4, 0, 0]])
    total = torch.tensor([5, 1, 3])
    share = largest_remainder(total, counts)
    assert share.sum(0).tolist() == [5, 1, 3]
    assert (share <= counts).all()
    # expert 0: exact 1.5, 1.5, 2.0 → floors 1, 1, 2, the one left to the lower rank on a tie
    assert share[:, 0].tolist() == [2, 1, 2]


def test_largest_remainder_is_exact():
    """Floors, then one more for the largest remainders, ties to the lower rank, in exact
    fractions (float remainders once tied and untied by rounding)."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        W, E = int(rng.integers(1, 7)), int(rng.integers(1, 9))
        c = rng.integers(0, 9, size=(W, E))
        t = np.floor(rng.random(E) * (c.sum(0) + 1)).astype(np.int64)
        want = np.zeros((W, E), np.int64)
        for e in range(E):
            total, k = int(c[:, e].sum()), int(t[e])
            if total == 0:
                continue
            exact = [Fraction(k * int(c[s, e]), total) for s in range(W)]
            floors = [int(x) for x in exact]
            for s in sorted(range(W), key=lambda s: (floors[s] - exact[s], s))[: k - sum(floors)]:
                floors[s] += 1
            want[:, e] = floors
        assert (largest_remainder(torch.from_numpy(t), torch.from_numpy(c)).numpy() == want).all()


def test_quota_rounding():
    q = fixed_ratio_quota(torch.tensor([30, 0, 1, 7, 10]), 0.1)
    assert q.tolist() == [3, 0, 1, 1, 1]
    assert fixed_ratio_quota(torch.tensor([5]), 1.0).tolist() == [5]


def test_bad_backward_config():
    for kwargs in ({"ratio": 0}, {"ratio": 1.5}, {"ratio": -0.1}, {"selection": "topk"},
                   {"p_min": 0}, {"seed": 1.5}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            BackwardConfig(**kwargs)
    with pytest.raises(ValueError, match="system='lrm'"):
        MoELayer(MoEConfig(**QWEN), system="lrm")
    with pytest.raises(TypeError):
        MoELayer(MoEConfig(**QWEN), system="lrmoe", backward={"ratio": 0.5})


# ------------------------------------------------------------------- non-finite values


def nonfinite_backward(selection: str):
    """A backward at ratio 0.1 whose first six tokens (twelve pairs) have an infinite score.
    Returns (layer, x's gradient, routed ids, pairs per expert, non-finite pairs per expert)."""
    cfg = MoEConfig(**QWEN)
    sd, x, g = make_problem(cfg, 24, 5, "none")
    layer = MoELayer(cfg, system="lrmoe", backward=BackwardConfig(selection, ratio=0.1))
    layer.load_full_state_dict(sd)
    g_bad = g.clone()
    g_bad[:6, 0] = float("inf")
    xi = x.clone().requires_grad_(True)
    layer(xi).backward(g_bad)
    ids = layer.router(x).ids_TK
    counts, nf = torch.bincount(ids.flatten(), minlength=8), torch.bincount(ids[:6].flatten(), minlength=8)
    return layer, xi.grad, ids, counts, nf


@pytest.mark.parametrize("selection", ["lrm", "sampled"])
def test_nonfinite_scores_are_kept_and_reported(selection):
    layer, dx, ids, counts, nf = nonfinite_backward(selection)
    assert bool(layer.last_kept[:6].all()), "non-finite pairs must never be dropped"
    assert layer.last_stats["nonfinite"] is True
    assert torch.equal(layer.last_stats["kept_E"], torch.maximum(fixed_ratio_quota(counts, 0.1), nf))
    assert not torch.isfinite(dx[:6]).all(), "the broken gradient stays visible"


@pytest.mark.parametrize("selection", ["local-sampled", "local"])
def test_local_selection_keeps_nonfinite_first_within_its_shares(selection):
    """A local selection keeps exactly its shares (no exchange can grow them): non-finite pairs
    first, ``nonfinite`` reported where they alone exceed a share, and the broken gradient
    still visible through the router gradient, exact for every pair."""
    layer, dx, ids, counts, nf = nonfinite_backward(selection)
    quota = fixed_ratio_quota(counts, 0.1)
    kept = layer.last_kept
    assert torch.equal(layer.last_stats["kept_E"], quota)
    assert torch.equal(torch.bincount(ids[kept], minlength=8), quota), "exactly q_e, non-finite or not"
    kept_nf = torch.bincount(ids[:6][kept[:6]], minlength=8)
    assert torch.equal(kept_nf, torch.minimum(nf, quota)), "non-finite pairs first"
    assert bool((nf > quota).any()) and layer.last_stats["nonfinite"] is True
    assert not torch.isfinite(dx[:6]).all(), "the broken gradient stays visible"
    assert not torch.isfinite(layer.router.weight.grad).all()


def test_huge_finite_values_do_not_overflow_scores():
    from lrmoe.selection import squared_norms

    x = torch.full((3, 64), 3e37)
    sq = squared_norms(x)
    assert torch.isfinite(sq).all()
    torch.testing.assert_close(sq, torch.full((3,), 64 * 9e74, dtype=torch.float64))


def test_scaled_squared_norms_match_and_never_overflow():
    x = torch.randn(50, 64, dtype=torch.float64)
    x[3] *= 1e30
    x[4] *= 1e-30
    x[5] = 0
    x[6, 0] = 3e38
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        want = xd.double().square().sum(-1)
        got = scaled_squared_norms(xd)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        if dtype == torch.float32:  # the CPU path (a bf16 pass rounds its result to bf16)
            torch.testing.assert_close(squared_norms(xd)[:4], want[:4], rtol=1e-6, atol=0)
    x[7, 1] = float("inf")
    assert not torch.isfinite(scaled_squared_norms(x.float())[7])


def given_nonfinite_case(group):
    """An exact global top-q (lrm) over scores with infinities (expert 0's alone above its quota),
    with the non-finite counts exchanged by the selection and given by the caller."""
    from lrmoe.parallel.comm import Channel, WireCounter
    from lrmoe.selection.global_selection import nonfinite_counts, select

    W, E, rank = comm.world_size(group), 8, comm.rank_of(group)
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, E, (200,), generator=gen)
    scores = torch.rand(200, generator=gen, dtype=torch.float64)
    scores[(ids == 0).nonzero()[:12, 0]] = float("inf")
    scores[(ids == 3).nonzero()[:1, 0]] = float("nan")
    channel = Channel(group, WireCounter())
    counts_SE = channel.all_gather(torch.bincount(ids, minlength=E).view(1, E), [1] * W)
    quota = fixed_ratio_quota(counts_SE.sum(0), 0.2)
    nf_SE = channel.all_gather(nonfinite_counts(torch.isfinite(scores), ids, E).view(1, E), [1] * W)
    sent = [channel.wire.sent]
    exchanged = select(scores, ids, counts_SE, quota, BackwardConfig("lrm"), channel)
    sent.append(channel.wire.sent)
    given = select(scores, ids, counts_SE, quota, BackwardConfig("lrm"), channel, nonfinite_SE=nf_SE)
    sent.append(channel.wire.sent)
    return exchanged, given, nf_SE, sent[1] - sent[0] - (sent[2] - sent[1])


def test_nonfinite_counts_the_caller_exchanged_select_alike(pool):
    """A forward drop's selection takes the non-finite counts its count exchange carried
    (lrmoe.passes.forward.plan): the same kept set, grown quota and report as exchanging them."""
    for exchanged, given, nf_SE, saved_bytes in pool.run(2, given_nonfinite_case):
        assert saved_bytes == 8 * 8, "given, the counts (8 int64) are not sent again"
        assert exchanged.nonfinite is True and given.nonfinite is True
        assert int(nf_SE[:, 0].sum()) == 24 and int(exchanged.quota_E[0]) == 24
        assert torch.equal(exchanged.keep_P, given.keep_P) and torch.equal(exchanged.quota_E, given.quota_E)
        assert torch.equal(exchanged.kept_SE, given.kept_SE)
