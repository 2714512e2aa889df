"""Training on the real corpus: every system learns, resume is exact, runs are deterministic,
pure data parallelism equals one rank with the doubled batch, user data, the GLM preset's bias
updates, and a memory cap that static cannot fit recorded as out of memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lrmoe.memory.bytes import ByteModel
from lrmoe.passes.stages import STAGES
from lrmoe.systems import SYSTEMS, spec_of
from lrmoe.train.config import from_dict
from lrmoe.train.loop import train
from tests.helpers.train import TINY, losses, records, tiny, train_case, write_text_folder


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_system_learns(pool2, tmp_path, system):
    kw = {"system": system, "steps": 10}
    if spec_of(system).selective:
        kw["backward"] = {"ratio": 0.5}
    if system == "topoep":
        kw["budget"] = {"ranks_per_node": 1}
    pool2.run(2, train_case, kw, str(tmp_path))
    ls = losses(tmp_path)
    assert len(ls) == 10 and all(np.isfinite(ls))
    assert np.mean(ls[-3:]) < np.mean(ls[:3]) - 0.2, ls
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("moe_fwd_ms", "moe_bwd_ms", "a2a_bytes", "kept_ratio", "load_cv", "peak_expert_side_bytes",
                "val_loss", "moe_time_s", "step_ms", "train_wall_s"):
        assert key in rec, key
    rows = records(tmp_path)
    walls = np.cumsum([r["step_ms"] for r in rows]) / 1e3
    assert np.allclose([r["train_wall_s"] for r in rows], walls), "train_wall_s adds up the steps' wall times"
    assert rec["moe_time_s"] < rec["train_wall_s"] <= rec["wall_s"], "the MoE layers are part of a step; the " \
        "step part of the run (its evaluations are not)"
    stages = rec["moe_stage_ms"]
    assert list(stages) == list(STAGES) and stages["fwd_compute"] > 0 and stages["bwd_compute"] > 0
    assert sum(v for k, v in stages.items() if k.startswith("fwd_")) <= rec["moe_fwd_ms"]  # a mean, a max
    counts = np.load(tmp_path / "routing.npz")["counts"]
    assert counts.shape == (10, 2, 4) and (counts.sum(-1) == 2 * 4 * 32 * 2).all()
    if system == "topoep":  # one rank per node: every byte crosses nodes
        assert rec["a2a_inter_bytes"] == rec["a2a_bytes"] > 0


def test_smartmoe_trains_from_a_recorded_trace(pool2, tmp_path):
    pool2.run(2, train_case, {"system": "static", "steps": 6}, str(tmp_path / "static"))
    trace = str(tmp_path / "static" / "routing.npz")
    pool2.run(2, train_case, {"system": "smartmoe", "steps": 6, "routing_trace": trace}, str(tmp_path / "smart"))
    rows = [json.loads(line) for line in (tmp_path / "smart" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(np.isfinite(r["loss"]) for r in rows)
    assert all(r["placement_bytes"] > 0 for r in rows[1:]), "replicas from the pool are refreshed every step"


def test_resume_equals_uninterrupted(pool2, tmp_path):
    """Bit for bit, under a cap that trims (sampled, kept x recomputed, replicas): what a call
    reads of earlier ones (whether the last backward kept the activations, which orders the
    forward's rows; the noise objective's sums) travels in the checkpoint."""
    kw = {"system": "lrmoe", "steps": 8, "replan_interval": 2, "budget": {"memory_bytes": 200_000}}
    pool2.run(2, train_case, kw, str(tmp_path / "straight"))
    pool2.run(2, train_case, kw, str(tmp_path / "split"), False, 4)
    pool2.run(2, train_case, kw, str(tmp_path / "split"), True)
    fields = ("loss", "grad_norm", "kept_ratio", "a2a_bytes", "keep_modes", "variance_ratio", "replica_slots")
    a, b = ([{k: r.get(k) for k in fields} for r in records(tmp_path / run)] for run in ("straight", "split"))
    assert len(a) == len(b) == 8 and a == b
    assert min(r["kept_ratio"] for r in b) < 1.0 and all("x+acts" not in r["keep_modes"] for r in b[1:]), \
        "the cap trims the backward and keeps less than the activations in this run"


def test_deterministic(pool2, tmp_path):
    kw = {"system": "symi", "steps": 5}
    pool2.run(2, train_case, kw, str(tmp_path / "a"))
    pool2.run(2, train_case, kw, str(tmp_path / "b"))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_pure_data_parallel_equals_one_rank_doubled_batch(pool2, tmp_path):
    # no Switch aux loss: it is computed on each rank's tokens, so it is not the doubled batch's
    common = {"system": "static", "steps": 5, "moe": {"aux_loss_coef": 0.0}}
    pool2.run(2, train_case, {**common, "ep_size": 1, "batch": 4}, str(tmp_path / "dp"))
    train_case(None, {**common, "nproc": 1, "batch": 8}, str(tmp_path / "one"))
    np.testing.assert_allclose(losses(tmp_path / "dp"), losses(tmp_path / "one"), rtol=0, atol=2e-5)
    dp, one = records(tmp_path / "dp"), records(tmp_path / "one")
    np.testing.assert_allclose([r["grad_norm"] for r in dp], [r["grad_norm"] for r in one], rtol=1e-4)
    assert [r["lr"] for r in dp] == [r["lr"] for r in one]


def test_grad_norm_counts_every_expert_once(pool2, tmp_path):
    """Two expert-parallel ranks see the same windows (one data-parallel replica), so their
    gradient is one rank's: the norm sums each rank's own experts once."""
    common = {"system": "static", "steps": 3, "batch": 4}
    pool2.run(2, train_case, common, str(tmp_path / "ep"))
    train_case(None, {**common, "nproc": 1}, str(tmp_path / "one"))
    ep, one = records(tmp_path / "ep"), records(tmp_path / "one")
    np.testing.assert_allclose([r["grad_norm"] for r in ep], [r["grad_norm"] for r in one], rtol=1e-4)


def test_user_text_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LRMOE_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "texts"
    write_text_folder(data)
    summary = train_case(None, {"system": "lrmoe", "steps": 3, "nproc": 1, "data": str(data), "vocab_size": 300,
                                "eval_every": 2, "backward": {"ratio": 0.5}}, str(tmp_path / "run"))
    assert summary["steps"] == 3 and [v["step"] for v in summary["val"]] == [2, 3]
    assert np.isfinite(summary["val"][-1]["loss"]) and set(summary["val"][-1]) == {"step", "loss", "moe_time_s"}
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    rows = records(tmp_path / "run")
    assert all(r["lr"] > 0 and np.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    assert [r["wall_s"] for r in rows] == sorted(r["wall_s"] for r in rows) and rows[-1]["wall_s"] == summary["wall_s"]
    # progress through tqdm: in a log (not a terminal), the bar's text as lines
    err = capsys.readouterr().err
    assert "3/3" in err and "loss=" in err and "val=" in err and "lr=" in err and "step/s" in err, err


# ``lrmoe train`` launching its ranks through a process of its own (the summary line, losses,
# config.toml, routing.npz, the checkpoint at the end): the first run of tests/train/test_cli.py,
# test_used_out_failed_resume_resume_and_overwrite.


def glm_case(group, out):
    import torch

    raw = json.loads(json.dumps(TINY))
    raw["model"] = {"preset": "glm45-tiny", "dim": 32, "n_heads": 2, "seq_len": 32,
                    "moe": {"ffn_dim": 32, "num_experts": 4, "top_k": 2}}
    raw["train"].update(steps=8, system="lrmoe", bias_update_rate=0.01)
    raw["backward"] = {"ratio": 0.5}
    from lrmoe.train import checkpoint

    mine, save = {}, checkpoint.save  # this rank's own tensors (the checkpoint keeps one copy of each)

    def spy(out, step, tensors, *args):
        mine.update(tensors)
        save(out, step, tensors, *args)

    checkpoint.save = spy
    try:
        train(from_dict(raw), Path(out), group)
    finally:
        checkpoint.save = save
    biases = [v for k, v in mine.items() if k.endswith("e_score_correction_bias")]
    if group is None or group.rank() == 0:  # rank 0 completes the folder after every rank's save returned
        saved = checkpoint.read_tensors(Path(out) / "ckpt" / "step_0000008", "model/")
        assert all(torch.equal(v, saved[k]) for k, v in mine.items() if k.endswith("e_score_correction_bias"))
    return [b.abs().sum().item() for b in biases]


def test_glm45_preset_trains_with_bias_updates(pool2, tmp_path):
    res = pool2.run(2, glm_case, str(tmp_path))
    assert len(res[0]) == 2, "glm45-tiny: first layer dense, two MoE layers"
    assert all(b > 0 for b in res[0]), "the correction bias moved"
    assert res[0] == res[1], "every data-parallel replica applies the same bias update"
    ls = losses(tmp_path)
    assert np.mean(ls[-3:]) < np.mean(ls[:3])


def test_memory_cap_oom_recorded(pool2, tmp_path):
    """Under a cap static cannot fit even in one-row rounds beside its experts, its run stops
    cleanly at step 1 as ``oom`` (summary, metrics, compare's results and report); lrmoe under a
    cap static fits only by recomputing trains within it, by trimming. (lrmoe's forward in
    rounds needs 8 bytes a row more than static's, its ‖h‖², so no cap refuses static and admits
    lrmoe.)"""
    from lrmoe.train.report import report
    from lrmoe.train.to_target import summarise

    pool2.run(2, train_case, {"system": "static", "steps": 2}, str(tmp_path / "free"))
    peak = max(json.loads(line)["peak_expert_side_bytes"] for line in (tmp_path / "free" / "metrics.jsonl")
               .read_text().splitlines())
    bm = ByteModel.of(tiny().model.moe, selective=False)
    cap = tiny().model.moe.num_experts // 2 * bm.slot + max(bm.round_forward(1), bm.round_backward(1)) - 1
    budget = {"memory_bytes": cap}
    summary = pool2.run(2, train_case, {"system": "static", "steps": 3, "budget": budget}, str(tmp_path / "static"))
    assert all(s["status"] == "oom" and s["oom_step"] == 1 and "memory budget" in s["oom"] for s in summary), summary
    lr_cap = int(0.45 * peak)
    lr = pool2.run(2, train_case, {"system": "lrmoe", "steps": 3, "budget": {"memory_bytes": lr_cap}},
                   str(tmp_path / "lrmoe"))
    assert lr[0]["status"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "lrmoe" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_expert_side_bytes"] <= lr_cap for r in rows) and rows[-1]["kept_ratio"] < 1.0
    results = {name: summarise(tmp_path / name, 0.0, c) for name, c in (("static", cap), ("lrmoe", lr_cap))}
    assert results["static"]["status"] == "oom" and results["static"]["oom_step"] == 1
    assert results["lrmoe"]["status"] == "never" and results["lrmoe"]["steps_run"] == 3
    doc = {"target_loss": 0.0, "unigram_loss": 1.0, "details": results}
    assert "| static | oom at step 1 |" in report(tmp_path, doc)


def test_capped_exact_system_records_its_keep_mode_and_chunks(pool2, tmp_path):
    """static under a cap below its peak trains by keeping by the row and chunking: every record
    says so (``keep_modes`` per layer, the fewest rows computed at once, the shares of its rows
    that kept activations, gate/up and x alone), within the cap."""
    pool2.run(2, train_case, {"system": "static", "steps": 2}, str(tmp_path / "free"))
    free = [json.loads(line) for line in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["keep_modes"] == ["x+acts"] * len(r["keep_modes"]) and "fwd_chunk_rows" not in r
               and "kept_parts" not in r for r in free)
    cap = int(0.45 * max(r["peak_expert_side_bytes"] for r in free))
    summary = pool2.run(2, train_case, {"system": "static", "steps": 2, "budget": {"memory_bytes": cap}},
                        str(tmp_path / "capped"))
    assert summary[0]["status"] == "done"
    rows = [json.loads(line) for line in (tmp_path / "capped" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["peak_expert_side_bytes"] <= cap and "x" in r["keep_modes"] for r in rows), rows
    assert all(min(r["bwd_chunk_rows"], r["fwd_chunk_rows"]) >= 1 for r in rows)
    assert all(len(r["kept_parts"]) == 3 and abs(sum(r["kept_parts"]) - 1) < 1e-9 and r["kept_parts"][2] < 1
               for r in rows), "some rows kept more than x"
