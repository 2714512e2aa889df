"""``lrmoe compare``: the same data, seed and model for every system; time to a target loss.

The target is the validation loss the reference system (``static``) reaches at
``target_fraction`` of its step budget (or ``compare.target_loss``); every other system runs
until its validation loss reaches the target or ``budget_factor`` × the reference's budget.
Written to the output folder:

- ``results.json``: ``{"target_loss", "unigram_loss", "systems": {name: {...}}, "details"}`` with,
  per system, ``status`` (``reached``, ``never`` within its steps, ``oom``: a layer call did not
  fit the memory cap, at ``oom_step``), ``steps_to_target``, ``moe_time_to_target_s`` (null where
  not reached), ``final_val_loss``, ``steps_run``, ``moe_ms_per_step`` (over the run),
  ``bwd_a2a_bytes``, ``a2a_bytes``, ``placement_bytes`` (totalled over the run),
  ``peak_expert_side_bytes`` (max over steps and ranks), ``memory_cap_bytes``,
  ``mean_kept_ratio``, ``replica_slots`` and ``mean_load_cv`` (expert-load coefficient of
  variation; means over steps);
- ``report.md``: the table; ``val_loss_vs_moe_time.png``, ``kept_ratio.png``,
  ``expert_load.png``: the plots (:mod:`lrmoe.train.plots`); one folder per system with its own run.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from lrmoe.systems import REFERENCE_SYSTEM, spec_of
from lrmoe.train.config import ConfigError, RunConfig, dump_toml, parse_system_name
from lrmoe.train.launch import launch
from lrmoe.train.metrics import read_metrics
from lrmoe.train.plots import plots
from lrmoe.train.report import report

RESULT_KEYS = ("status", "steps_to_target", "moe_time_to_target_s", "final_val_loss", "steps_run", "bwd_a2a_bytes",
               "peak_expert_side_bytes", "a2a_bytes", "placement_bytes", "mean_kept_ratio", "replica_slots",
               "memory_cap_bytes", "oom_step", "moe_ms_per_step", "mean_load_cv")


def system_config(cfg: RunConfig, name: str, trace: Path | None = None) -> RunConfig:
    """The run config of one compared system (see :func:`parse_system_name`). A trace-taking
    system (``smartmoe``) builds its offline pool from ``train.routing_trace`` or else from
    ``trace`` (the reference's routing.npz, recorded earlier in the same comparison) when it
    exists; the others take no trace."""
    system, selection, ratio = parse_system_name(name)
    takes_trace = spec_of(system).takes_trace
    routing_trace = cfg.train.routing_trace if takes_trace else ""
    if takes_trace and not routing_trace and trace is not None and trace.exists():
        routing_trace = str(trace)
    backward = cfg.backward
    try:
        if selection:
            backward = replace(backward, selection=selection)
        if ratio is not None:
            backward = replace(backward, ratio=ratio)
    except ValueError as e:
        raise ConfigError(f"compare system {name!r}: {e}") from None
    return replace(cfg.with_train(system=system, routing_trace=routing_trace), backward=backward)


def finished(cfg: RunConfig, folder: Path) -> bool:
    """``folder`` holds a completed run of exactly this config (``lrmoe compare --resume``)."""
    config, summary = folder / "config.toml", folder / "summary.json"
    return summary.exists() and config.exists() and config.read_text() == dump_toml(cfg.to_dict())


def summarise(name: str, folder: Path, target: float, memory_cap: int | list[int] | None = None) -> dict:
    """One system's results from its ``metrics.jsonl``: when it reached ``target`` (``status``
    ``reached``, ``never`` within its steps, or ``oom``: a call did not fit the memory cap), and totals."""
    records = read_metrics(folder)
    oom = next((r for r in records if "oom" in r), None)
    rows = [r for r in records if "oom" not in r]
    evals = [r for r in rows if "val_loss" in r]
    hit = next((r for r in evals if r["val_loss"] <= target), None)
    return {
        "status": "reached" if hit else ("oom" if oom else "never"),
        "oom_step": oom["step"] if oom else None,
        "oom": oom["oom"] if oom else None,
        "oom_during": oom.get("during") if oom else None,
        "replica_slots": float(np.mean([r.get("replica_slots", 0) for r in rows])) if rows else None,
        "memory_cap_bytes": memory_cap,
        "steps_to_target": hit["step"] if hit else None,
        "moe_time_to_target_s": hit["moe_time_s"] if hit else None,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "bwd_a2a_bytes": int(sum(r.get("bwd_a2a_bytes", 0) for r in rows)),
        "a2a_bytes": int(sum(r.get("a2a_bytes", 0) for r in rows)),
        "peak_expert_side_bytes": int(max((r.get("peak_expert_side_bytes", 0) for r in rows), default=0)),
        "steps_run": rows[-1]["step"] if rows else 0,
        "moe_time_s": rows[-1]["moe_time_s"] if rows else 0.0,
        "placement_bytes": int(sum(r.get("placement_bytes", 0) for r in rows)),
        "mean_kept_ratio": float(np.mean([r["kept_ratio"] for r in rows])) if rows else None,
        "moe_ms_per_step": 1e3 * rows[-1]["moe_time_s"] / rows[-1]["step"] if rows else None,
        "mean_load_cv": float(np.mean([r["load_cv"] for r in rows if "load_cv" in r])) if rows else None,
    }


def target_from_reference(folder: Path, step: int) -> float:
    """The reference run's validation loss at ``step`` (it evaluated there through ``eval_at``)."""
    for r in read_metrics(folder):
        if r["step"] == step and "val_loss" in r:
            return r["val_loss"]
    raise RuntimeError(f"{REFERENCE_SYSTEM}'s run has no validation loss at step {step}")


def budget_steps(cfg: RunConfig) -> tuple[int, int, int]:
    """(the reference's steps, the step whose validation loss is the target, the others' step cap)."""
    steps = cfg.train.steps
    at = max(1, round(cfg.compare.target_fraction * steps))
    return steps, at, math.ceil(cfg.compare.budget_factor * steps)


def run_compare(cfg: RunConfig, systems: tuple[str, ...], out: Path, resume: bool = False,
                reference_done: bool = False) -> dict:
    """Run the reference, take the target from it, run every other system to the target or its
    step cap; write results.json, config.toml, report.md and the plots; returns results.json's
    document. With ``resume``, a system whose run in ``out`` finished with the same config is kept;
    with ``reference_done``, ``out`` already holds the reference's finished run (a cap sweep's
    shared one, :mod:`lrmoe.train.sweep`)."""
    for name in systems:
        system_config(cfg, name)  # validate every name before running anything
    steps, target_step, max_steps = budget_steps(cfg)
    ref = cfg.compare.reference
    cap = cfg.budget.memory_bytes if cfg.budget is not None else None
    print(f"lrmoe compare: {', '.join(systems)}; {ref} runs {steps} steps"
          f"{' without the memory cap' if cap is not None else ''}, target at step {target_step}, "
          f"the others up to {max_steps}" + (f" under a cap of {cap} bytes per rank" if cap is not None else ""),
          flush=True)
    uncapped = replace(cfg, budget=None if cfg.budget is None else replace(cfg.budget, memory_bytes=None))
    # the target is the model quality wanted: the reference's run without the cap; under a cap
    # every listed system runs capped, the reference too if it is listed
    ref_run = ref if cap is None else f"{ref}-uncapped"

    def run(name: str, folder: str, base: RunConfig, **kw) -> dict:
        run_cfg = system_config(base, name, trace=out / ref_run / "routing.npz")
        if resume and finished(run_cfg, out / folder):
            print(f"-- {folder}: finished earlier, kept (--resume)", flush=True)
            return json.loads((out / folder / "summary.json").read_text())
        print(f"-- {folder}", flush=True)
        return launch(run_cfg, out / folder, **kw)

    if reference_done:
        summary = json.loads((out / ref_run / "summary.json").read_text())
    else:
        summary = run(ref, ref_run, uncapped, eval_at=(target_step,))
    target = cfg.compare.target_loss or target_from_reference(out / ref_run, target_step)
    others = [n for n in systems if n != ref_run and not (cap is None and n == ref)]
    for name in others:
        run(name, name, cfg, max_steps=max_steps, stop_at=target)
    names = [ref_run, *others]
    results = {name: summarise(name, out / name, target, None if name == ref_run else cap) for name in names}
    doc = {"target_loss": target, "unigram_loss": summary["unigram_loss"],
           "systems": {n: {k: r[k] for k in RESULT_KEYS} for n, r in results.items()},
           "details": results}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "config.toml").write_text(dump_toml(cfg.to_dict()))
    print(report(out, target, summary["unigram_loss"], results))
    plots(out, names, target)
    print(f"report: {out}/report.md  plots: {out}/val_loss_vs_moe_time.png, kept_ratio.png, expert_load.png")
    return doc
