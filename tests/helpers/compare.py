"""A fake launcher for ``lrmoe compare`` on a synthetic validation curve (tests/train)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lrmoe.train.metrics import read_metrics


def curve(step: int, seed: int = 0) -> float:
    """A synthetic validation loss: falls by 0.01 a step from 5.0, with a bump at step 23 (so
    the first evaluation at or below 4.76 is step 23 on a dense grid, 30 on a grid of 10)."""
    return 5.0 - 0.01 * step - (0.02 if step == 23 else 0.0) + 0.1 * seed


class FakeRuns:
    """A launcher that writes a run as the training loop does, on the synthetic :func:`curve`:
    evaluations every ``eval_every`` steps, at ``eval_at`` and at the end; a stop at the first
    evaluation at or below ``stop_at``; checkpoints every ``checkpoint_every`` steps (the newest
    ``keep_checkpoints`` kept, ``ckpt/latest``) and at the stop; a resume from ``ckpt/latest``
    trims the metrics to its step. MoE time 0.1 s a step, wall time 0.3 s, 4000 expert-side bytes.
    Every call is recorded."""

    def __init__(self):
        self.calls = []

    def __call__(self, cfg, out: Path, resume=False, max_steps=None, stop_at=None, eval_at=(), **kw):
        t = cfg.train
        self.calls.append({"folder": out.name, "resume": resume, "eval_at": tuple(eval_at), "stop_at": stop_at,
                           "max_steps": max_steps, "checkpoint_every": t.checkpoint_every, "seed": t.seed})
        out.mkdir(parents=True, exist_ok=True)
        root = out / "ckpt"
        start = int((root / "latest").read_text()) if resume and (root / "latest").exists() else 0
        rows = [r for r in read_metrics(out) if r["step"] <= start] if resume else []
        total = max_steps or t.steps
        for step in range(start + 1, total + 1):
            r = {"step": step, "loss": 6.0 - 0.01 * step, "moe_time_s": 0.1 * step, "train_wall_s": 0.3 * step,
                 "kept_ratio": 1.0, "load_cv": [0.5], "peak_expert_side_bytes": 4000}
            if step % t.eval_every == 0 or step in eval_at or step == total:
                r["val_loss"] = curve(step, t.seed)
            rows.append(r)
            reached = stop_at is not None and r.get("val_loss", math.inf) <= stop_at
            if (t.checkpoint_every and step % t.checkpoint_every == 0) or reached or step == total:
                root.mkdir(exist_ok=True)
                (root / f"step_{step:07d}").mkdir(exist_ok=True)
                (root / "latest").write_text(str(step))
                for old in sorted(root.glob("step_*"))[:-t.keep_checkpoints]:
                    old.rmdir()
            if reached:
                break
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "config.toml").write_text("")
        summary = {"unigram_loss": 6.0, "steps": rows[-1]["step"]}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary
