"""benchmarks/headline.py: which system is the best exact one at a cap, and lrmoe's ratio to it
split into steps × per step, from synthetic ``lrmoe compare --seeds`` folders."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.benchmarks import import_script

CAP = 70_000_000


@pytest.fixture(scope="module")
def headline():
    return import_script("headline")


def entry(steps: int | None, time_s: float | None, peak: int = CAP // 2, kept: float = 1.0) -> dict:
    return {"status": "reached" if steps else "not reached", "steps_to_target": steps,
            "moe_time_to_target_s": time_s, "mean_kept_ratio": kept, "memory_cap_bytes": CAP,
            "peak_expert_side_bytes": peak}


def write_seed(folder, seed: int, systems: dict) -> None:
    sub = folder / f"seed-{seed}"
    sub.mkdir(parents=True, exist_ok=True)
    (sub / "results.json").write_text(json.dumps({"systems": systems}))


def test_the_best_exact_system_and_lrmoes_ratio_to_it(headline, tmp_path):
    for seed, (static_t, lrmoe_steps) in enumerate(((80.0, 160), (70.0, 170))):
        write_seed(tmp_path / "a", seed, {
            "static-uncapped": entry(160, 50.0, peak=2 * CAP),  # faster, but its peak does not fit the cap
            "static": entry(160, static_t),
            "static-recompute": entry(165, 90.0),
            "symi": entry(160 if seed == 0 else None, 40.0 if seed == 0 else None),  # missed seed 1
            "capacity": entry(150, 45.0),  # drops in the forward: never exact
            "lrmoe": entry(lrmoe_steps, 0.75 * static_t, kept=0.6)})
    cap = headline.compare_cap(headline.per_seed([tmp_path / "a"]), "lrmoe", "capacity")
    assert cap["best_exact"] == "static"
    assert sorted(cap["exact_candidates"]) == ["static", "static-recompute"]
    v = cap["vs_best_exact"]
    assert v["time_ratio"] == pytest.approx(0.75)
    assert v["steps_ratio"] == pytest.approx(165 / 160)
    assert v["per_step_ratio"] == pytest.approx(0.75 / (165 / 160))
    assert v["per_seed_time_ratio"] == pytest.approx({0: 0.75, 1: 0.75})
    assert cap["vs_dropping"]["system"] == "capacity"


def test_a_later_folder_wins_and_the_script_writes_its_outputs(headline, tmp_path, monkeypatch, capsys):
    write_seed(tmp_path / "a", 0, {"static": entry(160, 80.0), "lrmoe": entry(160, 60.0)})
    write_seed(tmp_path / "b", 0, {"lrmoe": entry(165, 50.0)})  # a rerun of lrmoe alone
    write_seed(tmp_path / "b", 1, {"static": entry(165, 70.0), "lrmoe": entry(160, 55.0)})
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["headline.py", "--cap", f"0.65x={tmp_path / 'a'},{tmp_path / 'b'}",
                                      "--out", str(out)])
    headline.main()
    doc = json.loads((out / "headline.json").read_text())
    lrmoe = doc["caps"]["0.65x"]["systems"]["lrmoe"]
    assert lrmoe["per_seed"]["0"]["steps"] == 165 and lrmoe["steps"]["mean"] == pytest.approx(162.5)
    assert doc["caps"]["0.65x"]["vs_best_exact"]["time_ratio"] == pytest.approx(52.5 / 75.0)
    assert (out / "headline.png").stat().st_size > 0
    assert "0.700× (30.0 % less)" in capsys.readouterr().out


def test_wall_time_beside_moe_time(headline, tmp_path, monkeypatch, capsys):
    """The best exact system by wall time may differ from the best by MoE time (llep's spill moves
    weights outside the MoE timer's share, say); lrmoe's wall ratio is read against each."""
    def timed(steps, moe_s, wall_s):
        return {**entry(steps, moe_s), "wall_time_to_target_s": wall_s}

    for seed in (0, 1):
        write_seed(tmp_path / "a", seed, {"static": timed(160, 80.0, 100.0), "llep": timed(160, 75.0, 110.0),
                                          "capacity": timed(155, 60.0, 90.0), "lrmoe": timed(165, 60.0, 95.0)})
    cap = headline.compare_cap(headline.per_seed([tmp_path / "a"]), "lrmoe", "capacity")
    assert (cap["best_exact"], cap["best_exact_wall"]) == ("llep", "static")
    assert cap["vs_best_exact"]["wall_ratio"] == pytest.approx(95 / 110)
    assert cap["vs_best_exact_wall"]["wall_ratio"] == pytest.approx(0.95)
    assert cap["vs_dropping"]["wall_ratio"] == pytest.approx(95 / 90)
    write_seed(tmp_path / "b", 0, {"static": entry(160, 80.0), "lrmoe": entry(165, 60.0)})  # no wall times
    assert headline.compare_cap(headline.per_seed([tmp_path / "b"]), "lrmoe", "capacity")["best_exact_wall"] is None
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["headline.py", "--cap", f"0.65x={tmp_path / 'a'}", "--out", str(out)])
    headline.main()
    text = capsys.readouterr().out
    assert "| 0.65x | static (best exact by wall) |" in text and "| 0.950× |" in text
    assert (out / "headline.png").stat().st_size > 0


def test_dropping_at_its_best_factor_symi_beside_and_the_strict_target_of_a_cap_sweep(headline, tmp_path):
    """A cap sweep's layout (seed-<s>/cap-LABEL/results.json): the best capacity factor is the
    one with the least mean MoE time that reached the target at every seed (1.0 missed one);
    ``--target strict`` reads results.json's ``strict``."""
    for seed in (0, 1):
        sub = tmp_path / f"seed-{seed}" / "cap-0.65x"
        sub.mkdir(parents=True)
        standard = {"static": entry(160, 80.0), "symi": entry(160, 90.0), "lrmoe": entry(165, 60.0),
                    "capacity@1.0": entry(170 if seed else None, 40.0 if seed else None),
                    "capacity@1.25": entry(165, 50.0), "capacity@1.5": entry(160, 55.0)}
        strict = {**standard, "lrmoe": entry(200, 75.0), "capacity@1.25": entry(205, 70.0)}
        (sub / "results.json").write_text(json.dumps({"systems": standard, "strict": {"systems": strict}}))
    drops = ("capacity@1.0", "capacity@1.25", "capacity@1.5")
    cap = headline.compare_cap(headline.per_seed([tmp_path], "0.65x"), "lrmoe", drops, ("symi",))
    assert cap["best_dropping"] == "capacity@1.25" and cap["vs_dropping"]["time_ratio"] == pytest.approx(1.2)
    assert cap["vs_symi"]["time_ratio"] == pytest.approx(60 / 90)
    strict = headline.compare_cap(headline.per_seed([tmp_path], "0.65x", "strict"), "lrmoe", drops, ("symi",))
    assert strict["best_dropping"] == "capacity@1.5" and strict["vs_dropping"]["time_ratio"] == pytest.approx(75 / 55)
    assert strict["vs_best_exact"]["steps_ratio"] == pytest.approx(200 / 160)
    (tmp_path / "seed-2").mkdir()
    (tmp_path / "seed-2" / "results.json").write_text(json.dumps({"systems": {}}))
    with pytest.raises(SystemExit, match="no strict target"):
        headline.per_seed([tmp_path], "0.65x", "strict")


def test_corrected_scales_a_later_folder_to_the_first_ones_pace(headline, tmp_path):
    """Runs of one seed made a session apart: the later folder's reference took 0.8× the MoE time
    a step (a faster machine), so its runs' times are read at 1/0.8× (and its wall times by the
    reference's wall pace); the first folder's stay as they are."""
    ref = {**entry(160, 40.0, peak=2 * CAP), "wall_time_to_target_s": 80.0}
    write_seed(tmp_path / "a", 0, {"static-uncapped": ref, "capacity": {**entry(150, 20.0),
                                                                        "wall_time_to_target_s": 60.0}})
    write_seed(tmp_path / "b", 0, {"static-uncapped": {**ref, "moe_time_to_target_s": 32.0,
                                                       "wall_time_to_target_s": 72.0},
                                   "lrmoe": {**entry(150, 16.0), "wall_time_to_target_s": 54.0}})
    folders = [tmp_path / "a", tmp_path / "b"]
    raw, fixed = headline.per_seed(folders), headline.per_seed(folders, corrected=True)
    assert raw[0]["lrmoe"]["moe_time_to_target_s"] == 16.0
    assert fixed[0]["lrmoe"]["moe_time_to_target_s"] == pytest.approx(16.0 / 0.8)
    assert fixed[0]["lrmoe"]["wall_time_to_target_s"] == pytest.approx(54.0 / 0.9)
    assert fixed[0]["capacity"] == raw[0]["capacity"]
    assert fixed[0]["static-uncapped"]["moe_time_to_target_s"] == pytest.approx(40.0)
    cap = headline.compare_cap(fixed, "lrmoe", "capacity")
    assert cap["vs_dropping"]["time_ratio"] == pytest.approx(1.0)
    (tmp_path / "c" / "seed-0").mkdir(parents=True)
    (tmp_path / "c" / "seed-0" / "results.json").write_text(json.dumps({"systems": {"lrmoe": entry(150, 1.0)}}))
    with pytest.raises(SystemExit, match="no uncapped reference"):
        headline.per_seed([tmp_path / "c"], corrected=True)
