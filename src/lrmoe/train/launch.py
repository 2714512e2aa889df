"""Starting the ranks of one run: ``torch.distributed.run`` over :mod:`lrmoe.train.worker`, with
the resolved config written next to the results so the run can be repeated exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from lrmoe.train.config import RunConfig, dump_toml


def launch(cfg: RunConfig, out: Path, resume: bool = False, max_steps: int | None = None,
           stop_at: float | None = None, eval_at: tuple[int, ...] = (), max_restarts: int = 0) -> dict:
    """Write the resolved config to ``out/config.toml`` and run its ranks; returns the summary."""
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "config.toml"
    config_path.write_text(dump_toml(cfg.to_dict()))
    worker = ["--config", str(config_path), "--out", str(out)]
    if resume:
        worker.append("--resume")
    if max_steps:
        worker += ["--max-steps", str(max_steps)]
    if stop_at is not None:
        worker += ["--stop-at", repr(stop_at)]
    if eval_at:
        worker += ["--eval-at", *map(str, eval_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.train.nproc}",
           f"--max-restarts={max_restarts}", "-m", "lrmoe.train.worker", *worker]
    proc = subprocess.run(cmd, env=env)
    if proc.returncode:
        raise SystemExit(f"lrmoe: training ranks failed (exit {proc.returncode}); see the log above")
    return json.loads((out / "summary.json").read_text())
