"""The noise objective's threshold τ on tuning seeds: lrmoe runs at each τ against finished
comparisons' targets and exact systems, without rerunning them.

    python benchmarks/tune_noise.py --compare runs/sweep/s0/cap-70.7MB,runs/sweep/s1/cap-70.7MB \\
        --thresholds 0.25,0.5,1 --out runs/tune

Each ``--compare`` folder is one finished ``lrmoe compare`` (its ``config.toml`` with the seed and
the cap, its ``results.json`` with the target and every system's figures). lrmoe runs there with
``backward.objective = "noise"`` and each τ, to the same target and step cap (``--set`` adds
overrides), into ``OUT/<compare folder's last two parts>/tau-<τ>``; a finished run is kept. Per τ:
steps and MoE time to target over the best exact system's in that comparison (least MoE time to
target among the exact systems that reached it), mean over the folders. With ``--strict-step N``
each run goes on to a strict target, the uncapped reference's validation loss at its step N (as
``compare.strict_fraction`` does), and its steps there are set against the reference's (the
comparison's exact systems stopped at the standard target). Writes ``tune.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lrmoe.train.compare import (
    budget_steps,
    finished,
    launch,
    refine,
    run_on,
    system_config,
    target_from_reference,
    with_dense_checkpoints,
)
from lrmoe.train.config import apply_sets, from_dict, read_config
from lrmoe.train.sweep_seeds import exact
from lrmoe.train.to_target import summarise


def run_tau(compare: Path, tau: float, sets: list[str], out: Path, strict_step: int = 0) -> dict:
    """lrmoe at threshold ``tau`` to ``compare``'s target: its summary beside the best exact system's."""
    results = json.loads((compare / "results.json").read_text())
    raw = apply_sets(read_config(compare / "config.toml"),
                     [*sets, 'backward.objective="noise"', "backward.trim_after=0", f"backward.noise_threshold={tau}"])
    cfg = from_dict(raw)
    run_cfg = with_dense_checkpoints(system_config(cfg, "lrmoe"))
    _, _, max_steps = budget_steps(cfg)
    target = results["target_loss"]
    if not finished(run_cfg, out):
        launch(run_cfg, out, max_steps=max_steps, stop_at=target)
        refine(run_cfg, out, target, max_steps)
    strict = target_from_reference(compare / "static-uncapped", strict_step) if strict_step else None
    if strict is not None:
        run_on(run_cfg, out, strict, max_steps)
    ours = summarise(out, target, cfg.budget.memory_bytes if cfg.budget else None)
    reached = {n: r for n, r in results["systems"].items() if exact(n) and r["status"] == "reached"
               and not n.endswith("-uncapped")}
    best = min(reached, key=lambda n: reached[n]["moe_time_to_target_s"])
    b = reached[best]
    row = {"compare": str(compare), "tau": tau, "best_exact": best, "status": ours["status"],
           "steps": ours["steps_to_target"], "best_steps": b["steps_to_target"],
           "moe_ms_per_step": ours["moe_ms_per_step"], "best_moe_ms_per_step": b["moe_ms_per_step"],
           "mean_kept_ratio": ours["mean_kept_ratio"]}
    if ours["status"] == "reached":
        row["steps_ratio"] = ours["steps_to_target"] / b["steps_to_target"]
        row["moe_time_ratio"] = ours["moe_time_to_target_s"] / b["moe_time_to_target_s"]
    if strict is not None:
        mine = summarise(out, strict)
        ref = summarise(compare / "static-uncapped", strict)
        row.update(strict_status=mine["status"], strict_steps=mine["steps_to_target"],
                   strict_reference_steps=ref["steps_to_target"],
                   strict_steps_ratio=(mine["steps_to_target"] / ref["steps_to_target"]
                                       if mine["status"] == "reached" else None))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", required=True, help="comma-separated finished lrmoe compare folders")
    ap.add_argument("--thresholds", required=True, help="comma-separated τ, e.g. 0.25,0.5,1")
    ap.add_argument("--set", action="append", default=[], help="a config override for lrmoe's runs")
    ap.add_argument("--strict-step", type=int, default=0, help="also the reference's loss at this step (0: no)")
    ap.add_argument("--out", type=Path, default=Path("runs/tune"))
    a = ap.parse_args()
    rows = []
    for tau in (float(t) for t in a.thresholds.split(",")):
        for compare in (Path(c) for c in a.compare.split(",")):
            rows.append(run_tau(compare, tau, a.set, a.out / compare.parent.name / compare.name / f"tau-{tau:g}",
                                a.strict_step))
            r = rows[-1]
            strict = (f", strict: {r['strict_steps']} steps (reference {r['strict_reference_steps']})"
                      if a.strict_step else "")
            print(f"tau {tau:g} {compare}: {r['status']} steps {r['steps']} ({r['best_exact']} {r['best_steps']}), "
                  f"MoE ms/step {r['moe_ms_per_step']:.1f} ({r['best_moe_ms_per_step']:.1f}), "
                  f"kept {r['mean_kept_ratio']:.3f}{strict}", flush=True)
    print("| τ | steps ÷ best exact | MoE time ÷ best exact | kept | strict: steps ÷ reference |")
    print("|---|---|---|---|---|")
    for tau in sorted({r["tau"] for r in rows}):
        mine = [r for r in rows if r["tau"] == tau]
        means = [f"{statistics.fmean(r[k] for r in mine):.3f}" if all(r["status"] == "reached" for r in mine)
                 else "missed" for k in ("steps_ratio", "moe_time_ratio")]
        strict = [r.get("strict_steps_ratio") for r in mine]
        strict = f"{statistics.fmean(strict):.3f}" if a.strict_step and None not in strict else "–"
        print(f"| {tau:g} | {means[0]} | {means[1]} | {statistics.fmean(r['mean_kept_ratio'] for r in mine):.3f} "
              f"| {strict} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tune.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
