"""lrmoe.sim: the analytic memory accounting against the real layer, trace rescaling, steps to
target, the cost model's direction, and the `lrmoe simulate` command line."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tqdm import tqdm

from lrmoe.cli import main
from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.layer import MoELayer
from lrmoe.selection import fixed_ratio_quota
from lrmoe.sim.budget import GIB
from lrmoe.sim.config import SimConfig, routing_counts
from lrmoe.sim.errors import SimError
from lrmoe.sim.host import PlanningReference
from lrmoe.sim.layer_calls import SystemPlanner
from lrmoe.sim.memory import RankWork, expert_side_peak
from lrmoe.sim.report import table_md
from lrmoe.sim.run import Projection, phase_key, simulate, warm_key
from lrmoe.sim.target import StepsToTarget
from lrmoe.sim.trace import rescale_counts, split_sources, zipf_counts
from lrmoe.sim.whatif import what_if, what_if_reference
from tests.helpers.pool import RankPool

CFG = MoEConfig(dim=32, ffn_dim=48, num_experts=8, top_k=2)
S = 4  # fp32
PARAMS = 3 * 32 * 48 * S


def _layer_peak(group, system, ratio, memory, slots, seed=0):
    """Run one forward+backward; return the layer's peak and what the accounting needs."""
    torch.manual_seed(seed)
    budget = ClusterBudget(memory_bytes=memory, slots=slots) if memory else None
    if system == "symi" and slots:
        budget = ClusterBudget(memory_bytes=1 << 40, slots=slots)
    layer = MoELayer(CFG, system=system, group=group, backward=BackwardConfig("lrm", ratio=ratio), budget=budget,
                     capacity_factor=1.0)
    rank = layer.rank
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(48, CFG.dim, generator=gen)
    x[:, 0] += 3.0  # a skewed router: some experts far above average
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=gen))
    st, pl = layer.last_stats, layer.placement
    chunk = None if layer.controller is None else layer.controller.forward_chunk_rows(pl, rank, st["recv_rows"])
    work = RankWork(st["recv_rows"], st["bwd_gemm_rows"], len(pl.slots[rank]), len(pl.owned(rank)), chunk,
                    layer.world, pl.num_copies > CFG.num_experts, keep=st.get("keep_mode") or "nothing")
    counts = st["counts_E"]
    return {"peak": st["peak_expert_side_bytes"], "work": work, "counts": counts, "kept": int(st["kept_E"].sum())}


# budget tight enough to chunk the forward and cut the quotas at world size 1
TIGHT = 2 * 8 * PARAMS + 96 * (2 * 32 * S + 8) + 30 * 4 * 48 * S


@pytest.mark.parametrize("system,ratio,memory", [
    ("static", 1.0, None), ("static-recompute", 1.0, None), ("lrmoe", 0.5, None), ("lrmoe", 1.0, TIGHT),
    ("lrmoe", 0.5, TIGHT), ("symi", 1.0, None), ("capacity", 1.0, None), ("masked", 0.5, None),
])
def test_memory_accounting_matches_layer_world1(system, ratio, memory):
    r = _layer_peak(None, system, ratio, memory, None)
    w = r["work"]
    # the rows the accounting sees follow from routing alone, not from the layer's stats
    assert w.fwd_rows == (int(torch.clamp(r["counts"], max=math.ceil(96 / 8)).sum()) if system == "capacity" else 96)
    if system == "lrmoe" and memory is None:
        assert w.bwd_rows == int(fixed_ratio_quota(r["counts"], ratio).sum())
    if memory is not None:
        assert w.chunk_rows < w.fwd_rows  # the budget really chunks the forward
    assert expert_side_peak(system, CFG.dim, CFG.ffn_dim, S, w) == r["peak"]


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=2)
    yield p
    p.close()


@pytest.mark.parametrize("system,ratio,memory,slots", [
    ("static", 1.0, None, None), ("static-recompute", 1.0, None, None), ("symi", 1.0, None, 6),
    ("lrmoe", 0.5, None, None), ("lrmoe", 0.5, 18 * PARAMS + 60_000, 6),
    ("capacity", 1.0, None, None),
])
def test_memory_accounting_matches_layer_world2(pool, system, ratio, memory, slots):
    """Two ranks: regrouped receive buffers, replicas and their gradient send buffer."""
    results = pool.run(2, _layer_peak, system, ratio, memory, slots)
    if slots:  # replicas really exist (on some rank)
        assert any(r["work"].copies > r["work"].owned for r in results)
    for r in results:
        assert expert_side_peak(system, CFG.dim, CFG.ffn_dim, S, r["work"]) == r["peak"]


def test_rescale_preserves_pairs_and_skew():
    rng = np.random.default_rng(0)
    trace = rng.gamma(1.0, size=16) * 100
    tokens, K = 4096 * 8, 8
    c = rescale_counts(trace, 128, tokens, K)
    assert c.sum() == tokens * K and c.max() <= tokens and c.min() >= 0
    shares = trace / trace.sum()
    assert c.reshape(16, 8).sum(1) / c.sum() == pytest.approx(shares, abs=1e-4)  # same load per trace expert
    z = zipf_counts(3, 2, 128, tokens, K, exponent=1.0)
    assert (z.sum(-1) == tokens * K).all() and z.max() <= tokens  # capped at one pick per token
    assert (split_sources(c, 8).sum(0) == c).all()


def test_steps_to_target_interpolation(tmp_path):
    doc = {"systems": {"static": {"steps_to_target": 400}, "symi": {"steps_to_target": 400},
                       "capacity": {"steps_to_target": None}, "lrmoe@0.5": {"steps_to_target": None},
                       "lrmoe-sampled@0.5": {"steps_to_target": 500}, "lrmoe-sampled@0.25": {"steps_to_target": 700}}}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(doc))
    t = StepsToTarget.load(p)
    assert t.ratio("capacity") is None
    assert t.lrmoe_ratio("sampled", 0.5) == 1.25
    assert t.lrmoe_ratio("sampled", 0.75) == pytest.approx((500 + 400) / 2 / 400)
    assert t.lrmoe_ratio("sampled", 0.375) == pytest.approx(1.5)
    assert t.lrmoe_ratio("sampled", 0.1) is None  # no extrapolation
    assert t.lrmoe_ratio("lrm", 0.5) is None  # never reached: no number invented
    assert t.lrmoe_ratio("lrm", 0.75) is None


def _skewed_trace(path, steps=3, experts=16):
    """A trace with a hottest expert ~5x the mean, in a fixed expert order, with some noise."""
    rng = np.random.default_rng(1)
    zipf = 1000 / np.arange(1, experts + 1) ** 1.2
    order = rng.permutation(experts)
    counts = np.stack([[zipf[order] * rng.uniform(0.9, 1.1, experts) for _ in range(2)] for _ in range(steps)])
    np.savez_compressed(path, counts=counts.astype(np.float32))
    return path


def test_lrmoe_device_time_below_static_on_skewed_trace(tmp_path):
    trace = _skewed_trace(tmp_path / "routing.npz")
    cfg = SimConfig(model="qwen3-30b-a3b", gpus=16, memory_caps_gib=(200.0,), trace=str(trace), steps=3, layers=1,
                    tokens_per_gpu=4096, ratios=(0.5,))
    doc, _ = simulate(cfg, progress=False)
    rows = doc["caps"]["200"]
    lr = rows["lrmoe-local-sampled@0.5"]
    assert lr["kept_ratio"] < 0.55
    # device time (host planning, measured on this machine, left out): backward rows halved and
    # replicas spread the hot experts, at the price of refreshing them every step
    device = {n: r["device_step_ms"] for n, r in rows.items()}
    assert device["lrmoe-local-sampled@0.5"] <= device["static"]
    assert lr["layer_ms"]["bwd_a2a"] < rows["static"]["layer_ms"]["bwd_a2a"]
    assert lr["peak_expert_side_bytes"] < rows["static"]["peak_expert_side_bytes"]


KEYS = {"moe_time_to_target_s", "step_ms", "peak_expert_side_bytes"}


def test_cli_writes_table_and_results(tmp_path):
    out = tmp_path / "sim"
    main(["simulate", "--model", "all", "--gpus", "32", "--gpu-memory", "60,100", "--steps", "2", "--layers", "1",
          "--tokens-per-gpu", "256", "--quiet", "--out", str(out)])
    doc = json.loads((out / "results.json").read_text())
    assert set(doc) == {"qwen3-30b-a3b", "glm45-air", "_meta", "_what_if"}
    for model in ("qwen3-30b-a3b", "glm45-air"):
        assert set(doc[model]) == {"60", "100"}
        for cap in doc[model].values():
            assert {"static", "symi", "capacity", "lrmoe-local-sampled"} <= set(cap)
            for row in cap.values():
                assert set(row) >= KEYS
    table = (out / "table.md").read_text()
    assert "## qwen3-30b-a3b" in table and "## glm45-air" in table and "vs symi" in table
    assert "## What if" in table and set(doc["_what_if"]["qwen3-30b-a3b"]["60"]["lrmoe-local-sampled"]) == \
        {"against", "1.00", "1.05", "measured"}
    assert (out / "memory_sensitivity.png").stat().st_size > 0 and (out / "bandwidth_sensitivity.png").exists()
    # lrmoe's first replica-count search is one-time planning, apart from the step's host time
    for model in ("qwen3-30b-a3b", "glm45-air"):
        rows = doc[model]["100"]
        assert rows["lrmoe-local-sampled"]["host_once_ms"] > 0 and rows["symi"]["host_once_ms"] == 0


@pytest.mark.parametrize("argv,needle", [
    (["--model", "gpt5", "--gpus", "8", "--gpu-memory", "80"], "unknown model"),
    (["--model", "qwen3-30b-a3b", "--gpus", "0", "--gpu-memory", "80"], "--gpus"),
    (["--model", "glm45-air", "--gpus", "8", "--gpu-memory", "4"], "too small"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory", "80,x"], "--gpu-memory"),
    (["--model", "qwen3-30b-a3b", "--gpus", "64", "--gpu-memory", "80", "--trace", "/nonexistent.npz"], "not found"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory", "80", "--objective", "time", "--late-floor", "0.6"],
     "--late-floor"),
    (["--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory", "80", "--objective", "time", "--late-floor", "0.6:x"],
     "--late-floor"),
])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(["simulate", *argv, "--quiet", "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_an_out_that_is_a_file_is_refused_before_the_simulation(tmp_path, capsys, monkeypatch):
    (tmp_path / "o").write_text("")
    monkeypatch.setattr("lrmoe.sim.run.project", lambda *a, **k: pytest.fail("simulated before checking --out"))
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu-memory", "80", "--quiet",
              "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "is a file, not a folder" in capsys.readouterr().err


def test_bad_trace_content(tmp_path):
    p = tmp_path / "bad.npz"
    np.savez_compressed(p, counts=np.zeros((2, 1, 4), np.float32))
    with pytest.raises(SimError, match="pairs in every step"):
        simulate(SimConfig(model="qwen3-30b-a3b", gpus=64, memory_caps_gib=(80.0,), trace=str(p)), progress=False)


# ---------------------------------------------------------------------------------- fair rules
def test_symi_slot_search_goes_upward_when_that_helps():
    """Qwen3-30B-A3B on 64 GPUs: symi's default (3 slots a rank) holds more step memory than 4
    slots (spreading the hottest experts shrinks the hottest rank's kept activations); at a cap
    between the two, the search must go upward from the default, not down."""
    cfg = SimConfig(model="qwen3-30b-a3b", gpus=64, memory_caps_gib=(64.0,), steps=2, layers=1)
    counts, layers, _ = routing_counts(cfg)
    proj = Projection(cfg, counts, layers, PlanningReference.load(), tqdm(disable=True))
    cands = proj.symi_candidates()
    default = next(c for c in cands if c["default"])
    above = [c for c in cands if c["slots"] > default["slots"] and c["step_peak_bytes"] < default["step_peak_bytes"]]
    assert above, "the case needs a slot count above the default with less step memory"
    cap = default["step_peak_bytes"] - 1  # the default does not fit, and fewer slots hold more (no replicas)
    best, note = Projection.best_symi(cands, cap)
    assert best["slots"] > default["slots"] and best["step_peak_bytes"] <= cap
    assert best["step_ms"] == min(c["step_ms"] for c in cands if c["step_peak_bytes"] <= cap)
    assert "fastest that fits" in note
    # with room for every count, the fastest overall wins (here also above the default)
    roomy, _ = Projection.best_symi(cands, 1 << 50)
    assert roomy["step_ms"] == min(c["step_ms"] for c in cands)


def _small(**kw):
    base = dict(model="qwen3-30b-a3b", gpus=16, memory_caps_gib=(60.0,), steps=2, layers=1, tokens_per_gpu=1024)
    return SimConfig(**{**base, **kw})


def test_lrmoe_kept_ratio_comes_from_the_controller_at_the_cap():
    """No fixed ratio: the kept ratio is what the controller's quotas keep within the budget
    (here the network budget binds: half a balanced backward's bytes leaves room for half the
    pairs); --ratios only caps it."""
    rows = {}
    for nb, ratios in ((0.5, (1.0,)), (None, (1.0, 0.3))):
        doc, calls = simulate(_small(network_budget=nb, ratios=ratios), progress=False)
        rows[nb] = doc["caps"]["60"]
    tight, free = rows[0.5]["lrmoe-local-sampled"], rows[None]["lrmoe-local-sampled"]
    assert tight["kept_ratio"] == pytest.approx(0.5, abs=0.01)  # Σ capacities = half the pairs
    assert free["kept_ratio"] > 0.95  # nothing binds: (nearly) every pair kept
    assert rows[None]["lrmoe-local-sampled@0.3"]["kept_ratio"] <= 0.3 + 1e-3  # the ratio caps it
    assert "budget runs" in free["steps_source"] and "ratio runs" in rows[None]["lrmoe-local-sampled@0.3"][
        "steps_source"]
    # every call's kept pairs are the controller's quotas: recompute them from the planner's state
    cfg = _small(network_budget=0.5)
    counts, layers, _ = routing_counts(cfg)
    p = SystemPlanner("lrmoe", cfg.spec.moe_config(), cfg.gpus, memory_bytes=8 * GIB,
                      network_bytes=cfg.network_bytes, selection="local-sampled")
    for t in range(2):
        counts_SE = torch.from_numpy(split_sources(counts[t, 0], cfg.gpus))
        planner = p.planner
        placement = planner.placement
        expect = planner.controller.quotas(counts_SE.sum(0), placement, planner.controller.kept_capacity(placement))
        call = p.call(counts[t, 0], 2)
        assert call.copies_R.tolist() == [len(s) for s in placement.slots]  # planned on that placement
        assert call.kept_pairs == int(expect.sum()) < call.total_pairs


def test_first_replica_search_is_one_time_planning():
    """The call after which lrmoe's first (full) replica-count search runs carries it as
    ``once_host_s``, not in its host time; later calls' walking searches count as usual."""
    cfg = _small()
    counts = routing_counts(cfg)[0]
    spec, W = cfg.spec, cfg.gpus
    planner = SystemPlanner("lrmoe", spec.moe_config(), W, memory_bytes=40 * 2**30, selection="local-sampled")
    first = planner.call(counts[0, 0], 2)
    assert first.once_host_s > 0 and "plan_replicas" not in first.planner_calls, first.planner_calls
    later = [planner.call(counts[t % counts.shape[0], 0], 2) for t in range(1, 11)]
    assert all(c.once_host_s == 0 for c in later)
    assert later[7].planner_calls["assign_min_peak"] == 1
    assert later[8].planner_calls["assign_min_peak"] == 2, "the 10th step's walk (one plan scored) counts in its call"


def test_selection_exchange_bytes():
    """local-sampled (the default) and local exchange nothing at all (lrmoe.selection.strata), and their
    keep-x dy rows carry 4-byte positions instead of a kept byte per forward row; the global
    selections all-gather their non-finite counts, then sampled every score, lrm its
    candidates."""
    from lrmoe.sim.cost import exchanges

    cfg = _small()
    counts = routing_counts(cfg)[0][0, 0]
    spec, W, E = cfg.spec, cfg.gpus, cfg.spec.num_experts
    row = spec.dim * 2
    got = {}
    for selection in ("local-sampled", "local", "sampled", "lrm", "random"):
        call = SystemPlanner("lrmoe", spec.moe_config(), W, ratio=0.5, selection=selection).call(counts, 2)
        assert call.keep == "x+acts"
        every = exchanges(call, spec, 2)
        select = [b for phase, b in every if phase == "select"]
        backward = [b for phase, b in every if phase == "bwd_a2a"]
        if selection.startswith("local"):
            assert not select and len(backward) == 2, "dy (with positions) out, dx back"
            assert (backward[0] == call.bwd_SR * (row + 4)).all() and (backward[1] == call.bwd_SR.T * row).all()
            got[selection] = 0
            continue
        counts_gather = np.full((W, W), E * 8)
        got[selection] = sum(int(b.sum()) for b in select) - int(counts_gather.sum())
        assert any((b == counts_gather).all() for b in select)  # the non-finite counts, E int64 a rank
        assert len(backward) == 3 and (backward[2] == call.fwd_SR).all(), "dy, dx, a kept byte per forward row"
    pairs = 1024 * spec.top_k
    assert got["sampled"] == W * W * pairs * 8  # every rank's every score to every rank
    # lrm and random send each rank's best min(q_e, c_e,r) keys: every pair here, where a rank's
    # share of an expert (1/16 of it) is below its quota (half of it)
    assert 0 < got["lrm"] == got["random"] <= got["sampled"]


def test_headline_is_the_same_on_a_slow_host(monkeypatch):
    """Host planning comes from the recorded benchmark, not this machine's clock: a host whose
    timer runs 1000x slower changes the live diagnostic only."""
    import lrmoe.sim.layer_calls as sim_plan

    cfg = _small(memory_caps_gib=(60.0, 100.0))
    fast, _ = simulate(cfg, progress=False)
    clock = iter(range(10**9))
    monkeypatch.setattr(sim_plan, "time", SimpleNamespace(perf_counter=lambda: 1000.0 * next(clock)))
    slow, _ = simulate(cfg, progress=False)
    keys = ("moe_time_to_target_s", "device_time_to_target_s", "step_ms", "host_ms", "status")
    for cap in fast["caps"]:
        for name, row in fast["caps"][cap].items():
            assert {k: row.get(k) for k in keys} == {k: slow["caps"][cap][name].get(k) for k in keys}
            if row.get("host_ms"):
                assert slow["caps"][cap][name]["host_live_ms"] > 100 * row["host_live_ms"]
    assert fast["what_if"] == slow["what_if"]
    table = [table_md({"m": doc}) for doc in (fast, slow)]
    assert [line for line in table[0].splitlines() if "host_live" not in line] == table[1].splitlines()
    # host ms is the planner calls times the reference
    per_call, _ = PlanningReference.load().per_call_ms(cfg.spec.num_experts, cfg.gpus)
    symi = fast["caps"]["60"]["symi"]
    expect = sum(n * per_call[k] for k, n in symi["planner_calls_per_layer_call"].items()) * cfg.spec.moe_layers
    assert symi["host_ms"] == pytest.approx(expect)


def test_what_if_grid():
    lrmoe = {"status": "ok", "device_step_ms": 900.0, "host_ms": 480.0, "steps_ratio": 1.1}
    symi = {"status": "ok", "device_step_ms": 1000.0, "host_ms": 96.0, "steps_ratio": 1.0}
    grid = what_if(lrmoe, symi, moe_layers=48)
    assert grid["1.00"]["0"] == pytest.approx(10.0)
    assert grid["1.05"]["1 ms"] == pytest.approx(100 * (1048 - 948 * 1.05) / 1048)
    assert grid["measured"]["bench"] == pytest.approx(100 * (1096 - 1380 * 1.1) / 1096)
    assert what_if({**lrmoe, "steps_ratio": None}, symi, 48)["measured"]["0"] is None
    assert what_if(lrmoe, {**symi, "status": "oom"}, 48) == {}
    # where symi does not fit, the fastest other system that does; one that plans nothing pays no host time
    recompute = {"status": "ok", "device_step_ms": 1250.0, "host_ms": 0.0, "steps_ratio": 1.0,
                 "moe_time_to_target_s": 1250.0}
    rows = {"symi": {**symi, "status": "oom", "moe_time_to_target_s": None}, "static-recompute": recompute,
            "static": {"status": "oom", "moe_time_to_target_s": None}, "lrmoe-local-sampled": lrmoe}
    assert what_if_reference(rows) == "static-recompute"
    assert what_if(lrmoe, recompute, 48)["1.00"]["1 ms"] == pytest.approx(100 * (1250 - 948) / 1250)


def test_exact_systems_get_lrmoe_budget_search_where_their_step_does_not_fit():
    """Below static's uncapped step, the same per-layer budget search lrmoe has lets static's
    layers keep x alone and chunk, or keep nothing in rounds (the layer's own fitter): its row
    fits the cap, with its exact steps. (symi gets the search too, at its default slots; at this
    shape those slots leave no budget above the owned experts and states.)"""
    roomy = simulate(_small(memory_caps_gib=(1000.0,)), progress=False)[0]["caps"]["1000"]
    need = roomy["static"]["step_peak_bytes"]
    cap_gib = round(0.94 * need / GIB, 2)  # above the owned experts' and states' 28.9 GiB
    rows = simulate(_small(memory_caps_gib=(cap_gib,)), progress=False)[0]["caps"][f"{cap_gib:g}"]
    for name in ("static",):
        row = rows[name]
        assert row["status"] == "ok" and row["step_peak_bytes"] <= cap_gib * GIB, (name, row)
        assert "uncapped step over the cap; per-layer budget" in row["note"], row["note"]
        assert set(row["keep_modes"]) & {"x", "nothing"} and row["steps_ratio"] == roomy[name]["steps_ratio"]
        assert row["step_ms"] > roomy[name]["step_ms"]  # the recompute costs time
        assert row["budget_search"]["trials"]


def test_the_time_objective_trims_where_dropping_costs_no_steps():
    """lrmoe's planner in the projection takes the training objective: with dropping free
    (drop_cost 0) an ample budget still keeps about min_ratio of the pairs, with the memory
    objective every one."""
    cfg = _small()
    counts = routing_counts(cfg)[0]
    spec, W = cfg.spec, cfg.gpus

    def kept(objective: BackwardConfig) -> float:
        planner = SystemPlanner("lrmoe", spec.moe_config(), W, memory_bytes=40 * 2**30, selection="local-sampled",
                                backward=objective)
        call = planner.call(counts[0, 0], 2)
        return call.kept_pairs / call.total_pairs

    assert kept(BackwardConfig()) == 1.0
    assert 0.6 <= kept(BackwardConfig(objective="time", drop_cost=0.0, min_ratio=0.6)) < 0.62


def test_a_warm_phase_weights_both_phases_by_their_steps():
    """--warm-share: lrmoe's row is its trimmed run's and its warm run's (the warm ratio, no
    time objective) weighted by their share of the steps — step time and kept ratio exactly so,
    memory the larger — and the steps are read at the weighted kept ratio."""
    timed = BackwardConfig(objective="time")
    name = "lrmoe-local-sampled"
    trimmed = simulate(_small(backward=timed), progress=False)[0]["caps"]["60"][name]
    warm = simulate(_small(backward=replace(timed, objective="memory"), ratios=(0.75,)),
                    progress=False)[0]["caps"]["60"][f"{name}@0.75"]
    doc, calls = simulate(_small(backward=replace(timed, warm_ratio=0.75), warm_share=0.3), progress=False)
    row = doc["caps"]["60"][name]
    assert trimmed["kept_ratio"] < warm["kept_ratio"] <= 0.75 + 1e-3  # the time objective trims further
    for key in ("step_ms", "kept_ratio", "host_ms"):
        assert row[key] == pytest.approx(0.3 * warm[key] + 0.7 * trimmed[key])
    assert row["step_peak_bytes"] == max(warm["step_peak_bytes"], trimmed["step_peak_bytes"])
    assert row["warm_phase"]["step_ms"] == pytest.approx(warm["step_ms"])
    assert row["steps_ratio"] < trimmed["steps_ratio"]  # more pairs kept: read nearer static's steps
    assert calls["60"][warm_key(name)] is not None
    assert doc["meta"]["warm_phase"] == {"share": 0.3, "ratio": 0.75, "balance": None}


def test_a_balanced_warm_phase_trims_only_the_overload():
    """--warm-balance: the warm run keeps what memory allows less the hottest ranks' overload —
    fewer pairs than the unbalanced warm run, more than its trimmed phase — and says so. (No
    network budget: the default one caps each rank near the balanced load already.)"""
    timed = BackwardConfig(objective="time")
    name = "lrmoe-local-sampled"

    def warm_of(backward: BackwardConfig) -> tuple[dict, dict]:
        doc, _ = simulate(_small(backward=backward, warm_share=0.3, network_budget=None), progress=False)
        return doc["caps"]["60"][name], doc["meta"]

    plain, _ = warm_of(timed)
    balanced, meta = warm_of(replace(timed, warm_balance=0.0))
    assert balanced["warm_phase"]["kept_ratio"] < plain["warm_phase"]["kept_ratio"]
    assert balanced["warm_phase"]["kept_ratio"] > balanced["kept_ratio"]
    assert meta["warm_phase"]["balance"] == 0.0


def test_later_floors_weight_each_phase_by_its_steps():
    """--late-floor: from its share of lrmoe's steps on, the time objective's floor is the given
    one; the row weights the warm phase, the main one and each floor's by their steps, and the
    lower floor keeps fewer pairs."""
    timed = BackwardConfig(objective="time", drop_cost=0.0)
    name = "lrmoe-local-sampled"

    def row_of(cfg: SimConfig) -> dict:
        return simulate(cfg, progress=False)[0]["caps"]["60"][name]

    warm, main, late = (row_of(_small(backward=b)) for b in
                        (replace(timed, objective="memory"), timed, replace(timed, min_ratio=0.3)))
    doc, calls = simulate(_small(backward=timed, warm_share=0.2, late_floors=((0.6, 0.3),)), progress=False)
    row = doc["caps"]["60"][name]
    assert late["kept_ratio"] < main["kept_ratio"] < warm["kept_ratio"]
    for key in ("step_ms", "kept_ratio", "host_ms"):
        assert row[key] == pytest.approx(0.2 * warm[key] + 0.4 * main[key] + 0.4 * late[key])
    assert [p["phase"] for p in row["phases"]] == ["main", "warm phase", "floor 0.3"]
    assert [p["share"] for p in row["phases"]] == pytest.approx([0.4, 0.2, 0.4])
    assert row["warm_phase"]["trimmed_kept_ratio"] == pytest.approx(main["kept_ratio"])
    assert calls["60"][phase_key(name, "floor 0.3")] is not None
    assert doc["meta"]["late_floors"] == [{"from_share": 0.6, "floor": 0.3}]


@pytest.mark.parametrize("late_floors,objective", [
    (((0.6, 0.3),), "memory"),     # a floor bounds the time objective only
    (((0.1, 0.3),), "time"),       # within the warm phase
    (((0.6, 0.3), (0.5, 0.2)), "time"),  # shares not increasing
    (((0.6, 1.5),), "time"),
    (((1.0, 0.3),), "time"),
])
def test_bad_later_floors_are_refused(late_floors, objective):
    with pytest.raises(SimError, match="late-floor"):
        _small(backward=BackwardConfig(objective=objective), warm_share=0.2, late_floors=late_floors)


def test_an_infinite_network_budget_is_refused():
    with pytest.raises(SimError, match="network-budget=inf"):
        _small(network_budget=float("inf"))


@pytest.mark.parametrize("share", [-0.1, 1.0, True])
def test_a_bad_warm_share_is_refused(share):
    with pytest.raises(SimError, match="warm-share"):
        _small(warm_share=share)
