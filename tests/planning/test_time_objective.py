"""The controller's time objective (``BackwardConfig(objective="time")``): trim where the
predicted steps × work falls — nothing where dropping costs more steps than it saves, down to
``min_ratio`` where it costs nothing, and just far enough where trimming lets a capped rank keep
its activations; a layer under it keeps what it planned and its gradients are the reference's
with that kept set."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.config import KEEP_NOTHING, KEEP_X, KEEP_X_ACTS
from lrmoe.parallel import comm
from lrmoe.planning.quota_ratio import fixed_ratio_quota
from lrmoe.planning.time_objective import call_work, calls_work, candidate_ratios, fastest_quotas, keep_modes
from tests.helpers.layer import QWEN, equals_kept_reference, make_problem, split_tokens
from tests.helpers.pool import RankPool

COUNTS_E = torch.tensor([300, 100, 60, 40, 100, 100, 100, 100])
ROWS_ER = torch.tensor([[300, 0], [100, 0], [60, 0], [40, 0], [0, 100], [0, 100], [0, 100], [0, 100]])


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=2)
    yield p
    p.close()


def test_candidates_run_from_one_to_the_floor():
    assert candidate_ratios(0.5) == [1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]
    assert candidate_ratios(0.62)[-1] == 0.62 and min(candidate_ratios(0.62)) == 0.62
    assert candidate_ratios(1.0) == [1.0]


def test_candidates_priced_at_once_as_one_by_one():
    """The objective prices every candidate in one pass: the quotas of C ratios at once are each
    ratio's, and the work of C candidates each candidate's, whatever the keep modes."""
    g = torch.Generator().manual_seed(0)
    rows_ER = torch.randint(0, 300, (16, 4), generator=g) * (torch.rand(16, 4, generator=g) < 0.5)
    counts_E = rows_ER.sum(1)
    ratios = candidate_ratios(0.3)
    q_CE = fixed_ratio_quota(counts_E, ratios)
    assert all(torch.equal(q_CE[c], fixed_ratio_quota(counts_E, r)) for c, r in enumerate(ratios))
    keeps = [(KEEP_X_ACTS, KEEP_X, KEEP_NOTHING)[c % 3] for c in range(len(ratios))]
    work_C = calls_work(rows_ER, q_CE, keeps)
    assert work_C.tolist() == pytest.approx([call_work(rows_ER, q, k) for q, k in zip(q_CE, keeps)], rel=1e-12)


def test_work_counts_the_slowest_rank_in_row_passes():
    everything = call_work(ROWS_ER, COUNTS_E, KEEP_X_ACTS)
    assert everything == (3 + 0.5) * 500 + 6 * 500, "rank 0: 500 forward rows, all kept"
    assert call_work(ROWS_ER, COUNTS_E, KEEP_X) == (3 + 0.5) * 500 + 8 * 500, "gate and up recomputed"
    half = fixed_ratio_quota(COUNTS_E, 0.5)
    assert call_work(ROWS_ER, half, KEEP_X_ACTS) == (3 + 0.5) * 500 + 6 * 250


def test_free_trimming_goes_to_the_floor_and_costly_trimming_keeps_everything():
    def acts(_q):
        return KEEP_X_ACTS

    free, _ = fastest_quotas(COUNTS_E, ROWS_ER, COUNTS_E, acts, BackwardConfig(objective="time", drop_cost=0.0,
                                                                              min_ratio=0.6))
    assert torch.equal(free, fixed_ratio_quota(COUNTS_E, 0.6))
    # work(ρ) = 1750 + 3000ρ on the slowest rank; steps 1 + d(1 − ρ): trimming to 0.6 pays iff
    # (1 + 0.4d)(3550) < 4750, i.e. d < 0.845
    kept, _ = fastest_quotas(COUNTS_E, ROWS_ER, COUNTS_E, acts, BackwardConfig(objective="time", drop_cost=0.9,
                                                                              min_ratio=0.6))
    assert torch.equal(kept, COUNTS_E)
    trimmed, _ = fastest_quotas(COUNTS_E, ROWS_ER, COUNTS_E, acts, BackwardConfig(objective="time", drop_cost=0.8,
                                                                                 min_ratio=0.6))
    assert torch.equal(trimmed, fixed_ratio_quota(COUNTS_E, 0.6))


def test_under_a_cap_it_trims_just_far_enough_to_keep_the_activations():
    """Only 400 kept pairs on rank 0 leave room for the activations; beyond that, trimming costs
    more steps than it saves: the objective stops where the keep mode turns x+acts. With d = 1.5:
    x at ρ = 1 predicts 5750, x+acts at 0.8 (1 + 0.3)·4150 = 5395, x+acts at 0.5 1.75·3250 = 5687."""
    def by_room(q_E):
        return KEEP_X_ACTS if int(q_E[:4].sum()) <= 400 else KEEP_X

    q_E, keep = fastest_quotas(COUNTS_E, ROWS_ER, COUNTS_E, by_room, BackwardConfig(objective="time", drop_cost=1.5))
    assert keep == KEEP_X_ACTS
    assert torch.equal(q_E, fixed_ratio_quota(COUNTS_E, 0.8)), "the first ratio whose rank 0 keeps <= 400"


def test_the_memory_quotas_bound_every_candidate():
    memory_E = COUNTS_E // 2
    q_E, _ = fastest_quotas(COUNTS_E, ROWS_ER, memory_E, lambda _q: KEEP_X_ACTS,
                            BackwardConfig(objective="time", drop_cost=5.0))
    assert torch.equal(q_E, memory_E), "what memory forces stays trimmed however costly dropping is"


@pytest.mark.parametrize("field,value", [("objective", "speed"), ("drop_cost", -1.0), ("drop_cost", True)])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        BackwardConfig(**{field: value})


def time_case(group):
    """An uncapped layer with free trimming keeps min_ratio of the pairs, as planned, and its
    gradients are the reference's with its kept set."""
    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 96, 5, "hot_expert")
    sizes = split_tokens(96, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    backward = BackwardConfig(objective="time", drop_cost=0.0, min_ratio=0.6, seed=3)
    layer = MoELayer(cfg, system="lrmoe", group=group, backward=backward)
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    layer(x_local).backward(g[lo:hi])
    s = layer.last_stats
    assert torch.equal(s["quota_E"], fixed_ratio_quota(s["counts_E"], 0.6))
    assert torch.equal(s["kept_E"], s["quota_E"])
    equals_kept_reference(layer, x_local.grad, x, g, sd, cfg, sizes, group)
    return int(s["quota_E"].sum()), int(s["counts_E"].sum())


def test_a_layer_keeps_what_the_time_objective_planned(pool):
    (kept, pairs), _ = pool.run(2, time_case)
    assert kept < pairs


def test_keep_modes_ask_only_at_the_ends_of_each_run_and_match_asking_every_candidate():
    """The keep mode can only get richer as the candidates keep fewer pairs: bisection finds
    every run's ends, and a call whose candidates all allow one mode asks twice."""
    candidates = [fixed_ratio_quota(COUNTS_E, r) for r in candidate_ratios(0.5)]
    asked = []

    def by_room(q_E):
        asked.append(int(q_E.sum()))
        kept = int(q_E[:4].sum())
        return KEEP_X_ACTS if kept <= 300 else KEEP_X if kept <= 420 else KEEP_NOTHING

    every = [by_room(q) for q in candidates]
    assert set(every) == {KEEP_NOTHING, KEEP_X, KEEP_X_ACTS}, "three runs of modes along the ratios"
    asked.clear()
    assert keep_modes(candidates, by_room) == every
    assert len(asked) < len(candidates)

    def x_alone(q_E):
        asked.append(int(q_E.sum()))
        return KEEP_X

    asked.clear()
    assert keep_modes(candidates, x_alone) == [KEEP_X] * len(candidates)
    assert len(asked) == 2, "one mode throughout: the two ends only"
    assert keep_modes(candidates[:1], by_room) == every[:1]


@pytest.mark.parametrize("kept_rows", [400, 800])
def test_the_planners_keep_mode_only_gets_richer_along_the_candidates(kept_rows):
    """What the bisection rests on, for the real peak model: under a binding cap the planner's
    keep mode changes along the ratios (nothing → x, or x → x+acts) and never back, so the
    bisected modes are the ones asking every candidate gives."""
    from lrmoe import ClusterBudget
    from lrmoe.memory.bytes import ByteModel
    from lrmoe.planning.planner import LayerPlanner
    from lrmoe.systems import spec_of

    cfg = MoEConfig(dim=64, ffn_dim=128, num_experts=8, top_k=2)
    bm = ByteModel.of(cfg, True)
    planner = LayerPlanner(spec_of("lrmoe"), cfg, 2,
                           budget=ClusterBudget(4 * bm.slot + 1000 * bm.fwd_io + kept_rows * bm.bwd_kept))
    counts_SE = torch.stack([COUNTS_E, COUNTS_E])
    plan = planner.plan_call(counts_SE)
    candidates = [fixed_ratio_quota(counts_SE.sum(0), r) for r in candidate_ratios(0.3)]

    def keep_of(q_E):
        return planner.keep_mode(plan.placement, plan.assignment, plan.chunk_rows_R, q_E)

    every = [keep_of(q) for q in candidates]
    assert len(set(every)) == 2, "the cap makes the mode change along the ratios"
    assert keep_modes(candidates, keep_of) == every


@pytest.mark.parametrize("warm_ratio", [1.0, 0.75])
@pytest.mark.parametrize("backward", [BackwardConfig(objective="time", drop_cost=0.0, min_ratio=0.6, trim_after=2),
                                      BackwardConfig(ratio=0.5, trim_after=2)], ids=["time", "ratio"])
def test_only_the_warm_ratio_trims_before_trim_after_steps(backward, warm_ratio):
    """The first ``trim_after`` optimizer steps keep the warm ratio's quota (1: every pair;
    neither the time objective nor the ratio trims); from the next one the backward trims as
    configured."""
    cfg = MoEConfig(**QWEN)
    sd, x, g = make_problem(cfg, 64, 5, "hot_expert")
    layer = MoELayer(cfg, system="lrmoe", backward=replace(backward, warm_ratio=warm_ratio))
    layer.load_full_state_dict(sd)
    ratio = backward.min_ratio if backward.objective == "time" else backward.ratio
    for expected in (warm_ratio, warm_ratio, ratio):
        layer(x.clone().requires_grad_(True)).backward(g)
        s = layer.last_stats
        assert torch.equal(s["kept_E"], fixed_ratio_quota(s["counts_E"], expected))
        layer.step_end()


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_trim_after_is_refused(value):
    with pytest.raises(ValueError, match="trim_after"):
        BackwardConfig(trim_after=value)


@pytest.mark.parametrize("value", [0, 1.5, True, "1"])
def test_a_bad_warm_ratio_is_refused(value):
    with pytest.raises(ValueError, match="warm_ratio"):
        BackwardConfig(warm_ratio=value)


def test_min_ratio_after_lowers_the_time_objectives_floor_from_its_steps():
    """The floor follows ``min_ratio_after`` from each listed optimizer step on: the time
    objective (no step cost) trims to 0.75 during step 0, to 0.5 from step 1, to 0.25 from 3."""
    cfg = MoEConfig(**QWEN)
    sd, x, g = make_problem(cfg, 64, 5, "hot_expert")
    backward = BackwardConfig(objective="time", drop_cost=0.0, min_ratio=0.75, min_ratio_after=[[1, 0.5], [3, 0.25]])
    layer = MoELayer(cfg, system="lrmoe", backward=backward)
    layer.load_full_state_dict(sd)
    for expected in (0.75, 0.5, 0.5, 0.25, 0.25):
        layer(x.clone().requires_grad_(True)).backward(g)
        s = layer.last_stats
        assert torch.equal(s["kept_E"], fixed_ratio_quota(s["counts_E"], expected))
        layer.step_end()


def test_min_ratio_after_waits_for_the_warm_steps():
    warm = BackwardConfig(objective="time", trim_after=5, warm_ratio=0.75, min_ratio_after=((2, 0.3),))
    assert warm.at_step(4) == warm.warm_phase() and warm.at_step(4).ratio == 0.75
    assert warm.at_step(5).min_ratio == 0.3 and warm.at_step(5).objective == "time"
    assert BackwardConfig(min_ratio_after=[[0, 0.4]]).min_ratio_after == ((0, 0.4),)  # TOML's lists taken


@pytest.mark.parametrize("value", [[[1, 0]], [[1, 1.5]], [[-1, 0.5]], [[2, 0.5], [2, 0.4]], [[3, 0.5], [1, 0.4]],
                                   [1, 0.5], [[True, 0.5]], "1"])
def test_a_bad_min_ratio_after_is_refused(value):
    with pytest.raises(ValueError, match="min_ratio_after"):
        BackwardConfig(min_ratio_after=value)


def test_per_layer_floors_give_each_layer_its_own():
    """A floor may be a list, one per MoE layer: ``for_layer`` keeps that layer's entry (and the
    shared ones), refuses a list of another length, and nothing takes an unresolved config."""
    both = BackwardConfig(objective="time", min_ratio_after=[[100, [0.3, 0.5]], [150, 0.2]])
    assert both.min_ratio_after == ((100, (0.3, 0.5)), (150, 0.2)) and both.layer_floors == 2
    assert both.for_layer(0, 2).min_ratio_after == ((100, 0.3), (150, 0.2))
    assert both.for_layer(1, 2).at_step(120).min_ratio == 0.5 and both.for_layer(1, 2).at_step(150).min_ratio == 0.2
    assert BackwardConfig(min_ratio_after=[[1, 0.4]]).for_layer(2, 3).min_ratio_after == ((1, 0.4),)
    with pytest.raises(ValueError, match="one ratio per MoE layer"):
        both.for_layer(0, 3)
    with pytest.raises(ValueError, match="for_layer"):
        both.at_step(120)
    with pytest.raises(ValueError, match="per-layer floors"):
        MoELayer(MoEConfig(**QWEN), system="lrmoe", backward=both)


@pytest.mark.parametrize("value", [[[1, []]], [[1, [0.5, 0]]], [[1, [[0.5]]]], [[1, [0.5, True]]]])
def test_a_bad_per_layer_floor_is_refused(value):
    with pytest.raises(ValueError, match="min_ratio_after"):
        BackwardConfig(min_ratio_after=value)
