"""``lrmoe compare``: the same data, seed and model for every system; time to a target loss.

The target is the validation loss ``static`` reaches at ``target_fraction`` of its step budget
(or ``compare.target_loss``); every other system runs until its validation loss reaches the
target or ``budget_factor`` × static's budget. Written to the output folder:

- ``results.json``: ``{"target_loss", "unigram_loss", "systems": {name: {"steps_to_target",
  "moe_time_to_target_s", "final_val_loss", "bwd_a2a_bytes", "peak_expert_side_bytes", "a2a_bytes",
  "placement_bytes"}}}`` (bytes totalled over the run, memory the max over ranks; null where
  never reached);
- ``report.md``: the table; ``val_loss_vs_moe_time.png``, ``kept_ratio.png``,
  ``expert_load.png``: the plots; one folder per system with its own run.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from lrmoe.train.config import ConfigError, RunConfig, dump_toml, parse_system_name

RESULT_KEYS = ("steps_to_target", "moe_time_to_target_s", "final_val_loss", "bwd_a2a_bytes", "peak_expert_side_bytes",
               "a2a_bytes", "placement_bytes")


def system_config(cfg: RunConfig, name: str, trace: Path | None = None) -> RunConfig:
    """The run config of one compared system (see :func:`parse_system_name`). ``smartmoe`` builds
    its offline pool from ``train.routing_trace`` or else from ``trace`` (static's routing.npz,
    recorded earlier in the same comparison) when it exists; the others take no trace."""
    system, selection, ratio = parse_system_name(name)
    routing_trace = cfg.train.routing_trace if system == "smartmoe" else ""
    if system == "smartmoe" and not routing_trace and trace is not None and trace.exists():
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


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarise(name: str, folder: Path, target: float) -> dict:
    rows = read_metrics(folder)
    evals = [r for r in rows if "val_loss" in r]
    hit = next((r for r in evals if r["val_loss"] <= target), None)
    return {
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
    }


def report(out: Path, target: float, unigram: float, systems: dict[str, dict]) -> str:
    lines = [
        "# lrmoe compare", "",
        f"Target validation loss: **{target:.4f}** (unigram loss of the corpus: {unigram:.4f}; "
        f"the target is {100 * (1 - target / unigram):.1f}% below it).", "",
        "| system | steps to target | MoE time to target (s) | final val loss | a2a bytes | bwd a2a bytes | "
        "peak expert-side bytes | mean kept ratio | placement bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v, spec):
        return "never" if v is None else format(v, spec)

    for name, r in systems.items():
        lines.append(
            f"| {name} | {fmt(r['steps_to_target'], 'd')} | {fmt(r['moe_time_to_target_s'], '.2f')} | "
            f"{fmt(r['final_val_loss'], '.4f')} | {r['a2a_bytes']:,} | {r['bwd_a2a_bytes']:,} | "
            f"{r['peak_expert_side_bytes']:,} | "
            f"{fmt(r['mean_kept_ratio'], '.3f')} | {r['placement_bytes']:,} |")
    lines += ["", "Plots: `val_loss_vs_moe_time.png`, `kept_ratio.png`, `expert_load.png`.", ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def plots(out: Path, names: list[str], target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        ev = [r for r in read_metrics(out / name) if "val_loss" in r]
        ax.plot([r["moe_time_s"] for r in ev], [r["val_loss"] for r in ev], marker="o", ms=3, label=name)
    ax.axhline(target, color="grey", ls="--", lw=1, label="target")
    ax.set_xlabel("cumulative MoE-layer time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title("Validation loss against MoE time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "val_loss_vs_moe_time.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name in names:
        rows = read_metrics(out / name)
        ax.plot([r["step"] for r in rows], [r["kept_ratio"] for r in rows], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("kept ratio (backward pairs)")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kept_ratio.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        path = out / name / "routing.npz"
        if path.exists():
            counts = np.load(path)["counts"]  # steps x layers x experts
            load = counts[:, 0, :] / np.maximum(counts[:, 0, :].sum(1, keepdims=True), 1)
            im = ax.imshow(load.T, aspect="auto", cmap="viridis", interpolation="nearest")
            fig.colorbar(im, ax=ax, fraction=0.046)
        ax.set_title(f"{name}: layer-0 load")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    fig.tight_layout()
    fig.savefig(out / "expert_load.png", dpi=120)
    plt.close(fig)


def target_from_static(folder: Path, step: int) -> float:
    for r in read_metrics(folder):
        if r["step"] == step and "val_loss" in r:
            return r["val_loss"]
    raise RuntimeError(f"static's run has no validation loss at step {step}")


def budget_steps(cfg: RunConfig) -> tuple[int, int, int]:
    steps = cfg.train.steps
    at = max(1, round(cfg.compare.target_fraction * steps))
    return steps, at, math.ceil(cfg.compare.budget_factor * steps)
