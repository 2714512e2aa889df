"""One run's figures against a target loss, read from its ``metrics.jsonl``: where it crossed the
target (:func:`crossing`, at the resolution of its evaluations), an estimate inside that interval
(:func:`interpolate`) and the whole entry ``lrmoe compare`` writes per system (:func:`summarise`;
the keys of ``results.json``'s ``systems``: :data:`RESULT_KEYS`, :mod:`lrmoe.train.compare`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lrmoe.train.metrics import read_metrics

RESULT_KEYS = ("status", "steps_to_target", "moe_time_to_target_s", "final_val_loss", "steps_run", "bwd_a2a_bytes",
               "peak_expert_side_bytes", "a2a_bytes", "placement_bytes", "mean_kept_ratio", "replica_slots",
               "memory_cap_bytes", "oom_step", "moe_ms_per_step", "mean_load_cv", "steps_to_target_resolution",
               "steps_to_target_interp", "moe_time_to_target_interp_s", "wall_time_to_target_s", "wall_ms_per_step")


def crossing(records: list[dict], target: float) -> tuple[dict | None, dict] | None:
    """(the evaluation before the first one at or below ``target``, or None when that is the
    run's first; the first one) of a run's records; None: the target was not reached."""
    evals = [r for r in records if "val_loss" in r and "oom" not in r]
    for i, r in enumerate(evals):
        if r["val_loss"] <= target:
            return (evals[i - 1] if i else None), r
    return None


def interpolate(records: list[dict], target: float, before: dict | None, hit: dict) -> tuple[float, float] | None:
    """An estimate, not a measurement: (the step where the straight line between the evaluations
    ``before`` and ``hit`` meets ``target``, the cumulative MoE time there, interpolated between
    the steps' records). None without an evaluation before ``hit``."""
    if before is None:
        return None
    v0, v1 = before["val_loss"], hit["val_loss"]
    frac = (v0 - target) / (v0 - v1)  # v0 > target >= v1
    step = before["step"] + frac * (hit["step"] - before["step"])
    timed = sorted((r["step"], r["moe_time_s"]) for r in records if "oom" not in r and "moe_time_s" in r)
    steps, times = zip(*timed)
    return float(step), float(np.interp(step, steps, times))


def summarise(folder: Path, target: float, memory_cap: int | list[int] | None = None,
              dense: str = "dense_eval") -> dict:
    """One system's results (its run in ``folder``) from its ``metrics.jsonl``: when it reached ``target`` (``status``
    ``reached``, ``never`` within its steps, or ``oom``: a call did not fit the memory cap), at
    what resolution (the crossing interval; an interpolated estimate inside it), and totals."""
    records = read_metrics(folder)
    oom = next((r for r in records if "oom" in r), None)
    rows = [r for r in records if "oom" not in r]
    evals = [r for r in rows if "val_loss" in r]
    before, hit = crossing(rows, target) or (None, None)
    estimate = interpolate(rows, target, before, hit) if hit else None
    start = before["step"] if before else 0
    summary = folder / "summary.json"
    dense_eval = json.loads(summary.read_text()).get(dense) if summary.exists() else None
    return {
        "target_bracket": [start, hit["step"]] if hit else None,
        "steps_to_target_resolution": hit["step"] - start if hit else None,
        "steps_to_target_interp": estimate[0] if estimate else None,
        "moe_time_to_target_interp_s": estimate[1] if estimate else None,
        "dense_eval": dense_eval,
        "status": "reached" if hit else ("oom" if oom else "never"),
        "oom_step": oom["step"] if oom else None,
        "oom": oom["oom"] if oom else None,
        "oom_during": oom.get("during") if oom else None,
        "replica_slots": float(np.mean([r.get("replica_slots", 0) for r in rows])) if rows else None,
        "memory_cap_bytes": memory_cap,
        "steps_to_target": hit["step"] if hit else None,
        "moe_time_to_target_s": hit["moe_time_s"] if hit else None,
        "wall_time_to_target_s": hit.get("train_wall_s") if hit else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "bwd_a2a_bytes": int(sum(r.get("bwd_a2a_bytes", 0) for r in rows)),
        "a2a_bytes": int(sum(r.get("a2a_bytes", 0) for r in rows)),
        "peak_expert_side_bytes": int(max((r.get("peak_expert_side_bytes", 0) for r in rows), default=0)),
        "steps_run": rows[-1]["step"] if rows else 0,
        "moe_time_s": rows[-1]["moe_time_s"] if rows else 0.0,
        "placement_bytes": int(sum(r.get("placement_bytes", 0) for r in rows)),
        "mean_kept_ratio": float(np.mean([r["kept_ratio"] for r in rows])) if rows else None,
        "moe_ms_per_step": 1e3 * rows[-1]["moe_time_s"] / rows[-1]["step"] if rows else None,
        "wall_ms_per_step": 1e3 * rows[-1]["train_wall_s"] / rows[-1]["step"] if rows and "train_wall_s" in rows[-1]
        else None,
        "mean_load_cv": float(np.mean([r["load_cv"] for r in rows if "load_cv" in r])) if rows else None,
    }
