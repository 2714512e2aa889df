"""``lrmoe compare --memory-caps``: cap parsing, one shared reference, every system run under
each cap, and the sweep's results (training replaced by a fake launcher: the plumbing is
under test here; tests/layer/test_memory_cap.py and tests/train/test_train.py cover capped runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lrmoe.train import compare, sweep, to_target
from lrmoe.train.config import ConfigError, from_dict
from lrmoe.train.launch import clear_outputs

REFERENCE_PEAK = 1000  # the fake reference's peak expert-side bytes


@pytest.mark.parametrize("text, want", [
    ("70000000", ("bytes", 70_000_000)), ("70MB", ("bytes", 70_000_000)), ("70_000_000", ("bytes", 70_000_000)),
    ("66.8MiB", ("bytes", int(66.8 * 2**20))), ("1.5GiB", ("bytes", 1.5 * 2**30)), ("0.8x", ("fraction", 0.8)),
    (" 2KB ", ("bytes", 2000))])
def test_parse_cap(text, want):
    assert sweep.parse_cap(text) == want


@pytest.mark.parametrize("text", ["abc", "70TB", "-1x", "0x", "0.5", ",", "1e2e3", "0.9x,0.9x"])
def test_parse_cap_rejects(text):
    with pytest.raises(ConfigError, match="--memory-caps"):
        sweep.parse_caps(text)


def test_a_tiny_fraction_of_the_peak_is_a_cap_of_one_byte_not_none():
    assert sweep.cap_bytes("1e-12x", REFERENCE_PEAK) == 1 and sweep.cap_bytes("0.5x", REFERENCE_PEAK) == 500


def fake_launch(calls: list):
    """A launcher that writes a run: the reference evaluates 3, 2, 1 at steps 1-3; a system under
    a cap below the reference's peak runs out of memory at step 2 if it is ``static``, reaches
    the target at step 2 otherwise; MoE time 1 s a step."""

    def launch(cfg, out: Path, max_steps=None, stop_at=None, eval_at=(), **kw):
        out.mkdir(parents=True, exist_ok=True)
        cap = cfg.budget.memory_bytes if cfg.budget is not None else None
        calls.append((out.name, cfg.train.system, cap))
        rows = []
        for step in (1, 2, 3):
            if cap is not None and cap < REFERENCE_PEAK and cfg.train.system == "static" and step == 2:
                rows.append({"step": 2, "oom": "rank 0: memory budget exceeded"})
                break
            rows.append({"step": step, "moe_time_s": float(step), "kept_ratio": 1.0, "load_cv": [0.5],
                         "peak_expert_side_bytes": REFERENCE_PEAK if cap is None else min(cap, REFERENCE_PEAK),
                         "val_loss": 4.0 - step})
            if stop_at is not None and rows[-1]["val_loss"] <= stop_at:
                break
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "config.toml").write_text("")
        summary = {"unigram_loss": 5.0, "steps": rows[-1]["step"]}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary

    return launch


def faked(monkeypatch) -> tuple[list, object]:
    """(the launches made, a 3-step config) with :func:`fake_launch` in place of training."""
    calls = []
    monkeypatch.setattr(compare, "launch", fake_launch(calls))
    monkeypatch.setattr(sweep, "launch", fake_launch(calls))
    monkeypatch.setattr(compare, "plots", lambda *a, **k: None)
    return calls, from_dict({"train": {"steps": 3}, "compare": {"target_fraction": 0.67, "budget_factor": 1.0}})


def test_sweep_shares_the_reference_and_runs_every_system_under_each_cap(tmp_path, monkeypatch):
    calls, cfg = faked(monkeypatch)
    doc = sweep.run_sweep(cfg, ("static", "lrmoe"), ["0.5x", "2KB"], tmp_path)

    assert calls[0] == ("static-uncapped", "static", None), "the reference runs first, without a cap"
    assert sum(1 for c in calls if c[0] == "static-uncapped") == 1, "one reference for every cap"
    assert sorted(c[1:] for c in calls[1:]) == [("lrmoe", 500), ("lrmoe", 2000), ("static", 500), ("static", 2000)]
    assert doc["reference_peak_bytes"] == REFERENCE_PEAK and doc["target_loss"] == 2.0
    assert [c["memory_cap_bytes"] for c in doc["caps"]] == [500, 2000]
    assert [r["status"] for r in doc["systems"]["static"]] == ["oom", "reached"]
    assert doc["systems"]["static"][0]["oom_step"] == 2
    assert [r["steps_to_target"] for r in doc["systems"]["lrmoe"]] == [2, 2]
    assert "static-uncapped" not in doc["systems"]
    assert doc["reference"]["name"] == "static-uncapped" and doc["reference"]["steps_to_target"] == 2
    assert json.loads((tmp_path / "sweep.json").read_text()) == doc
    assert (tmp_path / "sweep.png").stat().st_size > 0
    assert "oom@2" in sweep.sweep_table(doc)
    for folder in ("cap-0.5x", "cap-2KB"):
        assert (tmp_path / folder / "static-uncapped").is_symlink()
        assert json.loads((tmp_path / folder / "results.json").read_text())["systems"]["static-uncapped"]

    clear_outputs(tmp_path / "cap-0.5x")  # a cap's folder cleared: its link goes, the shared reference stays
    assert not (tmp_path / "cap-0.5x" / "static-uncapped").exists()
    assert (tmp_path / "static-uncapped" / "metrics.jsonl").exists()


def test_a_config_no_cap_may_take_stops_the_sweep_before_its_reference(tmp_path, monkeypatch):
    calls, cfg = faked(monkeypatch)
    forced = from_dict({"train": {"steps": 3}, "backward": {"keep": "x"}})
    with pytest.raises(ConfigError, match="backward.keep='x' with a memory cap"):
        sweep.run_sweep(forced, ("lrmoe",), ["0.5x"], tmp_path)
    assert calls == [], "nothing ran"


# ------------------------------------------------------------------- --seeds


def entry(status="reached", steps=None, time_s=None, **kw) -> dict:
    """A results.json entry as compare writes one (every key; the figures kw overrides)."""
    reached = status == "reached"
    r = {k: None for k in to_target.RESULT_KEYS}
    r.update(status=status, steps_to_target=steps if reached else None, moe_time_to_target_s=time_s if reached
             else None, steps_to_target_interp=steps - 2.5 if reached else None,
             moe_time_to_target_interp_s=time_s - 0.1 if reached else None,
             steps_to_target_resolution=5 if reached else None, final_val_loss=4.0, steps_run=steps or 900,
             a2a_bytes=1000, memory_cap_bytes=None, oom_step=None)
    r.update(kw)
    return r


def test_seed_entry_mean_and_spread():
    every = sweep.seed_entry([entry(steps=480, time_s=24.0, wall_time_to_target_s=60.0),
                              entry(steps=490, time_s=25.0, a2a_bytes=4000, wall_time_to_target_s=70.0),
                              entry(steps=500, time_s=29.0, steps_to_target_resolution=4, wall_time_to_target_s=80.0)])
    assert every["status"] == "reached" and every["seeds_run"] == every["seeds_reached"] == 3
    assert every["steps_to_target"] == every["steps_to_target_mean"] == 490
    assert every["steps_to_target_std"] == pytest.approx(10.0), "sample std (n - 1): 10, not 8.16"
    assert (every["steps_to_target_min"], every["steps_to_target_max"]) == (480, 500)
    assert every["moe_time_to_target_s"] == pytest.approx(26.0) and every["moe_time_to_target_s_max"] == 29.0
    assert every["moe_time_to_target_s_std"] == pytest.approx(2.6457513)
    assert every["steps_to_target_interp_mean"] == pytest.approx(487.5)
    assert every["a2a_bytes"] == 2000 and every["steps_to_target_resolution"] == 5, "coarsest of the seeds"
    assert every["wall_time_to_target_s"] == every["wall_time_to_target_s_mean"] == pytest.approx(70.0)
    assert every["wall_time_to_target_s_std"] == pytest.approx(10.0)

    some = sweep.seed_entry([entry(steps=480, time_s=24.0), entry("never"), entry(steps=500, time_s=26.0)])
    assert some["status"] == "never" and some["seeds_reached"] == 2 and some["seeds_run"] == 3
    assert some["steps_to_target"] is None and some["moe_time_to_target_s"] is None, "not every seed reached it"
    assert some["steps_to_target_resolution"] is None and some["moe_time_to_target_interp_s"] is None
    assert (some["steps_to_target_mean"], some["steps_to_target_min"], some["steps_to_target_max"]) == (490, 480, 500)
    assert some["steps_to_target_std"] == pytest.approx(14.142136)

    oom = sweep.seed_entry([entry("oom", oom_step=40), entry("never"), entry("oom", oom_step=17)])
    assert oom["status"] == "oom" and oom["oom_step"] == 17 and oom["seeds_reached"] == 0
    assert oom["steps_to_target_mean"] is None and oom["steps_to_target_std"] is None
    one = sweep.seed_entry([entry(steps=480, time_s=24.0)])
    assert one["steps_to_target_mean"] == 480 and one["steps_to_target_std"] is None, "no spread from one seed"


@pytest.mark.parametrize("text", ["", "a,b", "0,0", "-1", "1,,x", "99999999999999999999"])
def test_parse_seeds_rejects(text):
    with pytest.raises(ConfigError, match="--seeds"):
        sweep.parse_seeds(text)


def test_seeds_run_every_system_per_seed(tmp_path, monkeypatch):
    from lrmoe.sim.target import StepsToTarget
    from tests.helpers.compare import FakeRuns, curve

    runs = FakeRuns()
    monkeypatch.setattr(compare, "launch", runs)
    monkeypatch.setattr(compare, "plots", lambda *a, **k: None)
    assert sweep.parse_seeds(" 0, 1,2 ") == (0, 1, 2)
    cfg = from_dict({"train": {"steps": 30, "eval_every": 10, "seed": 7}, "backward": {"seed": 7},
                     "compare": {"target_fraction": 0.8, "budget_factor": 2.0}})
    seeded = sweep.seed_config(cfg, 2)
    assert (seeded.train.seed, seeded.backward.seed, seeded.compare.seeds) == (2, 2, ())
    doc = sweep.run_seeds(cfg, ("static", "symi"), (0, 1, 2), tmp_path)

    assert [(c["folder"], c["seed"]) for c in runs.calls if not c["resume"]] == \
        [(n, s) for s in (0, 1, 2) for n in ("static", "symi")], "every system once per seed"
    assert doc["seeds"] == [0, 1, 2] and doc["target_losses"] == {str(s): curve(24, s) for s in (0, 1, 2)}
    for s in (0, 1, 2):  # each seed a whole comparison of its own
        one = json.loads((tmp_path / f"seed-{s}" / "results.json").read_text())
        assert one["target_loss"] == curve(24, s) and doc["per_seed"][str(s)] == one["systems"]
    symi = doc["systems"]["symi"]
    assert symi["status"] == "reached" and symi["seeds_reached"] == 3 and symi["steps_to_target_mean"] == 25
    assert symi["steps_to_target_std"] == 0 and symi["moe_time_to_target_s_mean"] == pytest.approx(2.5)
    assert json.loads((tmp_path / "results.json").read_text()) == doc
    report = (tmp_path / "report.md").read_text()
    assert "| symi | 3/3 | 25.0 [25.0–25.0] | 0.0 | 2.50 [2.50–2.50] | 0.00 |" in report
    assert "sample standard deviation" in report
    # the seeds' results.json keeps single-seed readers working (lrmoe simulate --compare)
    assert StepsToTarget.load(tmp_path / "results.json").systems["symi"] == 25


def test_sweep_over_seeds_aggregates_each_cap_and_names_the_best_exact_system(tmp_path, monkeypatch):
    from lrmoe.train.sweep_seeds import run_seed_sweeps

    calls, cfg = faked(monkeypatch)
    doc = run_seed_sweeps(cfg, ("static", "lrmoe"), ["0.5x", "2KB"], (0, 1), tmp_path)

    assert sum(1 for c in calls if c[0] == "static-uncapped") == 2, "one reference a seed"
    for s in (0, 1):
        one = json.loads((tmp_path / f"seed-{s}" / "sweep.json").read_text())
        assert one["systems"]["static"][1]["status"] == "reached" and one["systems"]["static"][0]["status"] == "oom"
    assert doc["seeds"] == [0, 1] and [c["label"] for c in doc["caps"]] == ["0.5x", "2KB"]
    assert [c["per_seed"] for c in doc["caps"]] == [[500, 500], [2000, 2000]]
    static, lrmoe = doc["systems"]["static"], doc["systems"]["lrmoe"]
    assert static[0]["status"] == "oom" and static[0]["seeds_run"] == 2 and static[0]["seeds_reached"] == 0
    assert static[1]["status"] == "reached" and static[1]["steps_to_target_mean"] == 2
    assert lrmoe[1]["moe_step_ratio"] == pytest.approx(1.0) and len(lrmoe[1]["moe_step_ratio_per_seed"]) == 2
    assert doc["best_exact"] == [{"moe": None, "wall": None}, {"moe": "static", "wall": None}], \
        "lrmoe is never the best exact system, an oom never the best (and these fake runs time no wall)"
    assert json.loads((tmp_path / "sweep.json").read_text()) == doc
    report = (tmp_path / "report.md").read_text()
    assert "Best exact system: by MoE time static, by wall time -." in report
    assert "| static | 0/2 (oom at 2) |" in report and (tmp_path / "sweep.png").stat().st_size > 0


def test_a_strict_target_through_a_sweep_over_seeds(tmp_path, monkeypatch):
    """Each seed's comparison reads both targets off its runs; the seeds' sweep aggregates the
    strict one beside the standard one (sweep.json's ``strict``, report.md's second part)."""
    from lrmoe.train.sweep_seeds import run_seed_sweeps
    from tests.helpers.compare import FakeRuns, curve

    monkeypatch.setattr(compare, "launch", FakeRuns())
    monkeypatch.setattr(sweep, "launch", compare.launch)
    monkeypatch.setattr(compare, "plots", lambda *a, **k: None)
    cfg = from_dict({"train": {"steps": 50, "eval_every": 10}, "budget": {"ranks_per_node": 1},
                     "compare": {"target_fraction": 0.5, "strict_fraction": 0.9, "budget_factor": 2.0}})
    doc = run_seed_sweeps(cfg, ("symi",), ["2KB"], (0, 1), tmp_path)
    assert doc["systems"]["symi"][0]["steps_to_target_mean"] == 25
    strict = doc["strict"]
    assert strict["target_step"] == 45 and strict["target_loss"] == pytest.approx((curve(45, 0) + curve(45, 1)) / 2)
    symi = strict["systems"]["symi"][0]
    assert symi["steps_to_target_mean"] == 45 and symi["seeds_reached"] == 2
    one = json.loads((tmp_path / "seed-1" / "sweep.json").read_text())
    assert one["strict"]["systems"]["symi"][0]["steps_to_target"] == 45
    assert "# Strict target: the reference's validation loss at step 45" in (tmp_path / "report.md").read_text()
