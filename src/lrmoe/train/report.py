"""The human-readable side of ``lrmoe compare``: ``report.md`` (one row per system, the
breakdown against the replicated baseline) and, from :mod:`lrmoe.train.plots`, the three plots,
drawn from the per-system runs' ``metrics.jsonl`` and ``routing.npz``."""

from __future__ import annotations

from pathlib import Path

from lrmoe.systems import REPLICATED_BASELINE
from lrmoe.train.plots import Outcome, figures, legend_label, line_styles, outcome, plots, rolling_mean

# the plots lived here before the split: their names stay importable from this module

__all__ = ["Outcome", "breakdown", "figures", "legend_label", "line_styles", "outcome", "plots", "report",
           "rolling_mean", "seeds_report"]


def breakdown(systems: dict[str, dict], baseline: str = REPLICATED_BASELINE) -> list[str]:
    """Each system's MoE time to target against ``baseline``'s, split into the ratio of steps to
    target and the ratio of MoE time per step to target (their product)."""
    base = systems.get(baseline)
    if base is None or base.get("status") != "reached":
        return []
    lines = [f"MoE time to target against {baseline}, split into steps × MoE time per step; wall time to "
             "target (the training steps') beside it:", "",
             "| system | MoE time to target | = steps to target | × MoE time per step | wall time to target |",
             "|---|---|---|---|---|"]
    per_step = base["moe_time_to_target_s"] / base["steps_to_target"]
    for name, r in systems.items():
        if name == baseline or r.get("status") != "reached":
            continue
        steps = r["steps_to_target"] / base["steps_to_target"]
        time = r["moe_time_to_target_s"] / base["moe_time_to_target_s"]
        wall = _ratio(r.get("wall_time_to_target_s"), base.get("wall_time_to_target_s"))
        lines.append(f"| {name} | {time:.3f}× | {steps:.3f}× | "
                     f"{r['moe_time_to_target_s'] / r['steps_to_target'] / per_step:.3f}× | {wall} |")
    return [*lines, ""]


def _ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``0.912×``; ``-`` where either is missing (a run written before wall times)."""
    return "-" if value is None or not base else f"{value / base:.3f}×"


def report(out: Path, doc: dict) -> str:
    """Write ``report.md`` for ``lrmoe compare``'s results document: one table row per system and
    the :func:`breakdown` against the replicated baseline (when it reached the target), and the
    same for the strict target where there is one; return its text for the terminal."""
    target, unigram = doc["target_loss"], doc["unigram_loss"]
    gap = 100 * (1 - target / unigram)  # (a short run's target can lie above the unigram loss)
    lines = [
        "# lrmoe compare", "",
        f"Target validation loss: **{target:.4f}** (unigram loss of the corpus: {unigram:.4f}; "
        f"the target is {abs(gap):.1f}% {'below' if gap >= 0 else 'above'} it).", "",
        "Steps to target: the first evaluation at or below the target; *crossed in*: the interval between "
        "it and the evaluation before it (the resolution of the measurement); *interpolated*: where the "
        "straight line between those two evaluations meets the target, an estimate.", "",
        "*MoE time*: the routed layers' forward, backward and placement; *wall time*: the whole training "
        "steps' (evaluations and checkpoints excluded).", "",
        *table(doc["details"]), "", *breakdown(doc["details"])]
    if "strict" in doc:
        strict = doc["strict"]
        lines += [f"## Strict target: {strict['target_loss']:.4f}, the reference's validation loss at step "
                  f"{strict['target_step']}", "", *table(strict["details"]), "", *breakdown(strict["details"])]
    lines += ["Plots: `val_loss_vs_moe_time.png`, `kept_ratio.png`, `expert_load.png`.", ""]
    text = "\n".join(lines)
    (out / "report.md").write_text(text)
    return text


def table(systems: dict[str, dict]) -> list[str]:
    """One Markdown table row per system of a results document's ``details``."""
    lines = [
        "| system | steps to target | crossed in | MoE time to target (s) | wall time to target (s) | "
        "interpolated: steps / MoE s | final val loss | steps run | a2a bytes / step | "
        "bwd a2a bytes / step | peak expert-side bytes | memory cap | replica slots | mean kept ratio | "
        "placement bytes | MoE ms / step | wall ms / step | load CV |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(v, spec):
        return "never" if v is None else format(v, spec)

    for name, r in systems.items():
        steps = max(r["steps_run"], 1)
        cap = r.get("memory_cap_bytes")
        cap = max(cap) if isinstance(cap, list) else cap
        to_target = f"oom at step {r['oom_step']}" if r.get("status") == "oom" else fmt(r["steps_to_target"], "d")
        bracket = r.get("target_bracket")
        crossed = "-" if not bracket else f"({bracket[0]}, {bracket[1]}]"
        interp = r.get("steps_to_target_interp")
        estimate = "-" if interp is None else f"{interp:.1f} / {r['moe_time_to_target_interp_s']:.2f}"
        lines.append(
            f"| {name} | {to_target} | {crossed} | {fmt(r['moe_time_to_target_s'], '.2f')} | "
            f"{fmt(r.get('wall_time_to_target_s'), '.2f')} | {estimate} | "
            f"{fmt(r['final_val_loss'], '.4f')} | {r['steps_run']} | {r['a2a_bytes'] // steps:,} | "
            f"{r['bwd_a2a_bytes'] // steps:,} | {r['peak_expert_side_bytes']:,} | "
            f"{'none' if cap is None else format(cap, ',')} | {fmt(r.get('replica_slots'), '.2f')} | "
            f"{fmt(r['mean_kept_ratio'], '.3f')} | {r['placement_bytes']:,} | "
            f"{fmt(r.get('moe_ms_per_step'), '.1f')} | {fmt(r.get('wall_ms_per_step'), '.1f')} | "
            f"{fmt(r.get('mean_load_cv'), '.2f')} |")
    return lines


def mean_range(r: dict, key: str, spec: str) -> str:
    """``mean [min–max]`` of ``key`` over the seeds that reached the target; ``never`` for none."""
    if r.get(f"{key}_mean") is None:
        return "never"
    return f"{r[f'{key}_mean']:{spec}} [{r[f'{key}_min']:{spec}}–{r[f'{key}_max']:{spec}}]"


def seeds_report(out: Path, doc: dict) -> str:
    """Write ``report.md`` of a comparison over seeds (:func:`lrmoe.train.sweep.aggregate`'s
    document): per system, mean [min–max] and sample standard deviation of steps and MoE time to
    target over the seeds that reached it; return its text."""
    seeds = doc["seeds"]
    targets = ", ".join(f"seed {s}: {doc['target_losses'][str(s)]:.4f}" for s in seeds)
    lines = [
        f"# lrmoe compare, {len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
        f"Target validation loss per seed (its own reference's): {targets}. Each seed's comparison: "
        f"`seed-<s>/report.md`.", "",
        "Over the seeds that reached the target: mean [min–max]; std: sample standard deviation (n − 1).", "",
        "| system | reached | steps to target | std | MoE time to target (s) | std | wall time to target (s) | std | "
        "interpolated steps (estimate) | coarsest crossing interval | final val loss (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def std(v, spec):
        return "-" if v is None else format(v, spec)

    for name, r in doc["systems"].items():
        reached = f"{r['seeds_reached']}/{r['seeds_run']}"
        if r["status"] == "oom":
            reached += f" (oom at step {r['oom_step']})"
        res = r.get("steps_to_target_resolution")
        lines.append(
            f"| {name} | {reached} | {mean_range(r, 'steps_to_target', '.1f')} | "
            f"{std(r['steps_to_target_std'], '.1f')} | {mean_range(r, 'moe_time_to_target_s', '.2f')} | "
            f"{std(r['moe_time_to_target_s_std'], '.2f')} | {mean_range(r, 'wall_time_to_target_s', '.2f')} | "
            f"{std(r.get('wall_time_to_target_s_std'), '.2f')} | {mean_range(r, 'steps_to_target_interp', '.1f')} | "
            f"{'-' if res is None else format(res, 'g')} | {std(r.get('final_val_loss'), '.4f')} |")
    text = "\n".join([*lines, ""])
    (out / "report.md").write_text(text)
    return text
