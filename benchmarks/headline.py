"""The headline: lrmoe's MoE time to target against the best exact system's, per memory cap,
split into a steps ratio × a MoE-time-per-step ratio, over seeds.

    lrmoe compare --config configs/paper.toml --set budget.memory_bytes=70_700_000 --seeds 0,1,2 \\
        --systems static,static-recompute,symi,ultraep,llep,capacity,lrmoe --out runs/cap0.65
    python benchmarks/headline.py --cap 0.65x=runs/cap0.65 --cap roomy=runs/roomy --out runs/headline

Each ``--cap LABEL=FOLDER[,FOLDER...]`` names ``lrmoe compare --seeds`` outputs at one cap (every
``seed-<s>/results*.json`` of them merged, or a cap sweep's ``seed-<s>/cap-LABEL/results*.json``;
a later folder's entry of a system wins). Per cap and system: the seeds that reached the target,
mean steps and MoE time to target and their spread. ``--target strict`` reads the strict target
(``compare.strict_fraction``: results.json's ``strict``) instead of the standard one.
The best exact system at a cap is the exact one (every pair's gradient, no drop in the forward:
static, static-recompute and the replication family) with the least mean MoE time to target
among those that reached it at every seed (the uncapped reference only where its peak fit the
cap); ``--lrmoe`` names the lrmoe row compared (default ``lrmoe``), ``--dropping`` the
forward-dropping ones (``capacity``; several, e.g. ``capacity@1.0,capacity@1.25,capacity@1.5``:
the best is the one with the least mean MoE time to target among those that reached it at every
seed, dropping at its best factor) and ``--versus`` other systems lrmoe is compared with
(``symi``: the issue's replication baseline). ``--corrected``: where a seed's systems ran in
folders made hours or sessions apart, each later folder's MoE and wall times are scaled to the
pace of the seed's first folder, by the ratio of the uncapped reference's time a step in each
(the same work: a machine's drift, not a system's).

Wall time beside MoE time: each run's ``wall_time_to_target_s`` (the training steps' wall time to
the target, evaluations and checkpoints excluded; missing from runs made before compare wrote it),
and the best exact system by wall time beside the best by MoE time.

Writes ``headline.json`` and ``headline.png`` (MoE time and wall time to target per cap, lrmoe
against the best exact system and capacity-factor dropping, seeds as points); prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lrmoe.systems import parse_system_name

EXACT_BACKWARDS = ("full", "recompute")


def is_exact(name: str) -> bool:
    """Every pair's gradient and no drop in the forward (the reference's own run counts)."""
    try:
        spec = parse_system_name(name.removesuffix("-uncapped")).spec
    except ValueError:
        return False
    return spec.backward.value in EXACT_BACKWARDS and not spec.forward_drop


def per_seed(folders: list[Path], label: str = "", target: str = "standard", corrected: bool = False
             ) -> dict[int, dict[str, dict]]:
    """{seed: {system: results.json's entry}} of one ``lrmoe compare --seeds`` output (or the cap
    ``label``'s folder of a cap sweep over seeds); a seed's ``results*.json`` are merged (a later
    compare into the same folder with ``--resume`` and other systems rewrites ``results.json``: keep
    the earlier one as ``results-<tag>.json``). ``target="strict"``: their strict target's entries.
    ``corrected``: each file's times scaled to the pace of the seed's first file (:func:`at_pace`)."""
    out: dict[int, dict[str, dict]] = {}
    first: dict[int, tuple[float, float | None]] = {}  # seed → its first file's reference pace
    for folder in folders:
        for sub in sorted(folder.glob("seed-*")):
            paths = sorted(sub.glob("results*.json")) or sorted((sub / f"cap-{label}").glob("results*.json"))
            if not paths:  # a seed still running (or never run) there
                continue
            seed = int(sub.name.removeprefix("seed-"))
            merged = out.setdefault(seed, {})
            for path in paths:
                doc = json.loads(path.read_text())
                if target == "strict" and "strict" not in doc:
                    raise SystemExit(f"{path}: no strict target (run lrmoe compare with compare.strict_fraction)")
                systems = (doc["strict"] if target == "strict" else doc)["systems"]
                if corrected:
                    own = reference_pace(systems, path)
                    systems = at_pace(systems, own, first.setdefault(seed, own))
                merged.update(systems)
    if not out:
        raise SystemExit(f"{', '.join(map(str, folders))}: no seed-*/results.json (lrmoe compare --seeds outputs)")
    return out


def reference_pace(systems: dict[str, dict], path: Path) -> tuple[float, float | None]:
    """The uncapped reference's MoE and wall seconds a step to the target in one results file: the
    same work wherever the seed's reference ran, so their ratio is the machine's pace."""
    ref = next((r for n, r in systems.items() if n.endswith("-uncapped") and r["steps_to_target"]), None)
    if ref is None:
        raise SystemExit(f"{path}: no uncapped reference that reached the target to correct the pace by")
    wall = ref.get("wall_time_to_target_s")
    return ref["moe_time_to_target_s"] / ref["steps_to_target"], wall and wall / ref["steps_to_target"]


def at_pace(systems: dict[str, dict], own: tuple[float, float | None], pace: tuple[float, float | None]
            ) -> dict[str, dict]:
    """A results file's entries with their MoE and wall times scaled from the pace its own
    reference ran at (``own``, :func:`reference_pace`) to ``pace`` (runs of one seed made hours or
    sessions apart on a machine whose speed drifts)."""
    scale = {"moe_time_to_target_s": pace[0] / own[0],
             "wall_time_to_target_s": pace[1] / own[1] if pace[1] and own[1] else None}
    return {n: {**r, **{k: r[k] * f for k, f in scale.items() if f is not None and r.get(k) is not None}}
            for n, r in systems.items()}


def summary(seeds: dict[int, dict[str, dict]], name: str) -> dict:
    """Mean and spread of one system's steps and MoE time to target over the seeds it ran."""
    rows = {s: doc[name] for s, doc in seeds.items() if name in doc}
    reached = {s: r for s, r in rows.items() if r["status"] == "reached"}
    steps = [r["steps_to_target"] for r in reached.values()]
    times = [r["moe_time_to_target_s"] for r in reached.values()]
    walls = [r.get("wall_time_to_target_s") for r in reached.values()]

    def spread(v: list[float]) -> dict:
        return {"mean": statistics.fmean(v), "min": min(v), "max": max(v)} if v and None not in v else None

    kept = [r["mean_kept_ratio"] for r in rows.values() if r["mean_kept_ratio"] is not None]  # (none: an oom at once)
    return {"seeds_run": sorted(rows), "seeds_reached": sorted(reached),
            "statuses": {s: r["status"] for s, r in rows.items()},
            "steps": spread(steps), "moe_time_s": spread(times), "wall_time_s": spread(walls),
            "per_step_ms": spread([1e3 * t / n for t, n in zip(times, steps)]),
            "mean_kept_ratio": statistics.fmean(kept) if kept else None,
            "per_seed": {s: {"steps": r["steps_to_target"], "moe_time_s": r["moe_time_to_target_s"],
                             "wall_time_s": r.get("wall_time_to_target_s"), "kept": r["mean_kept_ratio"],
                             "status": r["status"]} for s, r in rows.items()}}


def compare_cap(seeds: dict[int, dict[str, dict]], lrmoe: str, dropping: str | tuple[str, ...],
                versus: tuple[str, ...] = ()) -> dict:
    names = sorted({n for doc in seeds.values() for n in doc})
    systems = {n: summary(seeds, n) for n in names}
    every = set(seeds)
    cap = max((r["memory_cap_bytes"] or 0 for doc in seeds.values() for r in doc.values()), default=0)

    def within_cap(name: str) -> bool:  # the reference ran without the cap: it counts only where it fit
        return not name.endswith("-uncapped") or all(doc[name]["peak_expert_side_bytes"] <= cap
                                                    for doc in seeds.values() if name in doc)

    exact = [n for n in names if is_exact(n) and within_cap(n) and set(systems[n]["seeds_reached"]) == every]
    best = min(exact, key=lambda n: systems[n]["moe_time_s"]["mean"], default=None)
    walled = [n for n in exact if systems[n]["wall_time_s"]]
    best_wall = min(walled, key=lambda n: systems[n]["wall_time_s"]["mean"], default=None)
    drops = [n for n in ((dropping,) if isinstance(dropping, str) else dropping)
             if n in systems and set(systems[n]["seeds_reached"]) == every]
    best_drop = min(drops, key=lambda n: systems[n]["moe_time_s"]["mean"], default=None)
    out = {"systems": systems, "best_exact": best, "best_exact_wall": best_wall, "exact_candidates": exact,
           "best_dropping": best_drop}
    for label, other in (("vs_best_exact", best), ("vs_best_exact_wall", best_wall), ("vs_dropping", best_drop),
                         *((f"vs_{n}", n) for n in versus)):
        a, b = systems.get(lrmoe), systems.get(other) if other else None
        if a and b and a["steps"] and b["steps"]:
            out[label] = ratios(a, b, other)
    return out


def ratios(a: dict, b: dict, other: str) -> dict:
    """System ``a``'s MoE time to target over ``b``'s (= steps × per step), per seed too, and the
    wall time's ratio where both runs have it."""
    time = a["moe_time_s"]["mean"] / b["moe_time_s"]["mean"]
    steps = a["steps"]["mean"] / b["steps"]["mean"]
    common = sorted(set(a["seeds_reached"]) & set(b["seeds_reached"]))
    wall = a["wall_time_s"]["mean"] / b["wall_time_s"]["mean"] if a["wall_time_s"] and b["wall_time_s"] else None
    return {"system": other, "time_ratio": time, "steps_ratio": steps, "per_step_ratio": time / steps,
            "wall_ratio": wall,
            "per_seed_time_ratio": {s: a["per_seed"][s]["moe_time_s"] / b["per_seed"][s]["moe_time_s"]
                                    for s in common}}


def _mean_range(v: dict | None, spec: str) -> str:
    return "–" if not v else f"{v['mean']:{spec}} [{v['min']:{spec}}–{v['max']:{spec}}]"


def table(doc: dict) -> str:
    lines = ["| cap | system | seeds reached | steps to target (mean [min–max]) | MoE time to target s | "
             "per step ms | wall time to target s | kept |", "|---|---|---|---|---|---|---|---|"]
    for cap, c in doc["caps"].items():
        for name, r in c["systems"].items():
            tags = [t for t, best in (("best exact", c["best_exact"]), ("best exact by wall", c["best_exact_wall"]))
                    if name == best]
            tag = f" ({', '.join(tags)})" if tags else ""
            per = f"{r['per_step_ms']['mean']:.1f}" if r["per_step_ms"] else "–"
            lines.append(f"| {cap} | {name}{tag} | {len(r['seeds_reached'])}/{len(r['seeds_run'])} | "
                         f"{_mean_range(r['steps'], '.1f')} | {_mean_range(r['moe_time_s'], '.2f')} | {per} | "
                         f"{_mean_range(r['wall_time_s'], '.2f')} | "
                         f"{'–' if r['mean_kept_ratio'] is None else format(r['mean_kept_ratio'], '.3f')} |")
    lines += ["", "| cap | lrmoe vs | MoE time to target | = steps × per step | wall time to target | per seed (MoE) |",
              "|---|---|---|---|---|---|"]
    for cap, c in doc["caps"].items():
        for label in [k for k in c if k.startswith("vs_")]:
            v = c.get(label)
            if v and not (label == "vs_best_exact_wall" and v["system"] == c["best_exact"]):
                seeds = ", ".join(f"{t:.3f}" for t in v["per_seed_time_ratio"].values())
                change = f"{abs(100 * (1 - v['time_ratio'])):.1f} % {'less' if v['time_ratio'] < 1 else 'more'}"
                wall = "–" if v["wall_ratio"] is None else f"{v['wall_ratio']:.3f}×"
                lines.append(f"| {cap} | {v['system']} | {v['time_ratio']:.3f}× ({change}) "
                             f"| {v['steps_ratio']:.3f} × {v['per_step_ratio']:.3f} | {wall} | {seeds} |")
    return "\n".join(lines)


ROLES = (("best exact", "tab:blue"), ("lrmoe", "tab:red"), ("capacity", "tab:gray"))


def _panel(ax, doc: dict, lrmoe: str, key: str, ylabel: str) -> None:
    """One bar per role and cap of ``key`` (``moe_time_s`` or ``wall_time_s``), seeds as dots; the
    best exact system is the one by that measure; lrmoe's ratio to it inside lrmoe's bar."""
    caps = list(doc["caps"])
    width = 0.27
    best_key, vs_key = ("best_exact", "vs_best_exact") if key == "moe_time_s" else ("best_exact_wall",
                                                                                  "vs_best_exact_wall")
    for j, (role, color) in enumerate(ROLES):
        for i, cap in enumerate(caps):
            c = doc["caps"][cap]
            name = {"best exact": c[best_key], "lrmoe": lrmoe, "capacity": c["best_dropping"]}[role]
            r = c["systems"].get(name) if name else None
            if not r or not r[key]:
                continue
            x = i + (j - 1) * width
            ax.bar(x, r[key]["mean"], width, color=color, alpha=0.6,
                   label=role if role not in ax.get_legend_handles_labels()[1] else None)
            seeds = [v[key] for v in r["per_seed"].values() if v[key] is not None]
            ax.plot([x] * len(seeds), seeds, "k.", ms=4)
            # The name above the highest seed, clear of the dots; the ratio inside the bar, below them.
            ax.text(x, max(seeds, default=r[key]["mean"]) * 1.01, name.replace("-uncapped", "\nuncapped"),
                    ha="center", va="bottom", fontsize=7)
            v = c.get(vs_key)
            if role == "lrmoe" and v:
                ratio = v["time_ratio"] if key == "moe_time_s" else v["wall_ratio"]
                lines = [f"{ratio:.3f}×"] if ratio is not None else []
                if key == "moe_time_s":  # × the best exact system's = steps × per step
                    lines += [f"= {v['steps_ratio']:.3f}", "steps", f"× {v['per_step_ratio']:.3f}", "per step"]
                ax.text(x, r[key]["mean"] * 0.45, "\n".join(lines), ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(caps)), caps)
    ax.set_xlabel("per-rank memory cap")
    ax.set_ylabel(ylabel)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def plot(doc: dict, path: Path, lrmoe: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    walls = any(r["wall_time_s"] for c in doc["caps"].values() for r in c["systems"].values())
    fig, axes = plt.subplots(1, 2 if walls else 1, figsize=(12 if walls else 7, 4.5), squeeze=False)
    _panel(axes[0][0], doc, lrmoe, "moe_time_s", "MoE time to target (s)")
    if walls:
        _panel(axes[0][1], doc, lrmoe, "wall_time_s", "wall time to target (s): the training steps")
    fig.suptitle(f"Time to the target loss ({title}; bars: mean, dots: seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap", action="append", required=True,
                    help="LABEL=FOLDER[,FOLDER...]: lrmoe compare --seeds outputs at one cap")
    ap.add_argument("--lrmoe", default="lrmoe")
    ap.add_argument("--dropping", default="capacity", help="forward-dropping systems, comma-separated: the best")
    ap.add_argument("--versus", default="", help="other systems to compare lrmoe with, comma-separated (symi)")
    ap.add_argument("--target", choices=("standard", "strict"), default="standard")
    ap.add_argument("--title", default="configs/paper.toml, 2 CPU ranks", help="the plot's config, in words")
    ap.add_argument("--corrected", action="store_true",
                    help="scale a seed's later folders' times to its first folder's pace (the uncapped "
                         "reference's time a step in each): for runs made sessions apart")
    ap.add_argument("--out", default="runs/headline")
    args = ap.parse_args()
    caps = {}
    for entry in args.cap:
        label, sep, folder = entry.partition("=")
        if not sep:
            raise SystemExit(f"--cap {entry!r}: expected LABEL=FOLDER")
        seeds = per_seed([Path(f) for f in folder.split(",")], label, args.target, args.corrected)
        caps[label] = compare_cap(seeds, args.lrmoe, tuple(args.dropping.split(",")),
                                  tuple(n for n in args.versus.split(",") if n))
    doc = {"lrmoe": args.lrmoe, "dropping": args.dropping, "target": args.target, "corrected": args.corrected,
           "caps": caps}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headline.json").write_text(json.dumps(doc, indent=2))
    print(table(doc))
    plot(doc, out / "headline.png", args.lrmoe, f"{args.title}, {args.target} target")
    print(f"wrote {out}/headline.json and headline.png")


if __name__ == "__main__":
    main()
