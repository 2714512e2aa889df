"""benchmarks/selection_variance.py: study labels (score power and p_min floor), and a tiny run
on configs/paper.toml's model: a backward that keeps every pair has no error; one that keeps half
(the ratio asked, not what the config's budget would force) has some in every expert gradient,
and its JSON holds what the table printed."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benchmarks import BENCH, import_script


@pytest.fixture(scope="module")
def bench():
    return import_script("selection_variance"), import_script("common")


def test_labels(bench):
    _, common = bench
    assert common.selection_variant("lrm") == {"selection": "lrm"}
    assert common.selection_variant("sampled^1") == {"selection": "sampled", "score_power": 1.0}
    assert common.selection_variant("local-sampled^0.5/0.1") == {"selection": "local-sampled", "score_power": 0.5,
                                                                 "p_min": 0.1}


def test_tiny_run(bench, tmp_path, monkeypatch):
    variance, _ = bench
    monkeypatch.chdir(BENCH.parent)
    out = tmp_path / "v.json"
    # paper.toml's budget would force about half the pairs on one process: the study lifts it
    rows = variance.main(["--config", "configs/paper.toml", "--warm-steps", "1", "--draws", "2", "--ratios", "1,0.5",
                          "--variants", "local-sampled^0.5,local-sampled^0/0.2", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    for label in ("local-sampled^0.5", "local-sampled^0/0.2"):
        whole = rows[f"{label}@1"]
        assert whole.pop("kept") == 1.0
        assert all(v < 1e-10 for v in whole.values()), "every pair kept: the full gradient (to rounding)"
        half = rows[f"{label}@0.5"]
        assert half["kept"] == pytest.approx(0.5, abs=0.01), "the ratio asked for, not what a budget would force"
        assert half["experts"] > 0.01
        assert {"L0.down_proj", "L0.gate_up_proj", "L0.dx", "upstream"} <= set(half)
