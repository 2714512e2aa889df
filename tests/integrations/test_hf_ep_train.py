"""Training through ``DistributedConfig(ep_implementation="lrmoe")`` under ``torchrun
--nproc-per-node 2`` on the CPU (gloo), trimmed backward (kept ratio 0.5): a plain PyTorch loop
and ``transformers.Trainer`` lower the loss, and the checkpoints they write with
``save_pretrained`` load with ``from_pretrained`` unchanged (tests/integrations/hf_ep_train.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.distributed.expert_parallel")
pytest.importorskip("accelerate")

from tests.helpers import hf_ep  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("hf_ep_train.py")


def _torchrun(checkpoint: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           checkpoint, str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs in one torchrun launch (starting 2 ranks with transformers costs seconds)."""
    root = tmp_path_factory.mktemp("hf_ep_train")
    return _torchrun(hf_ep.make_checkpoint("qwen3-moe", str(root / "qwen3-moe")), root)


def test_plain_loop_trains_saves_and_loads(runs):
    out = runs["loop"]
    losses = out["losses"]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(0.3 < k < 0.7 for k in out["kept"]), out["kept"]  # the backward was trimmed
    assert out["steps"] == [8, 8], out["steps"]  # optimizer steps counted per layer
    assert out["reloaded"] < 1e-5 and out["plain"] < 1e-5, out


def test_trainer_trains_and_its_checkpoint_loads(runs):
    out = runs["trainer"]
    losses = out["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.2, losses
    assert all(0.3 < k < 0.7 for k in out["kept"]), out["kept"]
    assert out["plain"] < 1e-5, out
