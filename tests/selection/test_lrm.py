"""The LRM selection (``selection="lrm"``) against an independent reference: the kept set is the
global per-expert top-q_e of w²·‖g‖²·‖h‖², exactly the kept pairs contribute, ratio 1 is static,
masked and an empty rank alike, and the backward's counters match the wire."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.selection import fixed_ratio_quota
from tests.helpers.layer import GLM, QWEN, Recorder, close, make_problem, split_tokens
from tests.oracles.dense_moe import dense_moe, reference_grads


def reference_keep(x, g, sd, cfg, ratio: float, margin: float = 1e-3):
    """Global per-expert top-q_e of the dense reference's LRM scores, and whether every quota
    boundary has a relative score gap of at least ``margin`` (so rounding cannot flip it)."""
    with torch.no_grad():
        params = {k: v for k, v in sd.items()}
        _, ids, h_TKF = dense_moe(x, params, cfg)
        from tests.oracles.dense_moe import route

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
