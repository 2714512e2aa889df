"""The LRMoE backward against an independent reference: the kept set is the global per-expert
top-q_e of w²·‖g‖²·‖h‖², exactly the kept pairs contribute, counters match the wire."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.selection.selections import fixed_ratio_quota, largest_remainder
from tests.reference import dense_moe, reference_grads
from tests.test_counters import Recorder
from tests.test_layer import GLM, QWEN, close, make_problem, split_tokens


def reference_keep(x, g, sd, cfg, ratio: float, margin: float = 1e-3):
    """Global per-expert top-q_e of the dense reference's LRM scores, and whether every quota
    boundary has a relative score gap of at least ``margin`` (so rounding cannot flip it)."""
    with torch.no_grad():
        params = {k: v for k, v in sd.items()}
        _, ids, h_TKF = dense_moe(x, params, cfg)
        from tests.reference import route

        w, _ = route(x, params, cfg)
    score = (w.double() ** 2) * (g.double() ** 2).sum(-1, keepdim=True) * (h_TKF.double() ** 2).sum(-1)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts)
    quota = fixed_ratio_quota(counts, ratio)
    clear = True
    for e in range(cfg.num_experts):
        sel = (ids == e).nonzero()
        if not len(sel):
            continue
        s = score[sel[:, 0], sel[:, 1]]
        order = torch.argsort(s, descending=True)
        q = int(quota[e])
        keep[sel[order[:q], 0], sel[order[:q], 1]] = True
        if 0 < q < len(s):
            hi, lo = s[order[q - 1]], s[order[q]]
            clear &= bool((hi - lo) > margin * hi)
    return keep, quota, clear


def clear_problem(cfg, n_tokens, ratio, seed=0):
    """Draw problems until every quota boundary has a clear score margin."""
    for s in range(seed, seed + 50):
        sd, x, g = make_problem(cfg, n_tokens, s, "none")
        keep, quota, clear = reference_keep(x, g, sd, cfg, ratio)
        if clear:
            return sd, x, g, keep, quota
    raise AssertionError("no problem with clear quota margins found")


def lrmoe_case(group, cfg_kwargs, n_tokens, ratio, system, shape3d=False, empty_rank=None):
    cfg = MoEConfig(**cfg_kwargs)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g, keep, quota = clear_problem(cfg, n_tokens, ratio)
    sizes = split_tokens(n_tokens, world, empty_rank)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system=system, group=group, backward=BackwardConfig("lrm", ratio=ratio))
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    inp = x_local.view(1, -1, cfg.dim) if shape3d else x_local
    out = layer(inp)
    out.reshape(-1, cfg.dim).backward(g[lo:hi])
    assert torch.equal(layer.last_kept, keep[lo:hi]), "kept set differs from the global top-q_e"
    assert torch.equal(layer.last_stats["quota_E"], quota)
    assert torch.equal(layer.last_stats["kept_E"], quota)
    ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg, keep_TK=keep)
    close("out", out.reshape(-1, cfg.dim).detach(), ref_out[lo:hi])
    close("dx", x_local.grad, ref_dx[lo:hi])
    grads = layer.gather_full_grads()
    for name, want in ref_grads.items():
        close(f"grad {name}", grads[name], want)
    return int(layer.last_kept.sum())


def ratio_one_case(group, cfg_kwargs, system):
    """ratio = 1 must reproduce the static system's gradients."""
    cfg = MoEConfig(**cfg_kwargs)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 36, 4, "none")
    lo, hi = rank * 36 // world, (rank + 1) * 36 // world
    grads = {}
    for name, kwargs in (("static", {}), (system, {"backward": BackwardConfig(ratio=1.0)})):
        layer = MoELayer(cfg, system=name, group=group, **kwargs)
        layer.load_full_state_dict(sd)
        xi = x[lo:hi].clone().requires_grad_(True)
        layer(xi).backward(g[lo:hi])
        grads[name] = {"x": xi.grad, **layer.gather_full_grads()}
        if name != "static":
            assert bool(layer.last_kept.all())
    for key, want in grads["static"].items():
        close(key, grads[system][key], want, atol=1e-6)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("system", ["lrmoe", "masked"])
def test_ratio_one_equals_static(pool, world, system):
    pool.run(world, ratio_one_case, QWEN, system)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("cfg", [QWEN, GLM], ids=["softmax", "sigmoid"])
@pytest.mark.parametrize("shape3d", [False, True], ids=["TD", "BSD"])
def test_kept_set_and_gradients(pool, world, cfg, shape3d):
    kept = pool.run(world, lrmoe_case, cfg, 48, 0.3, "lrmoe", shape3d)
    assert sum(kept) < 48 * cfg["top_k"]


@pytest.mark.parametrize("world", [2, 4])
def test_masked_and_empty_rank(pool, world):
    pool.run(world, lrmoe_case, QWEN, 40, 0.25, "masked")
    pool.run(world, lrmoe_case, {**QWEN, "num_experts": 5}, 40, 0.4, "lrmoe", False, 1)


# ------------------------------------------------------------------- counters


def lrmoe_counter_case(group, ratio):
    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**QWEN)
        world, rank = comm.world_size(group), comm.rank_of(group)
        rec = Recorder(mp, rank)
        sd, x, g = make_problem(cfg, 40, 7, "none")
        lo, hi = rank * 40 // world, (rank + 1) * 40 // world
        layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig("lrm", ratio=ratio))
        layer.load_full_state_dict(sd)
        out = layer(x[lo:hi].clone().requires_grad_(True))
        rec.take()
        out.backward(g[lo:hi])
        a2a, rows = rec.take()
        s = layer.last_stats
        assert s["bwd_a2a_bytes"] == sum(a for a, _ in a2a)
        assert s["bwd_a2a_recv_bytes"] == sum(r for _, r in a2a)
        # The expert GEMMs saw exactly the kept rows this rank computed, and nothing else.
        assert all(r == s["bwd_gemm_rows"] for _, r in rows)
        # without a cap the expert side keeps x and activations: nothing recomputed, no x re-sent
        assert s["keep_mode"] == "x+acts"
        assert len(rows) == 3 + 3  # dh, dx gate, dx up; three wgrads
        # Independent byte count: non-finite counts and candidate scores to every peer, one
        # kept-or-not byte per forward row sent away, the kept dy rows to remote experts, the dx
        # rows of remote kept rows back.
        ids = layer.router(x[lo:hi]).ids_TK.flatten()
        keep = layer.last_kept.flatten()
        owned = set(layer.placement.owned(rank))
        counts_SE = torch.stack([torch.bincount(layer.router(x[r * 40 // world:(r + 1) * 40 // world])
                                                .ids_TK.flatten(), minlength=cfg.num_experts)
                                 for r in range(world)])
        cand = torch.minimum(fixed_ratio_quota(counts_SE.sum(0), ratio).unsqueeze(0), counts_SE)
        kept_remote = sum(1 for e, k in zip(ids.tolist(), keep.tolist()) if k and e not in owned)
        kept_local = int(keep.sum()) - kept_remote
        row = cfg.dim * 4
        remote = sum(1 for e in ids.tolist() if e not in owned)
        expected = (world - 1) * (cfg.num_experts * 8 + int(cand[rank].sum()) * 8) + remote \
            + kept_remote * row + (s["bwd_gemm_rows"] - kept_local) * row
        assert s["bwd_a2a_bytes"] == expected, (s["bwd_a2a_bytes"], expected)
        return s["bwd_gemm_rows"], int(s["kept_E"].sum())
    finally:
        mp.undo()


@pytest.mark.parametrize("world", [2, 4])
def test_counters_lrmoe(pool, world):
    res = pool.run(world, lrmoe_counter_case, 0.25)
    assert sum(r for r, _ in res) == res[0][1]  # every kept pair computed exactly once


# ------------------------------------------------------------------- selections


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


def weighted_case(group, selection):
    """A sampled backward's gradients equal the reference's with exactly its kept pairs and weights."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 5, "none")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(selection, ratio=0.4, seed=3))
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    layer(x_local).backward(g[lo:hi])
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
def test_weighted_gradients_equal_reference(pool, world, selection):
    pool.run(world, weighted_case, selection)


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
    from lrmoe.selection.selections import squared_norms

    x = torch.full((3, 64), 3e37)
    sq = squared_norms(x)
    assert torch.isfinite(sq).all()
    torch.testing.assert_close(sq, torch.full((3,), 64 * 9e74, dtype=torch.float64))


# ------------------------------------------------------------------- sampled


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
