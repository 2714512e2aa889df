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
  variation; means over steps), ``steps_to_target_resolution``, ``steps_to_target_interp`` and
  ``moe_time_to_target_interp_s`` (below), ``wall_time_to_target_s`` (the training steps' wall time
  up to the target's step: ``metrics.jsonl``'s ``train_wall_s``, evaluations and checkpoints
  excluded; null where not reached) and ``wall_ms_per_step`` (over the run); ``details`` adds
  ``target_bracket`` and ``dense_eval``; with ``compare.strict_fraction``, ``strict``: the same
  document (``target_step``, ``target_loss``, ``systems``, ``details``) for a strict target, the
  reference's loss at that later share of its steps, every system run on to it from its stop at the
  first target (:func:`run_on`);
- ``report.md``: the table; ``val_loss_vs_moe_time.png``, ``kept_ratio.png``,
  ``expert_load.png``: the plots (:mod:`lrmoe.train.plots`); one folder per system with its own run.

Steps to target are measured, at the resolution of the evaluations: the first evaluation at or
below the target. Evaluations come every ``train.eval_every`` steps; where the target was crossed,
``compare.dense_eval_every`` (d) makes them denser (:func:`refine`): a system whose crossing
interval (the evaluation before the first at or below the target, that one] is wider than d is
rolled back to its checkpoint at the interval's start (compare's runs checkpoint at every
evaluation) and rerun from there with an evaluation every d steps in the interval, so its steps
to target are read to d steps or better; the reference evaluates every d steps in the interval
before the target's step. ``steps_to_target_resolution`` is the width of the crossing interval
finally measured and ``target_bracket`` the interval; ``steps_to_target_interp`` and
``moe_time_to_target_interp_s`` are an estimate inside it (the straight line between the two
evaluations meets the target), never a measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from lrmoe.systems import REFERENCE_SYSTEM, spec_of
from lrmoe.train import checkpoint
from lrmoe.train.config import ConfigError, RunConfig, parse_system_name
from lrmoe.train.files import atomic_write
from lrmoe.train.launch import launch
from lrmoe.train.metrics import read_metrics
from lrmoe.train.plots import plots
from lrmoe.train.rendezvous import current_rendezvous
from lrmoe.train.report import report
from lrmoe.train.to_target import RESULT_KEYS, crossing, summarise
from lrmoe.train.toml_dump import dump_toml


def system_config(cfg: RunConfig, name: str, trace: Path | None = None) -> RunConfig:
    """The run config of one compared system (see :func:`parse_system_name`). A trace-taking
    system (``smartmoe``) builds its offline pool from ``train.routing_trace`` or else from
    ``trace`` (the reference's routing.npz, recorded earlier in the same comparison) when it
    exists; the others take no trace."""
    parsed = parse_system_name(name)
    system, selection, ratio = parsed
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
    factor = cfg.train.capacity_factor if parsed.capacity_factor is None else parsed.capacity_factor
    return replace(cfg.with_train(system=system, routing_trace=routing_trace, capacity_factor=factor),
                   backward=backward)


def finished(cfg: RunConfig, folder: Path) -> bool:
    """``folder`` holds a completed run of exactly this config (``lrmoe compare --resume``)."""
    config, summary = folder / "config.toml", folder / "summary.json"
    return summary.exists() and config.exists() and config.read_text() == dump_toml(cfg.to_dict())


def target_from_reference(folder: Path, step: int) -> float:
    """The reference run's validation loss at ``step`` (it evaluated there through ``eval_at``)."""
    for r in read_metrics(folder):
        if r["step"] == step and "val_loss" in r:
            return r["val_loss"]
    raise RuntimeError(f"{REFERENCE_SYSTEM}'s run has no validation loss at step {step}")


def reference_eval_at(cfg: RunConfig) -> tuple[int, ...]:
    """The reference's evaluations beyond every ``eval_every`` steps: each target's step and, every
    ``compare.dense_eval_every`` steps, the evaluation interval that ends there."""
    d, every = cfg.compare.dense_eval_every, cfg.train.eval_every
    return tuple(sorted({s for at in target_steps(cfg)
                         for s in (*(range((at - 1) // every * every + d, at, d) if d else ()), at)}))


def with_dense_checkpoints(cfg: RunConfig) -> RunConfig:
    """A compared system's run config: checkpoints at every evaluation (``train.checkpoint_every``
    left at 0 becomes ``eval_every``) where :func:`refine` may need to roll it back."""
    d, t = cfg.compare.dense_eval_every, cfg.train
    return cfg.with_train(checkpoint_every=t.eval_every) if 0 < d < t.eval_every and not t.checkpoint_every else cfg


def refine(cfg: RunConfig, folder: Path, target: float, max_steps: int, key: str = "dense_eval") -> None:
    """Dense evaluation where the run in ``folder`` crossed ``target``: if its crossing interval
    (the evaluation before the first at or below the target, that one] is wider than
    ``compare.dense_eval_every`` (d), roll the run back to its newest checkpoint at or before the
    interval's start (a fresh start without one) and rerun it to the target with an evaluation
    every d steps in the interval. The rerun's training losses on the steps both runs made are
    compared (``rerun_loss_max_abs_diff``: 0 when the rerun repeats the run exactly) and kept
    with the interval in ``summary.json``'s ``key`` (``dense_eval``; ``dense_eval_strict`` for the
    strict target)."""
    d = cfg.compare.dense_eval_every
    records = read_metrics(folder)
    found = crossing(records, target)
    if not d or found is None:
        return
    before, hit = found
    start, end = (before["step"] if before else 0), hit["step"]
    if end - start <= d:
        return
    resume_at = max((s for s in checkpoint.candidates(folder) if s <= start), default=0)
    print(f"-- {folder.name}: target crossed in ({start}, {end}]; rerun from step {resume_at} with an "
          f"evaluation every {d} steps there", flush=True)
    lead = current_rendezvous().prepares_out
    if resume_at and lead:
        atomic_write(folder / "ckpt" / "latest", lambda f: f.write(str(resume_at).encode()))
    first = {r["step"]: r["loss"] for r in records if "loss" in r and "oom" not in r}
    summary = relaunch(cfg, folder, resume=resume_at > 0, max_steps=max_steps, stop_at=target,
                       eval_at=(*range(start + d, end, d), end))
    again = {r["step"]: r["loss"] for r in read_metrics(folder) if "loss" in r and "oom" not in r}
    both = [s for s in again if resume_at < s <= end and s in first]
    summary[key] = {"every": d, "interval": [start, end], "from_step": resume_at, "rerun_steps": len(both),
                    "rerun_loss_max_abs_diff": max((abs(again[s] - first[s]) for s in both), default=None)}
    if lead:
        (folder / "summary.json").write_text(json.dumps(summary, indent=2))


def relaunch(cfg: RunConfig, folder: Path, **kw) -> dict:
    """:func:`launch` again in ``folder`` (a rerun or a run continued), keeping the dense
    evaluations that earlier refinements noted in its ``summary.json``."""
    path = folder / "summary.json"
    kept = {k: v for k, v in json.loads(path.read_text()).items() if k.startswith("dense_eval")} \
        if path.exists() else {}
    summary = {**launch(cfg, folder, **kw), **kept}
    if kept and current_rendezvous().prepares_out:
        path.write_text(json.dumps(summary, indent=2))
    return summary


def run_on(cfg: RunConfig, folder: Path, target: float, max_steps: int) -> None:
    """Continue a run stopped at an earlier target to ``target`` (a stricter one), from its
    newest checkpoint, and read its crossing densely (:func:`refine`); nothing where it ran out
    of steps or memory, or already reached ``target``."""
    rows = [r for r in read_metrics(folder) if "oom" not in r]
    done = len(rows) < len(read_metrics(folder)) or not rows or rows[-1]["step"] >= max_steps
    if done or crossing(rows, target) is not None:
        return
    print(f"-- {folder.name}: on to the strict target", flush=True)
    relaunch(cfg, folder, resume=True, max_steps=max_steps, stop_at=target)
    refine(cfg, folder, target, max_steps, key="dense_eval_strict")


def budget_steps(cfg: RunConfig) -> tuple[int, int, int]:
    """(the reference's steps, the step whose validation loss is the target, the others' step cap)."""
    steps = cfg.train.steps
    return steps, target_steps(cfg)[0], math.ceil(cfg.compare.budget_factor * steps)


def target_steps(cfg: RunConfig) -> tuple[int, ...]:
    """The reference's steps whose validation losses are the targets: ``target_fraction``'s and,
    with ``strict_fraction``, the strict target's."""
    fractions = (cfg.compare.target_fraction, *((cfg.compare.strict_fraction,) if cfg.compare.strict_fraction else ()))
    return tuple(max(1, round(f * cfg.train.steps)) for f in fractions)


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

    def run(name: str, folder: str, run_cfg: RunConfig, **kw) -> dict:
        if resume and finished(run_cfg, out / folder):
            print(f"-- {folder}: finished earlier, kept (--resume)", flush=True)
            return json.loads((out / folder / "summary.json").read_text())
        print(f"-- {folder}", flush=True)
        return launch(run_cfg, out / folder, **kw)

    trace = out / ref_run / "routing.npz"
    if reference_done:
        summary = json.loads((out / ref_run / "summary.json").read_text())
    else:
        summary = run(ref, ref_run, system_config(uncapped, ref, trace), eval_at=reference_eval_at(cfg))
    target = cfg.compare.target_loss or target_from_reference(out / ref_run, target_step)
    strict_step = target_steps(cfg)[1:]
    strict = target_from_reference(out / ref_run, strict_step[0]) if strict_step else None
    others = [n for n in systems if n != ref_run and not (cap is None and n == ref)]
    for name in others:
        run_cfg = with_dense_checkpoints(system_config(cfg, name, trace))
        run(name, name, run_cfg, max_steps=max_steps, stop_at=target)
        refine(run_cfg, out / name, target, max_steps)
        if strict is not None:
            run_on(run_cfg, out / name, strict, max_steps)
    names = [ref_run, *others]

    def document(loss: float, dense: str) -> dict:
        results = {name: summarise(out / name, loss, None if name == ref_run else cap, dense) for name in names}
        return {"target_loss": loss, "unigram_loss": summary["unigram_loss"],
                "systems": {n: {k: r[k] for k in RESULT_KEYS} for n, r in results.items()}, "details": results}

    doc = document(target, "dense_eval")
    if strict is not None:
        doc["strict"] = {"target_step": strict_step[0], **document(strict, "dense_eval_strict")}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "config.toml").write_text(dump_toml(cfg.to_dict()))
    print(report(out, doc))
    plots(out, names, target)
    print(f"report: {out}/report.md  plots: {out}/val_loss_vs_moe_time.png, kept_ratio.png, expert_load.png")
    return doc
