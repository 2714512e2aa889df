"""What lrmoe's expert side keeps from forward to backward (issue 19, item 2): nothing (x
re-sent, recompute), x (only dy travels, to where the forward computed the pair; recompute) or x
and the activations (static's backward on the kept rows). Every mode gives the same gradients
as the reference with the same kept set and weights; the meter's peak equals the replay's; the
choice follows the cap; at ρ = 0.9 keep-x sends fewer backward bytes than static."""

from __future__ import annotations

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig, MoELayer
from lrmoe.memory.bytes import KEEP_MODES, KEEP_NOTHING, KEEP_X, KEEP_X_ACTS, RankWork, expert_side_peak
from lrmoe.parallel import comm
from lrmoe.planning import cap_fit as fit
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import spec_of
from tests.pool import RankPool
from tests.reference import reference_grads
from tests.test_counters import Recorder
from tests.test_layer import QWEN, close, make_problem, split_tokens


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=4)
    yield p
    p.close()


def _force(mp: pytest.MonkeyPatch, mode: str) -> None:
    mp.setattr(fit.CapFitting, "keep_mode", lambda self, *args: mode)


def modes_case(group, selection: str):
    """Each mode against the reference with the layer's kept set and weights; the meter's peak
    against the replay. Returns the per-mode (kept set, bwd bytes, bwd GEMM rows)."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 5, "none")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    out = {}
    for mode in KEEP_MODES:
        mp = pytest.MonkeyPatch()
        try:
            _force(mp, mode)
            layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(selection, ratio=0.5, seed=3))
            layer.load_full_state_dict(sd)
            x_local = x[lo:hi].clone().requires_grad_(True)
            layer(x_local).backward(g[lo:hi])
        finally:
            mp.undo()
        s = layer.last_stats
        assert s["keep_mode"] == mode
        keep = comm.all_gather(layer.last_kept, sizes, group) if world > 1 else layer.last_kept
        scale = None
        if layer.last_scale is not None:
            scale = comm.all_gather(layer.last_scale, sizes, group) if world > 1 else layer.last_scale
        _, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg, keep_TK=keep, scale_TK=scale)
        close(f"{mode} dx", x_local.grad, ref_dx[lo:hi])
        grads = layer.gather_full_grads()
        for name, want in ref_grads.items():
            close(f"{mode} grad {name}", grads[name], want)
        pl = layer.placement
        work = RankWork(s["recv_rows"], s["bwd_gemm_rows"], len(pl.slots[rank]), len(pl.owned(rank)), None,
                        world, pl.num_copies > cfg.num_experts, keep=mode)
        assert expert_side_peak("lrmoe", cfg.dim, cfg.ffn_dim, 4, work) == s["peak_expert_side_bytes"], mode
        out[mode] = (layer.last_kept.clone(), s["bwd_a2a_bytes"], s["bwd_gemm_rows"])
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("selection", ["lrm", "local-sampled"])
def test_every_mode_equals_the_reference(pool, world, selection):
    res = pool.run(world, modes_case, selection)
    for r in res:
        kept = r[KEEP_NOTHING][0]
        assert all(torch.equal(r[m][0], kept) for m in KEEP_MODES), "the same kept set in every mode"
        assert r[KEEP_X][1] == r[KEEP_X_ACTS][1], "x and x+acts move the same bytes"
    if world > 1:
        assert sum(r[KEEP_X][1] for r in res) < sum(r[KEEP_NOTHING][1] for r in res), "no x re-sent"


def bytes_case(group, system: str, ratio: float):
    """Backward bytes of one call at the bench shape's ratio, with its exchanges recorded."""
    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**QWEN)
        world, rank = comm.world_size(group), comm.rank_of(group)
        if system == "lrmoe":
            _force(mp, KEEP_X)
        rec = Recorder(mp, rank)
        sd, x, g = make_problem(cfg, 256, 7, "none")
        lo, hi = rank * 256 // world, (rank + 1) * 256 // world
        kw = {"backward": BackwardConfig("local-sampled", ratio=ratio, seed=1)} if system == "lrmoe" else {}
        layer = MoELayer(cfg, system=system, group=group, **kw)
        layer.load_full_state_dict(sd)
        out = layer(x[lo:hi])
        rec.take()
        out.backward(g[lo:hi])
        a2a, rows = rec.take()
        s = layer.last_stats
        assert s["bwd_a2a_bytes"] == sum(a for a, _ in a2a)
        assert all(r == s["bwd_gemm_rows"] for _, r in rows)
        if system == "static":
            return s["bwd_a2a_bytes"], None
        # independent count: no exchange before the rows; kept dy rows to remote experts, each
        # with its 4-byte position among the forward's rows, dx rows back
        ids = layer.router(x[lo:hi]).ids_TK.flatten()
        keep = layer.last_kept.flatten()
        owned = set(layer.placement.owned(rank))
        remote = [e not in owned for e in ids.tolist()]
        kept_remote = sum(1 for k, r in zip(keep.tolist(), remote) if k and r)
        kept_local = int(keep.sum()) - kept_remote
        row = cfg.dim * 4
        assert len(a2a) == 2, "dy (with positions), dx"
        expected = kept_remote * (row + 4) + (s["bwd_gemm_rows"] - kept_local) * row
        assert s["bwd_a2a_bytes"] == expected, (s["bwd_a2a_bytes"], expected)
        assert len(rows) == 5 + 3 and s["keep_mode"] == KEEP_X
        return s["bwd_a2a_bytes"], s["bwd_gemm_rows"]
    finally:
        mp.undo()


def test_local_sampled_keep_x_sends_less_than_static(pool):
    static = sum(r[0] for r in pool.run(4, bytes_case, "static", 1.0))
    lrmoe = sum(r[0] for r in pool.run(4, bytes_case, "lrmoe", 0.9))
    assert lrmoe < static, (lrmoe, static)


def _predicted(planner: LayerPlanner, plan, mode: str) -> list[int]:
    """Every rank's predicted peak in ``mode``: kept pairs where the forward computed them."""
    rows_ER = plan.assignment.rows_ER()
    bwd_R = torch.minimum(rows_ER, plan.quota_E.view(-1, 1)).sum(0).tolist()
    fwd_R = rows_ER.sum(0).tolist()
    pl, cfg = plan.placement, planner.config
    return [expert_side_peak("lrmoe", cfg.dim, cfg.ffn_dim, 4, RankWork(
        int(fwd_R[r]), int(bwd_R[r]), len(pl.slots[r]), len(pl.owned(r)), plan.chunk_rows_R[r], planner.world,
        pl.num_copies > cfg.num_experts, keep=mode)) for r in range(planner.world)]


def test_the_choice_is_the_richest_that_fits():
    cfg, world = MoEConfig(**QWEN), 2
    sd, x, _ = make_problem(cfg, 96, 5, "hot")
    layer = MoELayer(cfg)
    layer.load_full_state_dict(sd)
    with torch.no_grad():
        ids = layer.router(x).ids_TK
    counts_SE = torch.stack([torch.bincount(ids[r * 48:(r + 1) * 48].flatten(), minlength=8) for r in range(world)])
    spec, bw = spec_of("lrmoe"), BackwardConfig(ratio=0.9)
    assert LayerPlanner(spec, cfg, world, backward=bw).plan_call(counts_SE).keep == KEEP_X_ACTS, "no cap: fastest"
    seen = set()
    # one fixed replica slot a rank: its memory (and the owned weights' second copy) leaves the
    # cap's range room for every mode, poorest to richest
    for cap in range(75_000, 135_000, 5_000):
        planner = LayerPlanner(spec, cfg, world, budget=ClusterBudget(memory_bytes=cap, slots=5), backward=bw)
        plan = planner.plan_call(counts_SE)
        assert plan.stats["keep_mode"] == plan.keep
        seen.add(plan.keep)
        richer = KEEP_MODES[:KEEP_MODES.index(plan.keep)]
        for mode in richer:  # every richer mode is over the cap on some rank (or needs acts of a chunked forward)
            chunked = any(c < n for c, n in zip(plan.chunk_rows_R, plan.assignment.rows_R()))
            assert (mode == KEEP_X_ACTS and chunked) or max(_predicted(planner, plan, mode)) > cap, (cap, mode)
        if plan.keep != KEEP_NOTHING:
            assert max(_predicted(planner, plan, plan.keep)) <= cap
        assert planner.plan_call(counts_SE, training=False).keep is None, "a forward-only call keeps nothing"
    assert seen == set(KEEP_MODES), seen
