"""``lrmoe compare --memory-caps A,B,C``: the same comparison at several per-rank memory caps;
``lrmoe compare --seeds 0,1,2``: the same comparison at several seeds (:func:`run_seeds`); both
flags: :mod:`lrmoe.train.sweep_seeds`.

The reference (``static`` without a cap) runs once, into ``out/<reference>-uncapped``; each cap
then gets its own comparison in ``out/cap-<label>/`` (the reference linked in, so every cap
shares one target), and the sweep is drawn: MoE time to the target against the cap, per system,
with the caps where a system ran out of memory or never reached the target marked.

A cap is bytes (``70000000``, ``70_000_000``, ``70MB``, ``66.8MiB``, ``1.5GiB``: the size grammar
of :mod:`lrmoe.sizes`) or a fraction of the reference's own peak expert-side bytes (``0.8x``):
the fraction names the regime ("20 % below what static needs") independently of the model's shape.

Written to ``out``: ``sweep.json`` (``{"target_loss", "reference_peak_bytes", "reference":
{"name", results.json's entry}, "caps": [{"label", "memory_cap_bytes", "folder"}], "systems":
{name: [per cap: results.json's entry]}}``) and ``sweep.png``.

With ``--seeds`` every seed's comparison (``train.seed`` and ``backward.seed`` set to the seed:
another initialisation, data order and selection stream; the target from that seed's own
reference) goes to ``out/seed-<s>/``, and ``out/results.json`` gathers them (:func:`aggregate`):
results.json's keys, per system, with ``steps_to_target`` and ``moe_time_to_target_s`` the mean
when every seed reached the target (else null, ``status`` then ``oom`` or ``never``), the other
figures means over the seeds, plus ``seeds_run``, ``seeds_reached`` and, over the seeds that
reached the target, ``<key>_mean``, ``_std`` (sample standard deviation, n − 1; null for one seed),
``_min`` and ``_max`` of ``steps_to_target``, ``moe_time_to_target_s``, ``steps_to_target_interp``
and ``wall_time_to_target_s``; ``per_seed`` holds every seed's own entries.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from lrmoe.config import ClusterBudget
from lrmoe.sizes import SizeError, parse_size
from lrmoe.train.compare import finished, reference_eval_at, run_compare, system_config
from lrmoe.train.config import ConfigError, RunConfig, require_int
from lrmoe.train.launch import launch
from lrmoe.train.metrics import read_metrics
from lrmoe.train.report import seeds_report
from lrmoe.train.to_target import RESULT_KEYS
from lrmoe.train.toml_dump import dump_toml


def parse_cap(text: str) -> tuple[str, float]:
    """One ``--memory-caps`` entry: ``("bytes", n)`` or ``("fraction", f)`` of the reference's peak
    (:func:`lrmoe.sizes.parse_size`; a bad entry is a one-line ConfigError)."""
    try:
        size = parse_size(text, "--memory-caps", relative=True)
    except SizeError as e:
        raise ConfigError(str(e)) from None
    return ("bytes", size) if isinstance(size, int) else ("fraction", size.factor)


def parse_caps(text: str) -> list[str]:
    """The comma-separated entries, each checked (:func:`parse_cap`); at least one."""
    caps = [c.strip() for c in text.split(",") if c.strip()]
    if not caps or len(set(caps)) != len(caps):
        raise ConfigError(f"--memory-caps={text!r} is invalid: expected a comma-separated list of distinct caps")
    for c in caps:
        parse_cap(c)
    return caps


def cap_bytes(entry: str, reference_peak: int) -> int:
    kind, value = parse_cap(entry)
    return max(int(value * reference_peak), 1) if kind == "fraction" else int(value)  # (0 bytes: no cap at all)


def _with_cap(cfg: RunConfig, cap: int) -> RunConfig:
    budget = cfg.budget if cfg.budget is not None else ClusterBudget()
    return replace(cfg, budget=replace(budget, memory_bytes=cap))


def run_sweep(cfg: RunConfig, systems: tuple[str, ...], caps: list[str], out: Path, resume: bool = False) -> dict:
    """Run the reference once without a cap, then :func:`run_compare` at each cap (every listed
    system under it, the reference's target shared); write ``sweep.json`` and ``sweep.png``."""
    for name in systems:
        system_config(cfg, name)
    _with_cap(cfg, 1)  # a capped config's own checks (backward.keep, ...) before the reference runs
    entries = parse_caps(",".join(caps))
    ref = cfg.compare.reference
    ref_run = f"{ref}-uncapped"
    uncapped = replace(cfg, budget=None if cfg.budget is None else replace(cfg.budget, memory_bytes=None))
    ref_cfg = system_config(uncapped, ref)
    if resume and finished(ref_cfg, out / ref_run):
        print(f"-- {ref_run}: finished earlier, kept (--resume)", flush=True)
    else:
        print(f"-- {ref_run} (the sweep's reference, no cap)", flush=True)
        launch(ref_cfg, out / ref_run, eval_at=reference_eval_at(cfg))
    peak = max((r.get("peak_expert_side_bytes", 0) for r in read_metrics(out / ref_run) if "oom" not in r),
               default=0)
    points, docs = [], []
    for entry in entries:
        cap = cap_bytes(entry, peak)
        label = entry.replace(" ", "")
        folder = out / f"cap-{label}"
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / ref_run
        if not link.exists():
            link.symlink_to(Path("..") / ref_run, target_is_directory=True)
        print(f"== cap {label}: {cap:,} bytes per rank ({cap / max(peak, 1):.2f}x {ref}'s uncapped peak)", flush=True)
        docs.append(run_compare(_with_cap(cfg, cap), systems, folder, resume=resume, reference_done=True))
        points.append({"label": label, "memory_cap_bytes": cap, "folder": folder.name})
    doc = sweep_document(docs, ref_run, peak, points)
    (out / "sweep.json").write_text(json.dumps(doc, indent=2))
    print(sweep_table(doc))
    plot_sweep(doc, out / "sweep.png")
    print(f"sweep: {out}/sweep.json, {out}/sweep.png; each cap's comparison in {out}/cap-*/")
    return doc


def sweep_document(docs: list[dict], ref_run: str, peak: int, points: list[dict]) -> dict:
    """The caps' results documents (``docs``, one per cap in ``points``) as one sweep document,
    with ``strict`` the same of their strict targets' where they have one."""
    names = [n for n in dict.fromkeys(n for d in docs for n in d["systems"]) if n != ref_run]
    doc = {"target_loss": docs[0]["target_loss"], "reference_peak_bytes": peak, "caps": points,
           "reference": {"name": ref_run, **docs[0]["systems"][ref_run]},
           "systems": {n: [d["systems"].get(n) for d in docs] for n in names}}
    if all("strict" in d for d in docs):
        doc["strict"] = {"target_step": docs[0]["strict"]["target_step"],
                         **sweep_document([d["strict"] for d in docs], ref_run, peak, points)}
    return doc


def sweep_table(doc: dict) -> str:
    """MoE time and wall time to target (s) per system and cap; ``oom@N`` / ``never`` where it did
    not reach it."""
    caps = doc["caps"]
    lines = ["| system | " + " | ".join(f"{c['label']} ({c['memory_cap_bytes'] / 1e6:.1f} MB)" for c in caps) + " |",
             "|---|" + "---|" * len(caps)]
    for name, rows in doc["systems"].items():
        cells = []
        for r in rows:
            if r is None:
                cells.append("-")
            elif r["status"] == "reached":
                wall = r.get("wall_time_to_target_s")
                wall = "" if wall is None else f", wall {wall:.1f} s"
                cells.append(f"{r['moe_time_to_target_s']:.1f} s ({r['steps_to_target']} steps{wall})")
            elif r["status"] == "oom":
                cells.append(f"oom@{r.get('oom_step', '?')}")
            else:
                cells.append("never")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(doc: dict, path: Path) -> None:
    """MoE time to target against the cap, one line per system; ``x`` at the top: out of memory,
    ``^`` at the top: ran within the cap but never reached the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps_mb = [c["memory_cap_bytes"] / 1e6 for c in doc["caps"]]
    reached = [r["moe_time_to_target_s"] for rows in [*doc["systems"].values(), [doc.get("reference")]] for r in rows
               if r and r["status"] == "reached"]
    top = 1.1 * max(reached) if reached else 1.0
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (name, rows) in enumerate(doc["systems"].items()):
        color = f"C{i % 10}"
        pts = [(c, r["moe_time_to_target_s"]) for c, r in zip(caps_mb, rows) if r and r["status"] == "reached"]
        if pts:
            ax.plot(*zip(*sorted(pts)), marker="o", color=color, label=name)
        else:
            ax.plot([], [], marker="o", color=color, label=name)
        for c, r in zip(caps_mb, rows):
            if r and r["status"] != "reached":  # one row of marks per system, so none hides another
                ax.plot([c], [top * (1 - 0.035 * i)], marker="x" if r["status"] == "oom" else "^", color=color,
                        ms=8, ls="")
    ax.axhline(top, color="grey", lw=0.5, ls=":")
    ax.text(min(caps_mb), top, "  x: out of memory   ^: never reached (one row per system)", va="bottom",
            fontsize=8, color="grey")
    ref = doc.get("reference")
    if ref and ref.get("status") == "reached":
        ax.plot([doc["reference_peak_bytes"] / 1e6], [ref["moe_time_to_target_s"]], marker="*", color="black",
                ms=12, ls="", label=f"{ref['name']} (at its peak)")
    ax.axvline(doc["reference_peak_bytes"] / 1e6, color="grey", ls="--", lw=1)
    ax.text(doc["reference_peak_bytes"] / 1e6, 0, " reference's uncapped peak", rotation=90, va="bottom",
            fontsize=8, color="grey")
    ax.set_xlabel("memory cap per rank, expert side (MB)")
    ax.set_ylabel("MoE time to target (s)")
    ax.set_ylim(0, top * 1.08 if math.isfinite(top) else None)
    ax.set_title(f"MoE time to validation loss {doc['target_loss']:.3f} under a memory cap")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SPREAD_KEYS = ("steps_to_target", "moe_time_to_target_s", "steps_to_target_interp", "wall_time_to_target_s")
# null in the seeds' entry unless every seed reached the target
TO_TARGET = (*SPREAD_KEYS, "moe_time_to_target_interp_s", "steps_to_target_resolution")


def parse_seeds(text: str) -> tuple[int, ...]:
    """``--seeds 0,1,2``: distinct integers >= 0, at least one."""
    try:
        seeds = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        seeds = ()
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0 or max(seeds) >= 2**63:
        raise ConfigError(f"--seeds={text!r} is invalid: expected distinct integers from 0 to 2**63 - 1, "
                          "comma-separated (0,1,2)")
    return seeds


def seed_config(cfg: RunConfig, seed: int) -> RunConfig:
    """``cfg`` at ``seed``: ``train.seed`` (initialisation, data order) and ``backward.seed`` (the
    selection's stream) set to it; a single comparison (``compare.seeds`` emptied)."""
    return replace(cfg.with_train(seed=require_int("seed", seed, 0)), backward=replace(cfg.backward, seed=seed),
                   compare=replace(cfg.compare, seeds=()))


def spread(values: list[float], key: str) -> dict:
    """``key``'s mean, sample standard deviation (n − 1; None below two values), min and max."""
    return {f"{key}_mean": statistics.fmean(values) if values else None,
            f"{key}_std": statistics.stdev(values) if len(values) > 1 else None,
            f"{key}_min": min(values, default=None), f"{key}_max": max(values, default=None)}


def seed_entry(runs: list[dict]) -> dict:
    """One system's results.json entries of every seed as one (see the module's docstring)."""
    reached = [r for r in runs if r["status"] == "reached"]
    every = len(reached) == len(runs)
    entry = {}
    for key in RESULT_KEYS:  # means over the seeds with a number there
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
        entry[key] = statistics.fmean(values) if values and (every or key not in TO_TARGET) else None
    oom_steps = [r["oom_step"] for r in runs if r.get("oom_step") is not None]
    entry.update(status="reached" if every else ("oom" if any(r["status"] == "oom" for r in runs) else "never"),
                 oom_step=min(oom_steps, default=None), memory_cap_bytes=runs[0]["memory_cap_bytes"],
                 seeds_run=len(runs), seeds_reached=len(reached))
    if every:  # the coarsest crossing interval of any seed
        entry["steps_to_target_resolution"] = max(r["steps_to_target_resolution"] for r in runs)
    for key in SPREAD_KEYS:
        entry.update(spread([r[key] for r in reached if r.get(key) is not None], key))
    return entry


def aggregate(docs: dict[int, dict]) -> dict:
    """The seeds' results.json documents (seed → document) as one (the module's docstring)."""
    names = list(dict.fromkeys(n for d in docs.values() for n in d["systems"]))
    systems = {n: seed_entry([d["systems"][n] for d in docs.values() if n in d["systems"]]) for n in names}
    targets = [d["target_loss"] for d in docs.values()]
    doc = {"seeds": list(docs), "target_loss": statistics.fmean(targets),
           "target_losses": {str(s): d["target_loss"] for s, d in docs.items()},
           "unigram_loss": next(iter(docs.values()))["unigram_loss"], "systems": systems,
           "per_seed": {str(s): d["systems"] for s, d in docs.items()},
           "folders": {str(s): f"seed-{s}" for s in docs}}
    if all("strict" in d for d in docs.values()):
        doc["strict"] = {"target_step": next(iter(docs.values()))["strict"]["target_step"],
                         **aggregate({s: d["strict"] for s, d in docs.items()})}
    return doc


def run_seeds(cfg: RunConfig, systems: tuple[str, ...], seeds: tuple[int, ...], out: Path,
              resume: bool = False) -> dict:
    """:func:`run_compare` once per seed into ``out/seed-<s>/``; ``out/results.json`` (:func:`aggregate`),
    ``report.md`` (mean and spread per system) and ``config.toml``."""
    for name in systems:
        system_config(cfg, name)
    docs = {}
    for seed in seeds:
        print(f"== seed {seed}", flush=True)
        docs[seed] = run_compare(seed_config(cfg, seed), systems, out / f"seed-{seed}", resume=resume)
    doc = aggregate(docs)
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "config.toml").write_text(dump_toml(replace(cfg, compare=replace(cfg.compare, seeds=seeds)).to_dict()))
    print(seeds_report(out, doc))
    print(f"seeds: {out}/results.json, {out}/report.md; each seed's comparison in {out}/seed-*/")
    return doc
