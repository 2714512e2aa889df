"""Losing nothing when things go wrong: non-finite values (a step skipped, or the run stopped),
crashes during a save, corrupt checkpoints, torn metrics lines, a rank killed mid-run."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from lrmoe.models import MoETransformer
from lrmoe.train import checkpoint
from lrmoe.train.config import load
from lrmoe.train.loop import train
from tests.helpers.train import config_file, losses, run_main, tiny, train_case

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


class _InfGradient(torch.autograd.Function):
    """Zero in the forward (the loss stays finite), an infinite gradient in the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.sum() * 0

    @staticmethod
    def backward(ctx, g):
        return torch.full(ctx.shape, float("inf"))


def _poison_loss(monkeypatch, at: int, change):
    real = MoETransformer.loss
    calls = {"n": 0}

    def loss(self, ids, tgt):
        total, ce = real(self, ids, tgt)
        calls["n"] += 1
        return (change(self, total) if self.training and calls["n"] == at else total), ce

    monkeypatch.setattr(MoETransformer, "loss", loss)


def test_infinite_gradient_with_a_finite_loss_is_skipped(tmp_path, monkeypatch):
    """The finiteness check reads the gradient norm: an infinite gradient behind a finite loss."""
    _poison_loss(monkeypatch, 2, lambda model, total: total + _InfGradient.apply(model.embed.weight))
    train(tiny(system="static", steps=2, nproc=1, eval_every=100), tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, True]


def test_finite_gradients_whose_norm_overflows_are_not_skipped(tmp_path, monkeypatch):
    """Gradients of ~1e25 are finite while their float32 sum of squares is not: the step runs."""
    _poison_loss(monkeypatch, 2, lambda model, total: total * 1e25)
    train(tiny(system="static", steps=2, nproc=1, eval_every=100), tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, False]
    assert recs[1]["grad_norm"] == float("inf")


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
    cfg = config_file(tmp_path, **kw)
    straight = tmp_path / "straight"
    pool2.run(2, train_case, kw, str(straight))
    faulty = tmp_path / "faulty"
    env_fault = {"LRMOE_FAULT_AT": "3:1"}  # rank 1 is SIGKILLed after step 3
    os.environ.update(env_fault)
    try:
        r = run_main("train", "--config", str(cfg), "--out", str(faulty), "--max-restarts", "1")
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
