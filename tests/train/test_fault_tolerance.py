"""Losing nothing when things go wrong: bad input, non-finite values, crashes during a save,
corrupt checkpoints, torn metrics lines, a rank killed mid-run."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.models import ModelConfig, MoETransformer
from lrmoe.train import checkpoint
from lrmoe.train.config import CompareConfig, ConfigError, TrainConfig, from_dict, load
from lrmoe.train.loop import train
from tests.test_train import _cli, _config_file, _main, losses, tiny, train_case

# ------------------------------------------------------------------- every field validated

BAD = [
    (MoEConfig, dict(dim=8, ffn_dim=8, num_experts=4, top_k=2), [
        ("dim", -1), ("ffn_dim", 0), ("num_experts", 0), ("top_k", 5), ("router", "tanh"),
        ("norm_topk_prob", "yes"), ("routed_scaling_factor", 0), ("n_group", 3), ("topk_group", 9),
        ("num_shared_experts", -1), ("shared_ffn_dim", 0), ("aux_loss_coef", -0.1), ("z_loss_coef", "x"),
        ("dtype", "int8")]),
    (BackwardConfig, {}, [("selection", "best"), ("ratio", 0), ("ratio", 2), ("seed", "s"), ("p_min", 0),
                          ("p_min", 1.5)]),
    (ClusterBudget, dict(memory_bytes=10), [("memory_bytes", 0), ("memory_bytes", [1, 0]), ("network_bytes", -5),
                                            ("slots", 0), ("ranks_per_node", 0), ("inter_node_gbps", 0),
                                            ("intra_node_gbps", "fast")]),
    (TrainConfig, {}, [("system", "fast"), ("steps", 0), ("batch", -2), ("lr", 0), ("weight_decay", -1),
                       ("warmup", -1), ("seed", -1), ("eval_every", 0), ("eval_batches", 0),
                       ("checkpoint_every", -1), ("nproc", 0), ("ep_size", 3), ("vocab_size", 100),
                       ("val_fraction", 0.9), ("bias_update_rate", -1), ("capacity_factor", 0),
                       ("replan_interval", 0), ("on_nonfinite", "ignore"), ("device", "tpu"),
                       ("routing_trace", "runs/x/routing.npz"), ("keep_checkpoints", 0)]),
    (CompareConfig, {}, [("systems", ("static", "warp")), ("target_fraction", 0), ("budget_factor", 0.5)]),
    (ModelConfig, {}, [("vocab_size", 0), ("dim", 0), ("n_layers", 0), ("n_heads", 3), ("seq_len", 0),
                       ("first_dense_layers", 9), ("dense_ffn_dim", 0)]),
]


@pytest.mark.parametrize("cls,base,field,value",
                         [(c, b, f, v) for c, b, cases in BAD for f, v in cases],
                         ids=lambda p: getattr(p, "__name__", str(p)))
def test_every_field_is_validated(cls, base, field, value):
    with pytest.raises(ValueError) as e:
        cls(**{**base, field: value})
    msg = str(e.value)
    shown = {str(value), repr(value), repr(list(value)) if isinstance(value, tuple) else repr(value)}
    assert field in msg and any(v in msg for v in shown), msg


@pytest.mark.parametrize("kwargs,field", [
    ({"system": "fastest"}, "system"), ({"capacity_factor": 0}, "capacity_factor"),
    ({"replan_interval": 0}, "replan_interval"), ({"load_ema": 1.0}, "load_ema"),
    ({"system": "static", "budget": ClusterBudget(10)}, "budget"),  # cannot hold its own experts
    ({"system": "topoep"}, "ranks_per_node"),
    ({"system": "static", "routing_trace": torch.ones(2, 4)}, "routing_trace"),
])
def test_layer_arguments_validated(kwargs, field):
    from lrmoe import MoELayer

    with pytest.raises(ValueError, match=field):
        MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=2), **kwargs)


def test_topoep_config_needs_topology():
    with pytest.raises(ConfigError, match="ranks_per_node"):
        from_dict({"train": {"system": "topoep"}})
    assert from_dict({"train": {"system": "topoep"}, "budget": {"ranks_per_node": 1}}).budget.node_of(2) == [0, 1]


def test_unknown_keys_are_rejected():
    for raw, needle in [({"train": {"stepz": 3}}, "stepz"), ({"trian": {}}, "trian"),
                        ({"model": {"moe": {"experts": 3}}}, "experts"), ({"model": {"preset": "big"}}, "big")]:
        with pytest.raises(ConfigError, match=needle):
            from_dict(raw)


@pytest.mark.parametrize("flag,value", [("--nproc", "0"), ("--steps", "-1"), ("--ep-size", "-2"),
                                        ("--max-restarts", "-1")])
def test_cli_flags_validated(tmp_path, flag, value):
    r = _main("train", "--config", str(_config_file(tmp_path)), flag, value)
    assert r.returncode == 2 and flag in r.stderr and value in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_compare_rejects_unknown_system(tmp_path):
    # through a process of its own, as a user runs it (tests/test_cli.py runs most commands in-process)
    r = _cli("compare", "--config", str(_config_file(tmp_path)), "--systems", "static,warp")
    assert r.returncode == 2 and "warp" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------- non-finite values


def _nan_at(monkeypatch, step_to_poison: int):
    real = MoETransformer.loss
    calls = {"n": 0}

    def loss(self, ids, tgt):
        total, ce = real(self, ids, tgt)
        calls["n"] += 1
        if self.training and calls["n"] == step_to_poison:
            total = total * float("nan")
        return total, ce

    monkeypatch.setattr(MoETransformer, "loss", loss)


def test_nonfinite_step_is_skipped_and_logged(tmp_path, monkeypatch, capsys):
    _nan_at(monkeypatch, 3)
    cfg = tiny(system="lrmoe", steps=3, nproc=1, checkpoint_every=2, eval_every=100, backward={"ratio": 0.5})
    train(cfg, tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, False, True]
    assert "step 3: non-finite" in capsys.readouterr().err
    a = checkpoint.read_tensors(checkpoint.step_folder(tmp_path, 2), "model/")
    b = checkpoint.read_tensors(checkpoint.step_folder(tmp_path, 3), "model/")
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a if a[k].is_floating_point() and "bias" not in k), \
        "a skipped step changes no parameter"


def test_nonfinite_stop(tmp_path, monkeypatch):
    _nan_at(monkeypatch, 2)
    cfg = tiny(system="static", steps=3, nproc=1, on_nonfinite="stop")
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step 2"):
        train(cfg, tmp_path)


# ------------------------------------------------------------------- checkpoints and metrics


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException

    real_save, real_write = checkpoint.dcp.save, filesystem._write_item
    calls = {"saves": 0, "writes": 0}

    def counting_save(*args, **kwargs):
        calls["saves"] += 1
        return real_save(*args, **kwargs)

    def failing_write(transforms, stream, data, write_item, *args):
        if calls["saves"] == 2:  # the second checkpoint: some tensors written, then the disk "dies"
            calls["writes"] += 1
            if calls["writes"] == 5:
                stream.write(b"partial")
                raise OSError("disk died")
        return real_write(transforms, stream, data, write_item, *args)

    monkeypatch.setattr(checkpoint.dcp, "save", counting_save)
    monkeypatch.setattr(filesystem, "_write_item", failing_write)
    cfg = tiny(system="static", steps=4, nproc=1, checkpoint_every=2, eval_every=100)
    with pytest.raises(CheckpointException, match="disk died"):
        train(cfg, tmp_path)
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text() == "2"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002", "step_0000004.tmp"]
    assert checkpoint.candidates(tmp_path) == [2]
    monkeypatch.setattr(filesystem, "_write_item", real_write)
    train(cfg, tmp_path, resume=True)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4], "a resume appends without duplicating steps"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002", "step_0000004"]


@pytest.mark.parametrize("damage", ["__0_0.distcp", ".metadata", "meta.json"])
def test_corrupt_checkpoint_falls_back_and_torn_metrics_line(tmp_path, capsys, damage):
    cfg = tiny(system="lrmoe", steps=4, nproc=1, checkpoint_every=2, eval_every=100, backward={"ratio": 0.5})
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "run")
    newest = tmp_path / "run" / "ckpt" / "step_0000004" / damage
    newest.write_bytes(newest.read_bytes()[:100])  # truncated
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.')  # a torn line from a crash
    train(cfg.with_train(steps=4), tmp_path / "run", resume=True)
    assert "unreadable" in capsys.readouterr().out
    assert losses(tmp_path / "run") == losses(tmp_path / "straight")
    for path in (tmp_path / "run" / "ckpt").glob("step_*/*"):
        path.write_bytes(b"junk")
    with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint"):
        checkpoint.load_latest(tmp_path / "run", lambda index, meta: {}, None, 0)


# ------------------------------------------------------------------- a rank killed mid-run


def test_rank_killed_restarts_from_checkpoint(pool2, tmp_path):
    """train.checkpoint_every is left at 0: with --max-restarts the run checkpoints every
    eval_every (2) steps, so the restarted ranks go on from step 2, not from step 0. The
    uninterrupted run to compare with trains the same config on the same two gloo ranks, in the
    test's pool rather than through torchrun (the same losses, bit for bit)."""
    kw = {"system": "lrmoe", "steps": 6, "eval_every": 2, "budget": {"memory_bytes": 300_000},
          "backward": {"ratio": 0.75}}
    cfg = _config_file(tmp_path, **kw)
    straight = tmp_path / "straight"
    pool2.run(2, train_case, kw, str(straight))
    faulty = tmp_path / "faulty"
    env_fault = {"LRMOE_FAULT_AT": "3:1"}  # rank 1 is SIGKILLed after step 3
    os.environ.update(env_fault)
    try:
        r = _main("train", "--config", str(cfg), "--out", str(faulty), "--max-restarts", "1")
    finally:
        os.environ.pop("LRMOE_FAULT_AT")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"exitcode: {-signal.SIGKILL}" in r.stderr, "the fault fired: rank 1 died of SIGKILL"
    assert len(losses(straight)) == 6
    assert losses(faulty) == losses(straight), "the restarted run ends where the uninterrupted one does"
    assert load(faulty / "config.toml").train.checkpoint_every == 2
    assert r.stderr.count("| 1/6 [") == r.stderr.count("| 2/6 [") == 1, "steps 1 and 2 ran once"
    assert [json.loads(line)["step"] for line in (faulty / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, 7))


def test_compare_system_configs_and_resume(tmp_path):
    import numpy as np

    from lrmoe.train import compare
    from lrmoe.train.config import dump_toml

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
