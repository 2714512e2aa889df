"""The convergence study: steps and MoE time to the target loss vs kept ratio, per selection.

    python benchmarks/convergence.py --config configs/compare.toml --out runs/convergence

Runs the compare model on its ranks (2 by default): ``static`` once for the target (its
validation loss at ``target_fraction`` of its steps), then ``lrmoe`` with every selection at
every fixed ratio (``--ratios``) and under every memory budget (``--budgets``: the kept share of
a balanced layer call's rows the budget leaves room for; the controller then sets per-expert
quotas, max–min fair, so hot experts are trimmed first). Each run stops at the target or at
``budget_factor`` × static's steps. Evaluations every ``--eval-every`` steps set the resolution
of steps to target. ``--resume`` keeps runs that finished with the same config.

Writes ``convergence.json`` (one row per run: selection, quota kind, mean kept ratio, steps and
MoE time to target and their ratios to static) and ``convergence.png``; prints the table.

    python benchmarks/convergence.py --from-compare runs/roomy --out runs/convergence-paper

reads an ``lrmoe compare --seeds`` output instead (``lrmoe@<ratio>`` runs: quota ``ratio``; an
``lrmoe`` run under a memory cap: quota ``budget``; every seed's ``results*.json``) and writes the
same study with steps to target the means over the seeds (each run's ``per_seed`` keeps every
seed's steps and ratio to that seed's static), which ``lrmoe simulate --convergence`` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

from common import selection_variant

from lrmoe.config import ClusterBudget
from lrmoe.memory.bytes import ByteModel
from lrmoe.planning.placement import Placement
from lrmoe.systems import REFERENCE_SYSTEM
from lrmoe.train.compare import budget_steps, finished, system_config, target_from_reference
from lrmoe.train.config import RunConfig, load
from lrmoe.train.launch import launch
from lrmoe.train.to_target import summarise

SELECTIONS = ("lrm", "random", "sampled", "local-sampled")


def budget_bytes(cfg: RunConfig, kept: float) -> int:
    """Per-rank memory for the owned experts' slots plus ``kept`` of a balanced call's rows kept
    in the backward (``ClusterBudget(slots=owned)``: no replicas, so the budget goes to rows)."""
    moe, W = cfg.model.moe, cfg.train.nproc
    bm = ByteModel.of(moe)
    owned = max(len(Placement.static(moe.num_experts, W).owned(r)) for r in range(W))
    rows = cfg.train.batch * cfg.model.seq_len * moe.top_k  # pairs a rank receives when balanced
    return bm.slots_reserved(owned, owned) + int(kept * rows * bm.bwd_kept)


def runs(cfg: RunConfig, selections: list[str], ratios: list[float], budgets: list[float]) -> dict[str, RunConfig]:
    """Every run of the study by name, the reference first."""
    out = {REFERENCE_SYSTEM: system_config(cfg, REFERENCE_SYSTEM)}

    def lrmoe(base: RunConfig, label: str, ratio: float) -> RunConfig:
        run_cfg = system_config(base, f"lrmoe@{ratio:g}")
        return replace(run_cfg, backward=replace(run_cfg.backward, **selection_variant(label)))

    W = cfg.train.nproc
    owned = len(Placement.static(cfg.model.moe.num_experts, W).owned(W - 1))
    for sel in selections:
        for r in ratios:
            out[f"{sel}@{r:g}"] = lrmoe(cfg, sel, r)
        for k in budgets:
            budget = ClusterBudget(memory_bytes=budget_bytes(cfg, k), slots=owned)
            out[f"{sel}/budget{k:g}"] = lrmoe(replace(cfg, budget=budget), sel, 1.0)
    return out


def study(cfg: RunConfig, plan: dict[str, RunConfig], out: Path, resume: bool) -> dict:
    steps, target_step, max_steps = budget_steps(cfg)
    rows: dict[str, dict] = {}
    target = None
    for i, (name, run_cfg) in enumerate(plan.items()):
        folder = out / name.replace("/", "_")
        t0 = time.time()
        if not (resume and finished(run_cfg, folder)):
            print(f"-- [{i + 1}/{len(plan)}] {name}", flush=True)
            if name == REFERENCE_SYSTEM:
                launch(run_cfg, folder, eval_at=(target_step,))
            else:
                launch(run_cfg, folder, max_steps=max_steps, stop_at=target)
        if name == REFERENCE_SYSTEM:
            target = cfg.compare.target_loss or target_from_reference(folder, target_step)
        r = summarise(folder, target)
        kind = "budget" if "/budget" in name else ("reference" if name == REFERENCE_SYSTEM else "ratio")
        rows[name] = {"selection": name.split("@")[0].split("/")[0] if kind != "reference" else None,
                      "quota": kind, "ratio": run_cfg.backward.ratio, **r,
                      "budget_bytes": run_cfg.budget.memory_bytes if kind == "budget" else None,
                      "wall_s": round(time.time() - t0, 1)}
    ref = rows[REFERENCE_SYSTEM]
    for r in rows.values():
        ok = r["steps_to_target"] is not None
        r["steps_vs_static"] = r["steps_to_target"] / ref["steps_to_target"] if ok else None
        r["moe_time_vs_static"] = r["moe_time_to_target_s"] / ref["moe_time_to_target_s"] if ok else None
    return {"target_loss": target, "reference_steps": steps, "target_step": target_step, "max_steps": max_steps,
            "eval_every": cfg.train.eval_every, "runs": rows}


def from_compare(folder: Path) -> dict:
    """A study from an ``lrmoe compare --seeds`` output: steps to target means over the seeds
    that reached it (None where a seed did not), MoE times likewise."""
    by_run: dict[str, dict[int, dict]] = {}
    selection, eval_every, steps, target_step, max_steps = None, None, None, None, None
    for sub in sorted(folder.glob("seed-*")):
        seed = int(sub.name.removeprefix("seed-"))
        for path in sorted(sub.glob("results*.json")):
            for name, r in json.loads(path.read_text())["systems"].items():
                by_run.setdefault(name, {})[seed] = r
        cfg = load(str(sub / "config.toml"))
        selection = cfg.backward.selection
        eval_every = cfg.compare.dense_eval_every or cfg.train.eval_every
        steps, target_step, max_steps = budget_steps(cfg)
    ref = f"{REFERENCE_SYSTEM}-uncapped" if f"{REFERENCE_SYSTEM}-uncapped" in by_run else REFERENCE_SYSTEM
    if ref not in by_run:
        raise SystemExit(f"{folder}: no {REFERENCE_SYSTEM} run in seed-*/results*.json")
    rows: dict[str, dict] = {}
    for name, seeds in by_run.items():
        if name == ref:
            kind, sel, ratio = "reference", None, 1.0
        elif name.startswith("lrmoe@"):
            kind, sel, ratio = "ratio", selection, float(name.split("@")[1])
        elif name == "lrmoe" and any(r["memory_cap_bytes"] for r in seeds.values()):
            kind, sel, ratio = "budget", selection, 1.0
        else:
            continue
        reached = all(r["steps_to_target"] is not None for r in seeds.values())
        per_seed = {s: {"steps_to_target": r["steps_to_target"], "mean_kept_ratio": r["mean_kept_ratio"],
                        "steps_vs_static": None if r["steps_to_target"] is None or s not in by_run[ref] else
                        r["steps_to_target"] / by_run[ref][s]["steps_to_target"]} for s, r in seeds.items()}
        rows[REFERENCE_SYSTEM if kind == "reference" else name.replace("lrmoe", selection, 1)] = {
            "selection": sel, "quota": kind, "ratio": ratio,
            "mean_kept_ratio": statistics.fmean(r["mean_kept_ratio"] for r in seeds.values()),
            "steps_to_target": statistics.fmean(r["steps_to_target"] for r in seeds.values()) if reached else None,
            "moe_time_to_target_s": statistics.fmean(r["moe_time_to_target_s"] for r in seeds.values())
            if reached else None,
            "steps_run": max(r["steps_run"] for r in seeds.values()), "seeds": sorted(seeds), "per_seed": per_seed}
    ref_row = rows[REFERENCE_SYSTEM]
    for r in rows.values():
        ok = r["steps_to_target"] is not None
        r["steps_vs_static"] = r["steps_to_target"] / ref_row["steps_to_target"] if ok else None
        r["moe_time_vs_static"] = r["moe_time_to_target_s"] / ref_row["moe_time_to_target_s"] if ok else None
    return {"target_loss": None, "reference_steps": steps,
            "target_step": target_step, "max_steps": max_steps, "eval_every": eval_every,
            "source": f"lrmoe compare --seeds output {folder}: means over seeds {sorted(by_run[ref])}",
            "runs": dict(sorted(rows.items(), key=lambda kv: (kv[1]["quota"] != "reference", -kv[1]["ratio"])))}


def table(doc: dict) -> str:
    target = "each seed's own" if doc["target_loss"] is None else f"{doc['target_loss']:.4f}"
    lines = [f"target {target} (static at step {doc['target_step']}); evaluations every "
             f"{doc['eval_every']} steps; others stop at {doc['max_steps']}",
             "| run | kept ratio | steps to target | vs static | MoE time to target (s) | vs static |",
             "|---|---|---|---|---|---|"]
    for name, r in doc["runs"].items():
        def f(v, fmt):
            return "never" if v is None else format(v, fmt)
        lines.append(f"| {name} | {r['mean_kept_ratio']:.3f} | {f(r['steps_to_target'], 'g')} | "
                     f"{f(r['steps_vs_static'], '.3f')} | {f(r['moe_time_to_target_s'], '.2f')} | "
                     f"{f(r['moe_time_vs_static'], '.3f')} |")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    never = doc["max_steps"] / doc["reference_steps"] / (doc["target_step"] / doc["reference_steps"]) * 1.02
    fig, ax = plt.subplots(figsize=(8, 5))
    sels = sorted({r["selection"] for r in doc["runs"].values() if r["selection"]})
    for j, sel in enumerate(sels):
        color = plt.cm.tab10(j)
        for kind, marker, ls in (("ratio", "o", "-"), ("budget", "s", "none")):
            pts = sorted((r["mean_kept_ratio"], r["steps_vs_static"] or never)
                         for r in doc["runs"].values() if r["selection"] == sel and r["quota"] == kind)
            if pts:
                ax.plot(*zip(*pts), marker=marker, ls=ls, color=color,
                        label=f"{sel} ({'fixed ratio' if kind == 'ratio' else 'memory budget'})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.05, color="k", lw=0.8, ls=":")
    ax.axhline(never, color="r", lw=0.8, ls="--")
    ax.text(0.99, never, "never (within the step cap)", color="r", ha="right", va="bottom",
            transform=ax.get_yaxis_transform(), fontsize=8)
    ax.set_xlabel("mean kept ratio (pairs kept in the backward)")
    ax.set_ylabel("steps to target / static's")
    ax.set_title("Convergence of trimmed backwards (2 ranks, compare model)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/compare.toml")
    ap.add_argument("--selections", default=",".join(SELECTIONS))
    ap.add_argument("--ratios", default="0.95,0.9,0.75,0.5")
    ap.add_argument("--budgets", default="0.9,0.75", help="kept shares a per-rank memory budget leaves room for")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--steps", type=int, help="static's steps (default: the config's)")
    ap.add_argument("--out", default="runs/convergence")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--from-compare", metavar="FOLDER", help="an lrmoe compare --seeds output to read instead")
    args = ap.parse_args()
    if args.from_compare:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = from_compare(Path(args.from_compare))
        (out / "convergence.json").write_text(json.dumps(doc, indent=2))
        print(table(doc))
        plot(doc, out / "convergence.png")
        print(f"wrote {out}/convergence.json and convergence.png")
        return
    cfg = load(args.config)
    cfg = cfg.with_train(eval_every=args.eval_every, **({"steps": args.steps} if args.steps else {}))

    def floats(text: str) -> list[float]:
        return [float(v) for v in text.split(",") if v.strip()]

    plan = runs(cfg, [s for s in args.selections.split(",") if s], floats(args.ratios), floats(args.budgets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = study(cfg, plan, out, args.resume)
    (out / "convergence.json").write_text(json.dumps(doc, indent=2))
    print(table(doc))
    plot(doc, out / "convergence.png")
    print(f"wrote {out}/convergence.json and convergence.png")


if __name__ == "__main__":
    main()
