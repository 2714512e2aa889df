"""``train.tensorboard = true``: every metrics.jsonl record also as TensorBoard scalars; without
the optional package, one line before any rank starts."""

from __future__ import annotations

import importlib.util

import pytest

from lrmoe.train.config import ConfigError, from_dict
from lrmoe.train.metrics import TensorBoardLog, scalars
from tests.helpers.train import config_file, run_cli

RECORD = {"step": 3, "loss": 4.5, "kept_ratio": 0.75, "load_cv": [0.5, 1.25], "skipped": False,
          "val_loss": 4.25, "a2a_bytes": 1024}


def test_scalars_flatten_a_record():
    assert scalars(RECORD) == {"loss": 4.5, "kept_ratio": 0.75, "load_cv/layer0": 0.5, "load_cv/layer1": 1.25,
                               "val_loss": 4.25, "a2a_bytes": 1024.0}
    assert scalars({"step": 1, "oom": "memory budget too small"}) == {}


class FakeWriter:
    def __init__(self) -> None:
        self.points, self.flushes, self.closed = [], 0, False

    def add_scalar(self, tag, value, step) -> None:
        self.points.append((tag, value, step))

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def test_log_writes_every_scalar_at_the_records_step(tmp_path):
    writer = FakeWriter()
    log = TensorBoardLog(tmp_path, writer)
    log.log(RECORD)
    log.log({**RECORD, "step": 4, "loss": 4.0})
    log.close()
    assert ("loss", 4.5, 3) in writer.points and ("loss", 4.0, 4) in writer.points
    assert ("load_cv/layer1", 1.25, 3) in writer.points
    assert len(writer.points) == 2 * len(scalars(RECORD)) and writer.flushes == 2 and writer.closed


def test_config_takes_only_a_bool():
    assert from_dict({"train": {"tensorboard": True}}).train.tensorboard is True
    with pytest.raises(ConfigError, match="train.tensorboard"):
        from_dict({"train": {"tensorboard": "yes"}})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None, reason="tensorboard is installed")
def test_without_the_package_one_line_before_launch(tmp_path):
    r = run_cli("train", "--config", str(config_file(tmp_path, tensorboard=True)), "--out", str(tmp_path / "run"))
    assert r.returncode == 2 and "lrmoe[tensorboard]" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists(), "nothing launched"


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_with_the_package_event_files_are_written(tmp_path):
    r = run_cli("train", "--config", str(config_file(tmp_path, tensorboard=True)), "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
