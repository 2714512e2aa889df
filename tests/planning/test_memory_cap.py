"""What the planner does under one memory cap for every system (docs/design.md "The paper's
regime"): symi takes fewer replicas only where its default slots do not fit; static that cannot
fit keeping x keeps nothing and moves its rows in rounds, and below its experts and a one-row
round raises naming the rank, its need and the cap; LAER with too few fixed slots is a slot error;
the controller's and the budget's own errors; and lrmoe's keep mode (what the expert side keeps
from forward to backward) is the richest that fits the cap."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MemoryBudgetExceeded, MoEConfig, MoELayer
from lrmoe.memory import KEEP_MODES, KEEP_NOTHING, KEEP_X_ACTS, KEEP_X_GATE_UP, ByteModel, RankWork, expert_side_peak
from lrmoe.planning import chunks
from lrmoe.planning.controller import Controller
from lrmoe.planning.placement import Placement
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import spec_of
from tests.helpers.layer import QWEN, make_problem, skewed_tokens
from tests.oracles.dense_moe import route

CFG = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)
N = 96  # tokens over all ranks: the hot expert's rows weigh as much as a rank's parameters
SEED = 5


def _counts_SE(world: int) -> torch.Tensor:
    cfg = MoEConfig(**CFG)
    sd, x, _ = skewed_tokens(cfg, N, SEED, "hot")
    _, ids = route(x, sd, cfg)
    return torch.stack([torch.bincount(ids[r * N // world:(r + 1) * N // world].reshape(-1), minlength=8)
                        for r in range(world)])


def _static_peak(world: int, counts_SE: torch.Tensor) -> int:
    cfg = MoEConfig(**CFG)
    rows = LayerPlanner(spec_of("static"), cfg, world).plan_call(counts_SE).assignment.rows_R()
    owned = cfg.num_experts // world
    return max(expert_side_peak("static", cfg.dim, cfg.ffn_dim, 4, RankWork(int(n), int(n), owned, owned, None, world))
               for n in rows)


def test_symi_takes_fewer_replicas_only_where_its_default_does_not_fit():
    cfg, world = MoEConfig(**CFG), 4
    counts_SE = _counts_SE(world)
    peak = _static_peak(world, counts_SE)
    default = LayerPlanner(spec_of("symi"), cfg, world).default_slots_R
    # 0.65 × static's peak: copies first (the fit ladder): fixed or derived from the cap, the
    # default slots, every rank keeping by the row, most of its rows' activations kept
    cap = int(0.65 * peak)
    for slots in (default, None):
        plan = LayerPlanner(spec_of("symi"), cfg, world, budget=ClusterBudget(memory_bytes=cap, slots=slots)
                            ).plan_call(counts_SE)
        assert plan.keep == "x" and max(plan.peak_R) <= cap and [len(s) for s in plan.placement.slots] == default
        rows_R = plan.assignment.rows_R()
        assert sum(s.acts for s in plan.split_R) >= 0.9 * sum(rows_R), plan.split_R
    # 0.4 ×: the default slots, fixed, fit only with nothing kept and the rows in rounds; at the
    # default copies' own bytes, no way; derived from the cap, fewer copies (keeping x alone),
    # re-planned inside the call and then at every step
    cap = int(0.4 * peak)
    fixed = LayerPlanner(spec_of("symi"), cfg, world, budget=ClusterBudget(memory_bytes=cap, slots=default))
    plan = fixed.plan_call(counts_SE)
    assert plan.keep == "nothing" and plan.rounds_R is not None and max(plan.peak_R) <= cap
    low = max(default) * ByteModel.of(cfg).slot
    fixed = LayerPlanner(spec_of("symi"), cfg, world, budget=ClusterBudget(memory_bytes=low, slots=default))
    with pytest.raises(MemoryBudgetExceeded, match="memory budget too small: rank") as err:
        fixed.plan_call(counts_SE)
    assert err.value.cap == low and err.value.needed > low
    planner = LayerPlanner(spec_of("symi"), cfg, world, budget=ClusterBudget(memory_bytes=cap))
    for _ in range(3):
        plan = planner.plan_call(counts_SE)
        copies = [len(s) for s in plan.placement.slots]
        assert max(plan.peak_R) <= cap and plan.keep == "x"
        assert copies != default and all(2 <= c <= d for c, d in zip(copies, default)), copies
        assert plan.placement.num_copies > cfg.num_experts, "still replicates the hot expert"
        planner.step_end()
    # an ample cap keeps the unconstrained default
    ample = LayerPlanner(spec_of("symi"), cfg, world, budget=ClusterBudget(memory_bytes=10**9))
    ample.plan_call(counts_SE)
    ample.step_end()
    assert ample.slots_R == default


def test_static_keeps_x_alone_below_its_peak_then_rounds_and_raises_below_a_one_row_round():
    cfg = MoEConfig(**CFG)
    counts_SE = _counts_SE(2)
    need = _static_peak(2, counts_SE)
    plan = LayerPlanner(spec_of("static"), cfg, 2, budget=ClusterBudget(memory_bytes=need)).plan_call(counts_SE)
    assert plan.peak_R[0] == need and plan.keep is None and plan.bwd_chunk_rows_R is None
    # just below: x alone is kept, the activations recomputed (the backward chunked if need be)
    plan = LayerPlanner(spec_of("static"), cfg, 2, budget=ClusterBudget(memory_bytes=need - 1)).plan_call(counts_SE)
    assert plan.keep == "x" and max(plan.peak_R) <= need - 1
    assert plan.figures.keep_mode == "x"
    # far below: x and dy of the rows do not fit beside the experts: nothing kept, rows in rounds
    low = need // 3
    plan = LayerPlanner(spec_of("static"), cfg, 2, budget=ClusterBudget(memory_bytes=low)).plan_call(counts_SE)
    assert plan.keep == "nothing" and plan.rounds_R is not None and max(plan.peak_R) <= low
    # below the owned experts and a one-row round: every rank raises, naming the least that fits
    bm = ByteModel.of(cfg, selective=False)
    least = cfg.num_experts // 2 * bm.slot + max(bm.round_forward(1), bm.round_backward(1))
    with pytest.raises(MemoryBudgetExceeded) as err:
        LayerPlanner(spec_of("static"), cfg, 2, budget=ClusterBudget(memory_bytes=least - 1)).plan_call(counts_SE)
    e = err.value
    assert isinstance(e, ValueError) and e.cap == least - 1 and e.needed == least
    msg = str(e)
    assert f"rank {e.rank} needs {e.needed} bytes" in msg and f"is {least - 1}" in msg
    assert "nothing kept to the backward and every exchange in rounds of one row" in msg and "lrmoe" in msg
    at_need = LayerPlanner(spec_of("static"), cfg, 2, budget=ClusterBudget(memory_bytes=e.needed)).plan_call(counts_SE)
    assert at_need.keep == "nothing" and max(at_need.peak_R) <= e.needed and at_need.rounds_R[e.rank] == 1


def test_laer_with_too_few_fixed_slots_is_a_slot_error_not_a_memory_one():
    """At the layer's construction (the launcher builds it too), not at the first call whose
    experts with pairs outnumber the slots."""
    with pytest.raises(ValueError, match="assemble at most 2 experts at once") as err:
        LayerPlanner(spec_of("laer"), MoEConfig(**CFG), 2, budget=ClusterBudget(memory_bytes=10**9, slots=1))
    assert not isinstance(err.value, MemoryBudgetExceeded)


def test_controller_budget_errors():
    cfg = MoEConfig(**CFG)
    slot = ByteModel.of(cfg).slot
    with pytest.raises(ValueError, match="memory budget too small"):
        Controller(cfg, ClusterBudget(slot), 2).slots(Placement.static(8, 2))
    with pytest.raises(ValueError, match="memory_bytes"):
        ClusterBudget(0)
    with pytest.raises(ValueError, match="slots"):
        ClusterBudget(10**6, slots=[1, 0])
    # every system takes the memory cap; one below the owned experts fails at build
    MoELayer(cfg, system="static", budget=ClusterBudget(10**6))
    with pytest.raises(MemoryBudgetExceeded, match="memory budget too small"):
        MoELayer(cfg, system="static", budget=ClusterBudget(slot))


# ------------------------------------------------------------------- the keep mode under the cap


def _predicted(planner: LayerPlanner, plan, mode: str, chunk_R: list[int] | None = None) -> list[int]:
    """Every rank's predicted peak in ``mode``: kept pairs where the forward computed them, the
    forward in the plan's chunks (or ``chunk_R``)."""
    rows_ER = plan.assignment.rows_ER()
    bwd_R = torch.minimum(rows_ER, plan.quota_E.view(-1, 1)).sum(0).tolist()
    fwd_R = rows_ER.sum(0).tolist()
    pl, cfg, chunk_R = plan.placement, planner.config, chunk_R or plan.chunk_rows_R
    return [expert_side_peak("lrmoe", cfg.dim, cfg.ffn_dim, 4, RankWork(
        int(fwd_R[r]), int(bwd_R[r]), len(pl.slots[r]), len(pl.owned(r)), chunk_R[r], planner.world,
        pl.num_copies > cfg.num_experts, keep=mode)) for r in range(planner.world)]


def _hot_counts_SE(cfg: MoEConfig, world: int) -> torch.Tensor:
    """Routed pairs per source rank and expert of 96 tokens with one hot expert, split evenly."""
    sd, x, _ = make_problem(cfg, 96, 5, "hot")
    layer = MoELayer(cfg)
    layer.load_full_state_dict(sd)
    with torch.no_grad():
        ids = layer.router(x).ids_TK
    n = 96 // world
    return torch.stack([torch.bincount(ids[r * n:(r + 1) * n].flatten(), minlength=cfg.num_experts)
                        for r in range(world)])


def test_the_choice_is_the_richest_that_fits():
    cfg, world = MoEConfig(**QWEN), 2
    counts_SE = _hot_counts_SE(cfg, world)
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
        _richer_do_not_fit(planner, plan, cap)
        assert planner.plan_call(counts_SE, training=False).keep is None, "a forward-only call keeps nothing"
    assert seen == set(KEEP_MODES), seen


def _richer_do_not_fit(planner: LayerPlanner, plan, cap: int) -> None:
    """``plan.keep`` fits ``cap`` (keeping gate/up, in the largest forward chunks that do) and
    every richer mode is over it on some rank (or needs acts of a chunked forward; keeping
    gate/up, with its forward's least chunk)."""
    rows_R = [int(n) for n in plan.assignment.rows_R()]
    # the forward's chunks as the controller fitted them (keeping gate/up, the plan has its own)
    fitted_R = [planner.controller.forward_chunk_rows(plan.placement, r, n) for r, n in enumerate(rows_R)]
    chunked = any(c < n for c, n in zip(fitted_R, rows_R))
    for mode in KEEP_MODES[:KEEP_MODES.index(plan.keep)]:
        least = chunks.gate_up_least_chunks(fitted_R, rows_R) if mode == KEEP_X_GATE_UP else None
        assert (mode == KEEP_X_ACTS and chunked) or max(_predicted(planner, plan, mode, least)) > cap, (cap, mode)
    if plan.keep != KEEP_NOTHING:
        assert max(_predicted(planner, plan, plan.keep)) <= cap
    if plan.keep == KEEP_X_GATE_UP:  # every row at once where that fits, else the largest chunk that does
        for r, (c, n) in enumerate(zip(plan.chunk_rows_R, rows_R)):
            bigger = [min(c + 1, n) if i == r else plan.chunk_rows_R[i] for i in range(len(rows_R))]
            assert c == n or _predicted(planner, plan, plan.keep, bigger)[r] > cap, (cap, r, c, n)
            assert c >= (n if fitted_R[r] >= n else min(chunks.GATE_UP_LEAST_CHUNK, n)), (cap, r, c)


def test_keeping_gate_up_computes_the_forward_in_the_largest_chunks_that_fit(monkeypatch):
    """Keeping x and gate/up, the forward holds every row's gate/up and computes silu, h and y a
    chunk at a time: where all at once does not fit, in the largest chunks that do, never below
    the least chunk (here lowered to 40 of the 96 rows a rank, so that this shape shows it)."""
    monkeypatch.setattr(chunks, "GATE_UP_LEAST_CHUNK", 40)
    cfg, world = MoEConfig(**QWEN), 2
    counts_SE = _hot_counts_SE(cfg, world)
    spec, bw, chunked = spec_of("lrmoe"), BackwardConfig(ratio=0.3), 0
    for cap in range(84_000, 98_000, 1_000):
        planner = LayerPlanner(spec, cfg, world, budget=ClusterBudget(memory_bytes=cap, slots=5), backward=bw)
        plan = planner.plan_call(counts_SE)
        _richer_do_not_fit(planner, plan, cap)
        if plan.keep == KEEP_X_GATE_UP:
            chunked += any(c < n for c, n in zip(plan.chunk_rows_R, plan.assignment.rows_R()))
            assert plan.stats["fwd_chunk_rows"] == plan.chunk_rows_R[planner.rank]
    assert chunked, "some cap keeps gate/up with its forward in chunks"


def _peak(cfg: MoEConfig, work: RankWork, bwd_chunk: int) -> int:
    return expert_side_peak("lrmoe", cfg.dim, cfg.ffn_dim, 4, replace(work, bwd_chunk_rows=bwd_chunk))


def test_recomputing_in_chunks_keeps_more_pairs_within_the_cap():
    """``recompute_chunk``: a kept row then costs dy and x beside one chunk's activations, so a
    cap that trims keeps more pairs; every rank's chunk is the largest whose predicted peak fits
    (its kept rows at once where they fit)."""
    cfg, world = MoEConfig(**QWEN), 2
    counts_SE = _hot_counts_SE(cfg, world)
    spec, more = spec_of("lrmoe"), 0
    for cap in range(60_000, 135_000, 5_000):
        plans = {}
        for chunk in (0, 4):
            budget = ClusterBudget(memory_bytes=cap, slots=5)
            planner = LayerPlanner(spec, cfg, world, budget=budget, backward=BackwardConfig(recompute_chunk=chunk))
            plans[chunk] = planner, planner.plan_call(counts_SE)
        (_, whole), (planner, chunked) = plans[0], plans[4]
        kept, kept_whole = int(chunked.quota_E.sum()), int(whole.quota_E.sum())
        assert kept >= kept_whole, (cap, kept, kept_whole)
        more += kept > kept_whole
        if chunked.keep in (KEEP_X_ACTS, KEEP_X_GATE_UP):  # nothing recomputed but silu and h
            assert chunked.bwd_chunk_rows_R is None
            continue
        pl, rows_ER = chunked.placement, chunked.assignment.rows_ER()
        bwd_R = torch.minimum(rows_ER, chunked.quota_E.view(-1, 1)).sum(0).tolist()
        if chunked.keep == KEEP_NOTHING:
            bwd_R = chunked.kept_assignment.rows_R()
        for r in range(world):
            work = RankWork(int(rows_ER[:, r].sum()), int(bwd_R[r]), len(pl.slots[r]), len(pl.owned(r)),
                            chunked.chunk_rows_R[r], world, pl.num_copies > cfg.num_experts, keep=chunked.keep)
            c = chunked.bwd_chunk_rows_R[r]
            assert _peak(cfg, work, c) <= cap, (cap, r, c)
            assert c >= bwd_R[r] or _peak(cfg, work, c + 1) > cap, "the largest chunk that fits"
    assert more, "some cap keeps more pairs when the kept rows are recomputed in chunks"
