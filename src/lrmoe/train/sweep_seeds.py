"""``lrmoe compare --memory-caps A,B,C --seeds 0,1,2``: the cap sweep once per seed, and the seeds
together. Each seed's sweep goes to ``out/seed-<s>/`` (:func:`lrmoe.train.sweep.run_sweep` on
:func:`~lrmoe.train.sweep.seed_config`: that seed's own reference, target and, for a fraction
cap, peak). Written to ``out``:

- ``sweep.json``: the sweep document's keys (``target_loss`` and ``reference_peak_bytes`` the
  seeds' means; each cap's ``memory_cap_bytes`` the mean, ``per_seed`` each seed's) with, per
  system and cap, the seeds' entry (:func:`~lrmoe.train.sweep.seed_entry`) plus
  ``moe_step_ratio`` and ``wall_step_ratio`` (the mean over seeds of its MoE and wall ms a step ÷
  that seed's uncapped reference's, with ``_per_seed``), and ``best_exact`` per cap: the exact
  system (every pair in both passes) with the least mean MoE time to target, and with the least
  mean wall time to target, among those that reached it on every seed;
- ``report.md`` (:func:`seed_sweep_table`) and ``sweep.png`` (the sweep's plot, on the means).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from lrmoe.systems import base_system, spec_of
from lrmoe.train.config import RunConfig
from lrmoe.train.report import mean_range
from lrmoe.train.sweep import plot_sweep, run_sweep, seed_config, seed_entry


def exact(name: str) -> bool:
    """A system computing every pair in both passes (its gradients are static's)."""
    system = base_system(name)
    return system is not None and not spec_of(system).selects


def _ratios(runs: list[dict], refs: list[dict], key: str) -> list[float]:
    return [r[key] / ref[key] for r, ref in zip(runs, refs) if r.get(key) and ref.get(key)]


def _cap_entry(runs: list[dict | None], refs: list[dict]) -> dict | None:
    """One system at one cap over the seeds that ran it (None: no seed did)."""
    pairs = [(r, ref) for r, ref in zip(runs, refs) if r is not None]
    if not pairs:
        return None
    ran, ran_refs = [r for r, _ in pairs], [ref for _, ref in pairs]
    entry = seed_entry(ran)
    for key, name in (("moe_ms_per_step", "moe_step_ratio"), ("wall_ms_per_step", "wall_step_ratio")):
        per_seed = _ratios(ran, ran_refs, key)
        entry[name], entry[f"{name}_per_seed"] = (statistics.fmean(per_seed) if per_seed else None), per_seed
    return entry


def _best(entries: dict[str, dict | None], key: str) -> str | None:
    done = {n: e[key] for n, e in entries.items()
            if exact(n) and e is not None and e["status"] == "reached" and e.get(key) is not None}
    return min(done, key=done.get) if done else None


def aggregate_sweeps(docs: dict[int, dict]) -> dict:
    """The seeds' sweep documents (seed → :func:`run_sweep`'s document) as one (module docstring)."""
    first = next(iter(docs.values()))
    seeds = list(docs)
    refs = [d["reference"] for d in docs.values()]
    caps = [{"label": c["label"], "folder": c["folder"],
             "memory_cap_bytes": statistics.fmean(d["caps"][i]["memory_cap_bytes"] for d in docs.values()),
             "per_seed": [d["caps"][i]["memory_cap_bytes"] for d in docs.values()]}
            for i, c in enumerate(first["caps"])]
    names = list(dict.fromkeys(n for d in docs.values() for n in d["systems"]))
    systems = {n: [_cap_entry([d["systems"][n][i] if n in d["systems"] else None for d in docs.values()], refs)
                   for i in range(len(caps))] for n in names}
    best = [{"moe": _best({n: rows[i] for n, rows in systems.items()}, "moe_time_to_target_s"),
             "wall": _best({n: rows[i] for n, rows in systems.items()}, "wall_time_to_target_s")}
            for i in range(len(caps))]
    doc = {"seeds": seeds, "target_loss": statistics.fmean(d["target_loss"] for d in docs.values()),
           "reference_peak_bytes": statistics.fmean(d["reference_peak_bytes"] for d in docs.values()),
           "reference": {"name": first["reference"]["name"], **seed_entry(refs)}, "caps": caps,
           "systems": systems, "best_exact": best, "folders": {str(s): f"seed-{s}" for s in seeds}}
    if all("strict" in d for d in docs.values()):
        doc["strict"] = {"target_step": first["strict"]["target_step"],
                         **aggregate_sweeps({s: d["strict"] for s, d in docs.items()})}
    return doc


def seed_sweep_table(doc: dict) -> str:
    """Per cap: each system's MoE and wall ms a step ÷ the uncapped reference's (mean, and per
    seed), MoE and wall time to target and steps (mean [min–max] over the seeds that reached it),
    and the best exact system by MoE time and by wall time."""
    lines = [f"# lrmoe compare, cap sweep over seeds {', '.join(map(str, doc['seeds']))}", "",
             "Each seed against its own uncapped reference (its target and, for a fraction cap, its peak). "
             "Ratios: the mean over seeds of MoE (wall) ms a step ÷ that seed's reference's. Times and steps "
             "to target: mean [min–max] over the seeds that reached it.", "", *_cap_tables(doc)]
    if "strict" in doc:
        strict = doc["strict"]
        lines += [f"# Strict target: the reference's validation loss at step {strict['target_step']} "
                  f"({strict['target_loss']:.4f}, mean over seeds)", "", *_cap_tables(strict)]
    return "\n".join(lines)


def _cap_tables(doc: dict) -> list[str]:
    lines = []
    for i, cap in enumerate(doc["caps"]):
        best = doc["best_exact"][i]
        lines += [f"## cap {cap['label']} ({cap['memory_cap_bytes'] / 1e6:.1f} MB a rank, "
                  f"{cap['memory_cap_bytes'] / doc['reference_peak_bytes']:.2f}× the reference's peak)", "",
                  f"Best exact system: by MoE time {best['moe'] or '-'}, by wall time {best['wall'] or '-'}.", "",
                  "| system | reached | MoE ms a step ÷ ref (per seed) | wall ms a step ÷ ref | MoE s to target | "
                  "wall s to target | steps to target |", "|---|---|---|---|---|---|---|"]
        for name, rows in doc["systems"].items():
            e = rows[i]
            if e is None:
                continue
            per_seed = " / ".join(f"{v:.3f}" for v in e["moe_step_ratio_per_seed"])
            moe = "-" if e["moe_step_ratio"] is None else f"{e['moe_step_ratio']:.3f} ({per_seed})"
            wall = "-" if e["wall_step_ratio"] is None else f"{e['wall_step_ratio']:.3f}"
            reached = f"{e['seeds_reached']}/{e['seeds_run']}" + (f" (oom at {e['oom_step']})" if e["oom_step"] else "")
            spans = [mean_range(e, key, spec) for key, spec in (("moe_time_to_target_s", ".2f"),
                                                                  ("wall_time_to_target_s", ".2f"),
                                                                  ("steps_to_target", ".1f"))]
            lines.append(f"| {name} | {reached} | {moe} | {wall} | " + " | ".join(spans) + " |")
        lines.append("")
    return lines


def run_seed_sweeps(cfg: RunConfig, systems: tuple[str, ...], caps: list[str], seeds: tuple[int, ...], out: Path,
                    resume: bool = False) -> dict:
    """:func:`run_sweep` once per seed into ``out/seed-<s>/``, then ``out/sweep.json``,
    ``report.md`` and ``sweep.png`` over the seeds (the module's docstring)."""
    docs = {}
    for seed in seeds:
        print(f"== seed {seed}", flush=True)
        docs[seed] = run_sweep(seed_config(cfg, seed), systems, caps, out / f"seed-{seed}", resume=resume)
    doc = aggregate_sweeps(docs)
    (out / "sweep.json").write_text(json.dumps(doc, indent=2))
    text = seed_sweep_table(doc)
    (out / "report.md").write_text(text)
    plot_sweep(doc, out / "sweep.png")
    print(text)
    print(f"sweep over seeds: {out}/sweep.json, {out}/report.md, {out}/sweep.png; each seed's sweep in {out}/seed-*/")
    return doc
