"""``lrmoe compare``'s plots on fake system folders (no training): every figure is written, the
legend says each system's time to target, ``never`` or ``oom at step N``, and 16 systems give
figures of a bounded width."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lrmoe.train.report import Outcome, figures, legend_label, line_styles, outcome, plots, report, rolling_mean

FIGURES = ("val_loss_vs_moe_time.png", "kept_ratio.png", "expert_load.png")
TARGET = 4.5


def fake_run(folder: Path, steps: int, final_loss: float, kept: float = 1.0, oom_step: int | None = None,
             layers: int = 2, experts: int = 8, seed: int = 0) -> None:
    """A system folder: metrics.jsonl (val loss falling from 7 to ``final_loss``, an eval every 10
    steps; an out-of-memory run stops before ``oom_step`` and ends with its ``{"step", "oom"}``
    line) and routing.npz."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    rows = []
    for s in range(1, (steps if oom_step is None else oom_step - 1) + 1):
        r = {"step": s, "moe_time_s": 0.05 * s, "kept_ratio": float(min(1.0, kept + 0.1 * rng.random())),
             "load_cv": [0.5] * layers}
        if s % 10 == 0:
            r["val_loss"] = final_loss + (7.0 - final_loss) * np.exp(-s / (steps / 4))
        rows.append(r)
    if oom_step is not None:
        rows.append({"step": oom_step, "oom": "expert-side bytes over the cap"})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.toml").write_text(f"[backward]\nratio = {min(kept, 1.0)}\n\n[budget]\nmemory_bytes = 95000000\n")
    counts = rng.integers(0, 100, size=(len(rows) - (oom_step is not None), layers, experts)).astype(np.float32)
    np.savez_compressed(folder / "routing.npz", counts=counts)


def png_inches(path: Path, dpi: int = 120) -> tuple[float, float]:
    """A written figure's (width, height) in inches at the dpi ``plots`` saves with."""
    import matplotlib.image

    h, w = matplotlib.image.imread(path).shape[:2]
    return w / dpi, h / dpi


def test_legend_label():
    assert legend_label("lrmoe@0.5", Outcome(time_s=23.914, step=480)) == "lrmoe@0.5: 23.9 s (step 480)"
    assert legend_label("lrmoe-lrm", Outcome(time_s=1234.4, step=900)) == "lrmoe-lrm: 1234 s (step 900)"
    assert legend_label("static", Outcome(oom_step=17, final_val=6.1)) == "static: oom at step 17"
    assert legend_label("masked", Outcome(final_val=4.79031)) == "masked: never (final 4.790)"
    assert legend_label("masked", Outcome()) == "masked: never"
    assert legend_label("symi", Outcome(time_s=5.0, step=100, oom_step=120)) == \
        "symi: 5.0 s (step 100), then oom at step 120"


def test_outcome_reads_metrics_as_compare_does():
    records = [{"step": 10, "moe_time_s": 1.0, "val_loss": 5.0}, {"step": 20, "moe_time_s": 2.0, "val_loss": 4.4},
               {"step": 30, "moe_time_s": 3.0, "val_loss": 4.2}, {"step": 31, "oom": "over the cap"}]
    assert outcome(records, TARGET) == Outcome(time_s=2.0, step=20, oom_step=31, final_val=4.2)
    assert outcome(records[:1], TARGET) == Outcome(final_val=5.0)
    assert outcome([], TARGET) == Outcome()


def test_rolling_mean_keeps_length():
    np.testing.assert_allclose(rolling_mean(np.array([1.0, 0.0, 1.0, 0.0]), 2), [1.0, 0.5, 0.5, 0.5])
    assert len(rolling_mean(np.ones(7), 50)) == 7


def test_line_styles_distinct_for_16():
    styles = line_styles([f"s{i}" for i in range(16)])
    assert len({(s["color"], s["linestyle"]) for s in styles.values()}) == 16


def test_plots_with_oom_and_never(tmp_path):
    fake_run(tmp_path / "static-uncapped", 100, 4.3)  # reaches the target
    fake_run(tmp_path / "static", 100, 4.0, oom_step=18)  # out of memory before reaching it
    fake_run(tmp_path / "lrmoe@0.5", 150, 4.8, kept=0.5)  # never reaches it
    fake_run(tmp_path / "lrmoe-lrm", 120, 4.2, kept=0.7, layers=3)
    names = ["static-uncapped", "static", "lrmoe@0.5", "lrmoe-lrm"]
    plots(tmp_path, names, TARGET)
    for f in FIGURES:
        assert (tmp_path / f).stat().st_size > 0, f
    figs = figures(tmp_path, names, TARGET)
    labels = [t.get_text() for t in figs["val_loss_vs_moe_time.png"].legends[0].get_texts()]
    assert "static: oom at step 18" in labels
    assert any(t.startswith("lrmoe@0.5: never (final ") for t in labels), labels
    assert any(t.startswith("static-uncapped: ") and " s (step " in t for t in labels), labels
    assert any(t.startswith("lrmoe-lrm: ") and " s (step " in t for t in labels), labels
    kept = [t.get_text() for t in figs["kept_ratio.png"].legends[0].get_texts()]
    assert [k.split(" (")[0] for k in kept] == ["lrmoe@0.5", "lrmoe-lrm"], "only the selective systems"
    panels = [ax for ax in figs["expert_load.png"].axes if ax.get_label() != "<colorbar>" and ax.get_visible()]
    assert {ax.get_xlim() for ax in panels} == {(0.5, 150.5)}, "one step range across panels"
    assert len(panels[3].get_yticklabels()) == 3, "every MoE layer of lrmoe-lrm"
    assert any(ax.get_ylabel() == "share of the layer's pairs" for ax in figs["expert_load.png"].axes)
    for fig in figs.values():
        fig.clf()


def test_plots_when_every_system_keeps_everything(tmp_path):
    """No selective system and no routing.npz in one folder: figures are still written."""
    fake_run(tmp_path / "static", 30, 4.0)
    fake_run(tmp_path / "symi", 30, 4.1)
    (tmp_path / "symi" / "routing.npz").unlink()
    plots(tmp_path, ["static", "symi"], TARGET)
    for f in FIGURES:
        assert (tmp_path / f).exists(), f


@pytest.mark.parametrize("n", [16])
def test_plots_width_bounded_for_many_systems(tmp_path, n):
    names = [f"lrmoe-s{i}@0.5" if i % 2 else f"sys{i}" for i in range(n)]
    for i, name in enumerate(names):
        fake_run(tmp_path / name, 40 + 5 * i, 4.0 + 0.05 * i, kept=0.6 if i % 2 else 1.0, seed=i)
    plots(tmp_path, names, TARGET)
    for f in FIGURES:
        width, height = png_inches(tmp_path / f)
        assert width <= 20.5, (f, width)
        assert height <= 24, (f, height)


def test_the_target_is_placed_against_the_unigram_loss_on_the_right_side(tmp_path):
    doc = {"target_loss": 6.0, "unigram_loss": 5.0, "details": {}}
    assert "the target is 20.0% above it" in report(tmp_path, doc)
    assert "the target is 20.0% below it" in report(tmp_path, {**doc, "target_loss": 4.0})
