"""benchmarks/stages.py: per-system medians of the stage times in runs' metrics.jsonl, a system's
runs in several folders pooled, steps outside the range and records without stages skipped."""

from __future__ import annotations

import json

from lrmoe.passes.stages import STAGES
from tests.helpers.benchmarks import import_script


def write_run(folder, steps: dict[int, float]) -> None:
    """A run whose step s spends ``steps[s]`` ms in fwd_compute and 1 ms in every other stage."""
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": 0, "loss": 1.0})]  # an old record without stages
    for s, compute in steps.items():
        stage = {k: (compute if k == "fwd_compute" else 1.0) for k in STAGES}
        lines.append(json.dumps({"step": s, "moe_stage_ms": stage, "moe_fwd_ms": 10.0 + compute,
                                 "moe_bwd_ms": 20.0, "moe_placement_ms": 0.5 * s}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_medians_per_system_pooled_over_seed_folders(tmp_path):
    stages = import_script("stages")
    write_run(tmp_path / "seed-0" / "static", {1: 5.0, 2: 7.0, 3: 100.0})
    write_run(tmp_path / "seed-1" / "static", {1: 9.0, 2: 11.0})
    write_run(tmp_path / "seed-0" / "lrmoe", {1: 2.0, 2: 4.0})
    table = stages.stage_table([tmp_path / "seed-0", tmp_path / "seed-1"], 1, 2)
    assert set(table) == {"static", "lrmoe"}
    assert table["static"]["fwd_compute"] == 8.0 and table["static"]["steps"] == 4  # 5, 7, 9, 11: step 3 out
    assert table["static"]["bwd_select"] == 1.0
    assert table["static"]["placement"] == 0.75  # 0.5, 1.0, 0.5, 1.0
    assert table["lrmoe"]["step"] == 33.75  # (12 + 20 + .5, 14 + 20 + 1)
    assert stages.stage_table([tmp_path / "seed-0" / "lrmoe"], 1, 1)["lrmoe"]["fwd_compute"] == 2.0  # a run itself
