"""``lrmoe compare --memory-caps A,B,C``: the same comparison at several per-rank memory caps.

The reference (``static`` without a cap) runs once, into ``out/<reference>-uncapped``; each cap
then gets its own comparison in ``out/cap-<label>/`` (the reference linked in, so every cap
shares one target), and the sweep is drawn: MoE time to the target against the cap, per system,
with the caps where a system ran out of memory or never reached the target marked.

A cap is bytes (``70000000``, ``70MB``, ``66.8MiB``, ``1.5GiB``) or a fraction of the
reference's own peak expert-side bytes (``0.8x``): the fraction names the regime ("20 % below
what static needs") independently of the model's shape.

Written to ``out``: ``sweep.json`` (``{"target_loss", "reference_peak_bytes", "reference":
{"name", results.json's entry}, "caps": [{"label", "memory_cap_bytes", "folder"}], "systems":
{name: [per cap: results.json's entry]}}``) and ``sweep.png``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

from lrmoe.config import ClusterBudget
from lrmoe.train.compare import budget_steps, finished, run_compare, system_config
from lrmoe.train.config import ConfigError, RunConfig
from lrmoe.train.launch import launch
from lrmoe.train.metrics import read_metrics

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
_CAP = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_cap(text: str) -> tuple[str, float]:
    """One ``--memory-caps`` entry: ``("bytes", n)`` or ``("fraction", f)`` of the reference's peak."""
    m = _CAP.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or (unit not in _UNITS and unit != "x"):
        raise ConfigError(f"--memory-caps entry {text!r} is invalid: expected bytes (70000000, 70MB, 66.8MiB, "
                          "1.5GiB) or a fraction of the uncapped reference's peak (0.8x)")
    value = float(m.group(1))
    if unit == "x":
        if value <= 0:
            raise ConfigError(f"--memory-caps entry {text!r} is invalid: a fraction must be > 0")
        return "fraction", value
    n = value * _UNITS[unit]
    if n < 1:
        raise ConfigError(f"--memory-caps entry {text!r} is invalid: a cap must be at least 1 byte")
    return "bytes", n


def parse_caps(text: str) -> list[str]:
    """The comma-separated entries, each checked (:func:`parse_cap`); at least one."""
    caps = [c.strip() for c in text.split(",") if c.strip()]
    if not caps:
        raise ConfigError(f"--memory-caps={text!r} is invalid: expected a comma-separated list of caps")
    for c in caps:
        parse_cap(c)
    return caps


def cap_bytes(entry: str, reference_peak: int) -> int:
    kind, value = parse_cap(entry)
    return int(value * reference_peak) if kind == "fraction" else int(value)


def _with_cap(cfg: RunConfig, cap: int) -> RunConfig:
    budget = cfg.budget if cfg.budget is not None else ClusterBudget()
    return replace(cfg, budget=replace(budget, memory_bytes=cap))


def run_sweep(cfg: RunConfig, systems: tuple[str, ...], caps: list[str], out: Path, resume: bool = False) -> dict:
    """Run the reference once without a cap, then :func:`run_compare` at each cap (every listed
    system under it, the reference's target shared); write ``sweep.json`` and ``sweep.png``."""
    for name in systems:
        system_config(cfg, name)
    entries = parse_caps(",".join(caps))
    ref = cfg.compare.reference
    ref_run = f"{ref}-uncapped"
    uncapped = replace(cfg, budget=None if cfg.budget is None else replace(cfg.budget, memory_bytes=None))
    ref_cfg = system_config(uncapped, ref)
    _, target_step, _ = budget_steps(cfg)
    if resume and finished(ref_cfg, out / ref_run):
        print(f"-- {ref_run}: finished earlier, kept (--resume)", flush=True)
    else:
        print(f"-- {ref_run} (the sweep's reference, no cap)", flush=True)
        launch(ref_cfg, out / ref_run, eval_at=(target_step,))
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
    names = [n for n in dict.fromkeys(n for d in docs for n in d["systems"]) if n != ref_run]
    doc = {"target_loss": docs[0]["target_loss"], "reference_peak_bytes": peak, "caps": points,
           "reference": {"name": ref_run, **docs[0]["systems"][ref_run]},
           "systems": {n: [d["systems"].get(n) for d in docs] for n in names}}
    (out / "sweep.json").write_text(json.dumps(doc, indent=2))
    print(sweep_table(doc))
    plot_sweep(doc, out / "sweep.png")
    print(f"sweep: {out}/sweep.json, {out}/sweep.png; each cap's comparison in {out}/cap-*/")
    return doc


def sweep_table(doc: dict) -> str:
    """MoE time to target (s) per system and cap; ``oom@N`` / ``never`` where it did not reach it."""
    caps = doc["caps"]
    lines = ["| system | " + " | ".join(f"{c['label']} ({c['memory_cap_bytes'] / 1e6:.1f} MB)" for c in caps) + " |",
             "|---|" + "---|" * len(caps)]
    for name, rows in doc["systems"].items():
        cells = []
        for r in rows:
            if r is None:
                cells.append("-")
            elif r["status"] == "reached":
                cells.append(f"{r['moe_time_to_target_s']:.1f} s ({r['steps_to_target']} steps)")
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
