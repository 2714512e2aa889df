"""What lrmoe's expert side keeps from forward to backward: nothing (x re-sent, recompute), x
(only dy travels, to where the forward computed the pair; recompute), x and gate/up (silu and h
recomputed) or x and the activations (static's backward on the kept rows). Every mode gives the
same gradients as the reference with the same kept set and weights; the meter's peak equals the
replay's; at ρ = 0.9 keep-x sends fewer backward bytes than static. (The choice following the cap:
tests/planning/test_memory_cap.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig, MoELayer
from lrmoe.memory import KEEP_MODES, KEEP_NOTHING, KEEP_X, KEEP_X_ACTS, KEEP_X_GATE_UP, RankWork, expert_side_peak
from lrmoe.memory.bytes import IN_PLACE_FROM
from lrmoe.parallel import comm
from tests.helpers.layer import QWEN, Recorder, close, equals_kept_reference, make_problem, split_tokens
from tests.helpers.pool import RankPool
from tests.oracles.dense_moe import reference_grads


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=4)
    yield p
    p.close()


def modes_case(group, selection: str, ratio: float, chunk: int = 0):
    """Each mode (``BackwardConfig.keep``) against the reference with the layer's kept set and
    weights; the meter's peak against the replay (x+acts' kept rows gathered at ratio 0.3,
    compacted in place at 0.8; x+gate_up's gathered at both). ``chunk``: the modes that
    recompute do so that many rows at a time (``recompute_chunk``). Returns the per-mode (kept
    set, bwd bytes, bwd GEMM rows)."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 5, "none")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    out = {}
    for mode in KEEP_MODES:
        layer = MoELayer(cfg, system="lrmoe", group=group,
                         backward=BackwardConfig(selection, ratio=ratio, seed=3, keep=mode, recompute_chunk=chunk))
        layer.load_full_state_dict(sd)
        x_local = x[lo:hi].clone().requires_grad_(True)
        layer(x_local).backward(g[lo:hi])
        s = layer.last_stats
        assert s["keep_mode"] == mode
        if mode == KEEP_X_ACTS:
            assert s["compaction"] == ("in place" if ratio > IN_PLACE_FROM else "gathered"), s["compaction"]
        if mode == KEEP_X_GATE_UP:  # silu and h recomputed for the kept rows alone
            assert s["compaction"] == "gathered", s["compaction"]
        keep = comm.all_gather(layer.last_kept, sizes, group) if world > 1 else layer.last_kept
        scale = None
        if layer.last_scale is not None:
            scale = comm.all_gather(layer.last_scale, sizes, group) if world > 1 else layer.last_scale
        _, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg, keep_TK=keep, scale_TK=scale)
        close(f"{mode} dx", x_local.grad, ref_dx[lo:hi])
        grads = layer.gather_full_grads()
        for name, want in ref_grads.items():
            close(f"{mode} grad {name}", grads[name], want)
        recomputes = chunk and mode not in (KEEP_X_ACTS, KEEP_X_GATE_UP)
        assert s.get("bwd_chunk_rows") == (chunk if recomputes else None)
        pl = layer.placement
        work = RankWork(s["recv_rows"], s["bwd_gemm_rows"], len(pl.slots[rank]), len(pl.owned(rank)), None,
                        world, pl.num_copies > cfg.num_experts, keep=mode, bwd_chunk_rows=chunk if recomputes else None)
        assert expert_side_peak("lrmoe", cfg.dim, cfg.ffn_dim, 4, work) == s["peak_expert_side_bytes"], mode
        out[mode] = (layer.last_kept.clone(), s["bwd_a2a_bytes"], s["bwd_gemm_rows"])
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("selection", ["lrm", "local-sampled"])
@pytest.mark.parametrize("ratio", [0.3, 0.8])
def test_every_mode_equals_the_reference(pool, world, selection, ratio):
    res = pool.run(world, modes_case, selection, ratio)
    for r in res:
        kept = r[KEEP_NOTHING][0]
        assert all(torch.equal(r[m][0], kept) for m in KEEP_MODES), "the same kept set in every mode"
        assert r[KEEP_X][1] == r[KEEP_X_ACTS][1] == r[KEEP_X_GATE_UP][1], "the keep-x modes move the same bytes"
    if world > 1:
        assert sum(r[KEEP_X][1] for r in res) < sum(r[KEEP_NOTHING][1] for r in res), "no x re-sent"


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("selection", ["lrm", "local-sampled"])
def test_kept_rows_recomputed_in_chunks_equal_the_reference(pool, world, selection):
    """``recompute_chunk``: the modes that recompute (x, nothing) do so 5 rows at a time, the
    weight gradients summed over chunks: the reference's gradients, the same kept set as all at
    once, the replay's peak with one chunk's activations."""
    whole = pool.run(world, modes_case, selection, 0.5)
    chunked = pool.run(world, modes_case, selection, 0.5, 5)
    for r, w in zip(chunked, whole):
        assert all(torch.equal(r[m][0], w[m][0]) and r[m][1:] == w[m][1:] for m in KEEP_MODES)
    assert any(r[m][2] > 5 for r in chunked for m in (KEEP_X, KEEP_NOTHING)), "some rank recomputed in chunks"


def bytes_case(group, system: str, ratio: float):
    """Backward bytes of one call at the bench shape's ratio, with its exchanges recorded."""
    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**QWEN)
        world, rank = comm.world_size(group), comm.rank_of(group)
        rec = Recorder(mp, rank)
        sd, x, g = make_problem(cfg, 256, 7, "none")
        lo, hi = rank * 256 // world, (rank + 1) * 256 // world
        backward = BackwardConfig("local-sampled", ratio=ratio, seed=1, keep=KEEP_X)
        kw = {"backward": backward} if system == "lrmoe" else {}
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


def test_keep_is_checked():
    """``BackwardConfig.keep`` names a mode, fixes a compacting system's, and is refused where
    a cap chooses or the system keeps what its backward needs."""
    cfg = MoEConfig(**QWEN)
    with pytest.raises(ValueError, match="keep='all'"):
        BackwardConfig(keep="all")
    with pytest.raises(ValueError, match="compacting systems"):
        MoELayer(cfg, system="static", backward=BackwardConfig(keep=KEEP_X))
    with pytest.raises(ValueError, match="memory cap"):
        MoELayer(cfg, system="lrmoe", backward=BackwardConfig(keep=KEEP_X), budget=ClusterBudget(memory_bytes=10**9))


def test_in_place_and_gathered_rows_agree_in_bfloat16(monkeypatch):
    """A bf16 expert side (NumPy has no bfloat16: its rows move through torch) compacting its
    kept rows in place gives the gathered rows' gradients (summed in another row order)."""
    cfg = MoEConfig(**{**QWEN, "dtype": "bfloat16"})
    sd, x, g = make_problem(MoEConfig(**QWEN), 48, 5, "none")
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    grads = {}
    for way in ("in place", "gathered"):
        if way == "gathered":
            monkeypatch.setattr("lrmoe.passes.row_paths.in_place", lambda *args: False)
        layer = MoELayer(cfg, system="lrmoe", backward=BackwardConfig(ratio=0.8, seed=3))
        layer.load_full_state_dict(sd)
        xi = x.to(torch.bfloat16).requires_grad_(True)
        layer(xi).backward(g.to(torch.bfloat16))
        assert layer.last_stats["compaction"] == way
        grads[way] = [xi.grad.float(), *(p.grad.float() for p in layer.parameters())]
    for a, b in zip(grads["in place"], grads["gathered"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def replicas_in_place_case(group):
    """lrmoe with replicas (owned and replica weights two sets the GEMMs read in place) keeping
    0.8 of its pairs: the kept rows compacted in place, the gradients the reference's."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 512, 5, "hot_expert")
    sizes = split_tokens(512, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    layer = MoELayer(cfg, system="lrmoe", group=group, budget=ClusterBudget(10**9),
                     backward=BackwardConfig(ratio=0.8, seed=4))
    layer.load_full_state_dict(sd)
    for _ in range(3):  # replicas follow the load from the first step on
        layer.zero_grad(set_to_none=True)
        x_local = x[lo:hi].clone().requires_grad_(True)
        layer(x_local).backward(g[lo:hi])
        layer.step_end()
    equals_kept_reference(layer, x_local.grad, x, g, sd, cfg, sizes, group)
    s = layer.last_stats
    return s["compaction"], s["replica_slots"] - len(layer.placement.owned(rank))


def test_in_place_with_replicas_equals_the_reference(pool):
    res = pool.run(2, replicas_in_place_case)
    assert all(compaction == "in place" for compaction, _ in res), res
    assert sum(replicas for _, replicas in res) > 0, "a rank holds a replica"


def gate_up_chunked_case(group, chunk: int):
    """Keeping x and gate/up, the forward computing every row at once (its backward planned
    after it, silu and h then let go) or, where the plan chunks it (forced here, as a cap would
    set it), its backward planned first and silu, h and y ``chunk`` rows at a time beside every
    row's gate/up: the reference's gradients with the layer's kept set, the same y, the meter's
    peak the replay's."""
    from lrmoe.planning.planner import LayerPlanner

    mp = pytest.MonkeyPatch()
    try:
        cfg = MoEConfig(**QWEN)
        world, rank = comm.world_size(group), comm.rank_of(group)
        sd, x, g = make_problem(cfg, 48, 5, "none")
        sizes = split_tokens(48, world, None)
        lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
        plan_forward, outs = LayerPlanner.plan_forward, {}
        for chunked in (False, True):
            if chunked:
                mp.setattr(LayerPlanner, "plan_forward", lambda self, *a, **k: replace(
                    plan_forward(self, *a, **k), chunk_rows_R=[chunk] * world))
            layer = MoELayer(cfg, system="lrmoe", group=group,
                             backward=BackwardConfig("local-sampled", ratio=0.6, seed=3, keep=KEEP_X_GATE_UP))
            layer.load_full_state_dict(sd)
            x_local = x[lo:hi].clone().requires_grad_(True)
            out = layer(x_local)
            out.backward(g[lo:hi])
            equals_kept_reference(layer, x_local.grad, x, g, sd, cfg, sizes, group, f"chunked {chunked}")
            s, pl = layer.last_stats, layer.placement
            work = RankWork(s["recv_rows"], s["bwd_gemm_rows"], len(pl.slots[rank]), len(pl.owned(rank)),
                            chunk if chunked else None, world, pl.num_copies > cfg.num_experts, keep=KEEP_X_GATE_UP)
            assert expert_side_peak("lrmoe", cfg.dim, cfg.ffn_dim, 4, work) == s["peak_expert_side_bytes"]
            outs[chunked] = (out.detach(), s["peak_expert_side_bytes"], s["recv_rows"])
        close("y in chunks", outs[True][0], outs[False][0])
        return outs[True][1] < outs[False][1], outs[False][2]
    finally:
        mp.undo()


@pytest.mark.parametrize("world", [1, 2])
def test_keeping_gate_up_computes_the_forward_in_chunks(pool, world):
    res = pool.run(world, gate_up_chunked_case, 7)
    assert all(rows > 7 for _, rows in res), "every rank's forward went in several chunks"
    assert all(lower for lower, _ in res), "a smaller peak in chunks"
