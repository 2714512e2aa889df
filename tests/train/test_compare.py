"""``lrmoe compare``'s systems (lrmoe.train.compare): each name's config (smartmoe with its trace,
``lrmoe-random@0.25``'s selection and ratio), which runs count as finished for a resume, and the
resolution of steps to target (dense evaluation where the target was crossed, on a synthetic
loss curve through a fake launcher; a real rerun repeats its run exactly)."""

from __future__ import annotations

import json

import pytest

from lrmoe.train import compare, to_target
from lrmoe.train.config import ConfigError, from_dict
from lrmoe.train.metrics import read_metrics
from tests.helpers.compare import FakeRuns, curve
from tests.helpers.train import tiny


def test_compare_system_configs_and_resume(tmp_path):
    import numpy as np

    from lrmoe.train.toml_dump import dump_toml

    cfg = from_dict({"budget": {"ranks_per_node": 1}})
    trace = tmp_path / "routing.npz"
    np.savez(trace, counts=np.ones((3, 2, 8)))
    smart = compare.system_config(cfg, "smartmoe", trace=trace)
    assert smart.train.system == "smartmoe" and smart.train.routing_trace == str(trace)
    assert compare.system_config(cfg, "smartmoe", trace=tmp_path / "none.npz").train.routing_trace == ""
    lr = compare.system_config(cfg, "lrmoe-random@0.25", trace=trace)
    assert (lr.train.system, lr.train.routing_trace, lr.backward.selection, lr.backward.ratio) == \
        ("lrmoe", "", "random", 0.25)
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.toml").write_text(dump_toml(lr.to_dict()))
    assert not compare.finished(lr, folder), "no summary: the run did not finish"
    (folder / "summary.json").write_text("{}")
    assert compare.finished(lr, folder) and not compare.finished(smart, folder)


# ------------------------------------------------------------------- steps to target: resolution


def run_fake_compare(tmp_path, monkeypatch, **compare_kw):
    runs = FakeRuns()
    monkeypatch.setattr(compare, "launch", runs)
    monkeypatch.setattr(compare, "plots", lambda *a, **k: None)
    cfg = from_dict({"train": {"steps": 30, "eval_every": 10},
                     "compare": {"target_fraction": 0.8, "budget_factor": 2.0, **compare_kw}})
    return runs, compare.run_compare(cfg, ("static", "symi"), tmp_path)


def test_crossing_and_interpolation_on_a_synthetic_curve():
    records = [{"step": s, "moe_time_s": 0.5 * s, **({"val_loss": curve(s)} if s % 10 == 0 else {})}
               for s in range(1, 41)]
    before, hit = to_target.crossing(records, 4.75)
    assert (before["step"], hit["step"]) == (20, 30)
    step, t = to_target.interpolate(records, 4.75, before, hit)
    assert step == pytest.approx(25.0) and t == pytest.approx(12.5), "4.80 at 20, 4.70 at 30: halfway"
    assert to_target.crossing(records, 4.5) is None
    before, hit = to_target.crossing(records, 4.95)
    assert before is None and hit["step"] == 10, "the first evaluation: no evaluation before it"
    assert to_target.interpolate(records, 4.95, before, hit) is None


@pytest.mark.parametrize("eval_every, steps, dense, want", [
    (10, 300, 5, (235, 240)), (25, 600, 5, (480,)), (10, 300, 0, (240,)), (10, 309, 5, (245, 247)),
    (25, 300, 5, (230, 235, 240))])
def test_reference_evaluates_densely_before_the_target_step(eval_every, steps, dense, want):
    cfg = from_dict({"train": {"steps": steps, "eval_every": eval_every},
                     "compare": {"target_fraction": 0.8, "dense_eval_every": dense}})
    assert compare.reference_eval_at(cfg) == want


def test_dense_evaluation_where_the_target_was_crossed(tmp_path, monkeypatch):
    """static's loss at step 24 (4.76) is the target. Evaluated every 10 steps, symi first meets
    it at step 30, after 20 (crossed in (20, 30]); rolled back to its checkpoint of step 20 and
    evaluated every 5 steps there, at step 25 (4.75 <= 4.76); step 23's dip lies between."""
    runs, doc = run_fake_compare(tmp_path, monkeypatch)
    ref, first, again = runs.calls
    assert ref["folder"] == "static" and ref["eval_at"] == (24,)  # (20, 24] is 4 steps already
    assert first["folder"] == "symi" and first["checkpoint_every"] == 10 and not first["resume"]
    assert again["folder"] == "symi" and again["resume"] and again["eval_at"] == (25, 30)
    assert again["stop_at"] == doc["target_loss"] == curve(24) and again["max_steps"] == 60
    symi = doc["systems"]["symi"]
    assert symi["status"] == "reached" and symi["steps_to_target"] == 25 and symi["steps_to_target_resolution"] == 5
    assert symi["moe_time_to_target_s"] == pytest.approx(2.5)
    assert symi["steps_to_target_interp"] == pytest.approx(24.0)  # 4.80 at 20, 4.75 at 25: 4.76 at 24
    assert symi["moe_time_to_target_interp_s"] == pytest.approx(2.4)
    assert symi["wall_time_to_target_s"] == pytest.approx(7.5) and symi["wall_ms_per_step"] == pytest.approx(300.0)
    detail = doc["details"]["symi"]
    assert detail["target_bracket"] == [20, 25]
    assert detail["dense_eval"] == {"every": 5, "interval": [20, 30], "from_step": 20, "rerun_steps": 5,
                                    "rerun_loss_max_abs_diff": 0.0}
    assert [r["step"] for r in read_metrics(tmp_path / "symi")] == list(range(1, 26)), "the rerun replaced 21-30"
    assert doc["systems"]["static"]["steps_to_target_resolution"] == 4
    assert json.loads((tmp_path / "results.json").read_text()) == doc
    text = (tmp_path / "report.md").read_text()
    assert "| symi | 25 | (20, 25] | 2.50 | 7.50 | 24.0 / 2.40 |" in text


def test_a_strict_target_is_read_off_the_same_runs(tmp_path, monkeypatch):
    """Targets at steps 25 (4.75) and 45 (4.55) of 50. symi runs to the first (crossed in
    (20, 30], read densely to 25), then on from that stop to the strict one (crossed in (40, 50],
    rolled back to its checkpoint of step 40 and read to 45); the dense reading of each is kept."""
    runs = FakeRuns()
    monkeypatch.setattr(compare, "launch", runs)
    monkeypatch.setattr(compare, "plots", lambda *a, **k: None)
    cfg = from_dict({"train": {"steps": 50, "eval_every": 10},
                     "compare": {"target_fraction": 0.5, "strict_fraction": 0.9, "budget_factor": 2.0}})
    assert compare.target_steps(cfg) == (25, 45) and compare.reference_eval_at(cfg) == (25, 45)
    doc = compare.run_compare(cfg, ("static", "symi"), tmp_path)
    ref, first, dense, on, strict_dense = runs.calls
    assert ref["eval_at"] == (25, 45) and first["stop_at"] == dense["stop_at"] == curve(25)
    assert dense["resume"] and dense["eval_at"] == (25, 30)
    assert on["resume"] and on["stop_at"] == strict_dense["stop_at"] == curve(45) and on["eval_at"] == ()
    assert strict_dense["resume"] and strict_dense["eval_at"] == (45, 50)
    strict = doc["strict"]
    assert strict["target_step"] == 45 and strict["target_loss"] == curve(45) and doc["target_loss"] == curve(25)
    assert doc["systems"]["symi"]["steps_to_target"] == 25 and strict["systems"]["symi"]["steps_to_target"] == 45
    assert strict["systems"]["symi"]["moe_time_to_target_s"] == pytest.approx(4.5)
    assert strict["systems"]["static"]["steps_to_target"] == 45
    assert doc["details"]["symi"]["dense_eval"]["interval"] == [20, 30]
    assert strict["details"]["symi"]["dense_eval"] == {"every": 5, "interval": [40, 50], "from_step": 40,
                                                       "rerun_steps": 5, "rerun_loss_max_abs_diff": 0.0}
    assert [r["step"] for r in read_metrics(tmp_path / "symi")] == list(range(1, 46))
    text = (tmp_path / "report.md").read_text()
    assert "## Strict target: 4.5500, the reference's validation loss at step 45" in text
    assert "| symi | 45 | (40, 45] | 4.50 |" in text and "| symi | 25 | (20, 25] | 2.50 |" in text


@pytest.mark.parametrize("fraction", [0.8, 0.5, 1.5])
def test_a_strict_target_must_come_after_the_target(fraction):
    with pytest.raises(ConfigError, match="compare.strict_fraction"):
        from_dict({"compare": {"target_fraction": 0.8, "strict_fraction": fraction}})


def test_without_dense_evaluation_the_resolution_is_eval_every(tmp_path, monkeypatch):
    runs, doc = run_fake_compare(tmp_path, monkeypatch, dense_eval_every=0)
    assert [c["folder"] for c in runs.calls] == ["static", "symi"] and runs.calls[1]["checkpoint_every"] == 0
    symi = doc["systems"]["symi"]
    assert (symi["steps_to_target"], symi["steps_to_target_resolution"]) == (30, 10)
    assert doc["details"]["symi"]["dense_eval"] is None


def test_dense_evaluation_without_a_checkpoint_starts_afresh(tmp_path, monkeypatch):
    """keep_checkpoints = 1 leaves no checkpoint at step 20: the rerun starts at step 0."""
    runs = FakeRuns()
    monkeypatch.setattr(compare, "launch", runs)
    cfg = from_dict({"train": {"steps": 30, "eval_every": 10, "keep_checkpoints": 1}})
    folder = tmp_path / "symi"
    runs(compare.with_dense_checkpoints(cfg), folder, max_steps=60, stop_at=curve(24))
    compare.refine(compare.with_dense_checkpoints(cfg), folder, curve(24), 60)
    assert not runs.calls[-1]["resume"] and runs.calls[-1]["eval_at"] == (25, 30)
    dense = json.loads((folder / "summary.json").read_text())["dense_eval"]
    assert dense["from_step"] == 0 and dense["rerun_steps"] == 25 and dense["rerun_loss_max_abs_diff"] == 0.0
    compare.refine(compare.with_dense_checkpoints(cfg), folder, curve(24), 60)
    assert len(runs.calls) == 2, "a crossing already measured to 5 steps is not rerun"


def test_a_real_rerun_repeats_its_run(tmp_path, monkeypatch):
    """One rank, static and lrmoe@0.5 (a sampled selection: its RNG streams restored from the
    checkpoint): the rerun from the checkpoint before the crossing repeats the first run's
    training losses bit for bit, and steps to target are read to 5 steps."""
    monkeypatch.setattr(compare, "plots", lambda *a, **k: None)
    cfg = tiny(nproc=1, steps=20, eval_every=10)
    doc = compare.run_compare(cfg, ("static", "lrmoe@0.5"), tmp_path)
    r = doc["details"]["lrmoe@0.5"]
    assert r["status"] == "reached" and r["steps_to_target_resolution"] <= 5, r
    dense = r["dense_eval"]
    assert dense is not None and dense["rerun_steps"] > 0 and dense["rerun_loss_max_abs_diff"] == 0.0, dense
    evals = [x["step"] for x in read_metrics(tmp_path / "lrmoe@0.5") if "val_loss" in x]
    assert r["steps_to_target"] == evals[-1] and evals[-1] - evals[-2] <= 5


def test_capacity_at_a_factor_runs_that_capacity_factor():
    """``capacity@1.0``: the forward drop at capacity factor 1.0 (Megatron-Core's workaround for
    MoE out-of-memory), beside the config's own (1.25 by default) in one comparison."""
    from lrmoe.systems import parse_system_name

    cfg = from_dict({})
    assert compare.system_config(cfg, "capacity").train.capacity_factor == 1.25
    one = compare.system_config(cfg, "capacity@1.0")
    assert (one.train.system, one.train.capacity_factor, one.backward) == ("capacity", 1.0, cfg.backward)
    assert compare.system_config(cfg, "capacity@1.5").train.capacity_factor == 1.5
    assert parse_system_name("capacity@1.5").capacity_factor == 1.5 and parse_system_name("capacity@1.5").ratio is None
    for bad in ("capacity@0", "capacity@-1", "capacity@x", "capacity@inf", "capacity-random", "static@1.0",
                "lrmoe-capacity@0"):
        with pytest.raises(ValueError, match="capacity factor"):
            parse_system_name(bad)
    both = compare.system_config(cfg, "lrmoe-capacity@1.0")  # lrmoe's backward over that forward drop
    assert (both.train.system, both.train.capacity_factor, both.backward) == ("lrmoe-capacity", 1.0, cfg.backward)
