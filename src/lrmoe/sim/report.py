"""Output of a projection: ``table.md`` (the published results' form), ``results.json`` and
sensitivity plots (GPU memory, link bandwidth).

``results.json``: ``{model: {memory_cap_gib: {system: {"moe_time_to_target_s", "step_ms",
"device_step_ms", "host_ms", "peak_expert_side_bytes", ...}}}}`` plus ``"_meta"`` with every
assumption of each model's run and ``"_what_if"`` ({model: {cap: {lrmoe: {steps: {host: %}}}}}).
"""

from __future__ import annotations

import json
from pathlib import Path

from lrmoe.memory.bytes import GIB
from lrmoe.systems import REFERENCE_SYSTEM, REPLICATED_BASELINE, TRIMMING_SYSTEM, base_system

# the tables' roles (the text names them too, so it follows systems.py): the time columns are
# measured against BASE (symi), the memory columns against REF (static); OURS (lrmoe) heads them
BASE, REF, OURS = REPLICATED_BASELINE, REFERENCE_SYSTEM, TRIMMING_SYSTEM


def _pct(new: float | None, ref: float | None) -> str:
    if new is None or ref is None or ref == 0:
        return "–"
    return f"{100 * (ref - new) / ref:+.1f} %"


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


HEADER = (f"Reduction vs {BASE}: ({BASE} − system) / {BASE} of cumulative MoE-layer time to the target loss "
          f"(positive = faster); {BASE} is its fastest replica count that fits the cap. Host planning: the "
          "library's planner calls in each layer call times their recorded benchmark cost "
          "(src/lrmoe/sim/planning_reference.json, from benchmarks/bench_planning.py), never this machine's "
          "clock, so every column is the same on an idle and a busy machine; on the critical path (`host ms`) "
          "all of it but the backward's plan, which counts only where it outlasts the forward's exchanges and "
          "expert compute it is planned during (`all planning ms`: every call); device-only: the same without "
          f"it. Memory reduction vs {REF}: ({REF} − system) / {REF} of the peak expert-side bytes of one "
          "layer call, max over ranks; step memory: the whole training step per GPU, all MoE layers. "
          "`oom`: the whole step does not fit the cap; `not reached`: no measured step count at this kept "
          "ratio. Assumptions and fair rules: docs/simulation.md.")


def _keep(modes: dict | None) -> str:
    if not modes:
        return "–"
    return " / ".join(f"{m} {100 * v:.0f} %" if v < 1 else m for m, v in sorted(modes.items(), key=lambda kv: -kv[1]))


def _ours(name: str) -> bool:
    """A row of the trimming system (any selection and ratio)."""
    return base_system(name) == OURS


def _lrmoe_names(rows: dict) -> list[str]:
    return [n for n in rows if _ours(n)]


def headline_md(results: dict[str, dict]) -> list[str]:
    """lrmoe against the best symi that fits, per model and cap: per-step device time and MoE
    time to target."""
    out = [f"## {OURS} against the best {BASE} that fits", "",
           f"| model | cap GiB | {BASE} slots | {BASE} device ms/step | {OURS} | {OURS} device ms/step | kept "
           f"| keep mode | {BASE} time to target s | {OURS} time to target s | vs {BASE} | device-only vs {BASE} "
           f"| fastest other that fits | {OURS} vs it |",
           "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    for model, doc in results.items():
        for cap, rows in doc["caps"].items():
            symi = rows.get(BASE, {})
            sym_ok = symi.get("status") == "ok"
            others = [(o["moe_time_to_target_s"], n) for n, o in rows.items()
                      if not _ours(n) and o.get("moe_time_to_target_s") is not None]
            best = min(others) if others else None
            for name in _lrmoe_names(rows):
                r = rows[name]
                out.append(
                    f"| {model} | {cap} | {symi.get('slots_per_rank', '–') if sym_ok else 'oom'} | "
                    f"{_num(symi.get('device_step_ms') if sym_ok else None, '.0f')} | {name} ({r.get('status')}) | "
                    f"{_num(r.get('device_step_ms'), '.0f')} | {_num(r.get('kept_ratio'), '.3f')} | "
                    f"{_keep(r.get('keep_modes'))} | {_num(symi.get('moe_time_to_target_s'), '.0f')} | "
                    f"{_num(r.get('moe_time_to_target_s'), '.0f')} | "
                    f"{_pct(r.get('moe_time_to_target_s'), symi.get('moe_time_to_target_s'))} | "
                    f"{_pct(r.get('device_time_to_target_s'), symi.get('device_time_to_target_s'))} | "
                    f"{'none' if best is None else f'{best[1]} ({best[0]:.0f} s)'} | "
                    f"{_pct(r.get('moe_time_to_target_s'), None if best is None else best[0])} |")
    return out + [""]


def what_if_md(results: dict[str, dict]) -> list[str]:
    """The what-if grids (lrmoe's steps × host planning) as one table per model."""
    out = [f"## What if: {OURS} vs {BASE} under other assumptions", "",
           f"Reduction of MoE time to target of {OURS} against the best {BASE} that fits (where {BASE} does not "
           f"fit: the fastest other system that does), same simulated device time; rows: {OURS}'s steps to "
           f"target (× {REF}'s; `measured`: the headline's, from the convergence study), columns: host "
           "planning per layer call of every system that plans (`0`, `1 ms`, `bench`: the headline's "
           f"benchmark figures). `not measured`: no measured steps at {OURS}'s kept ratio.", ""]
    for model, doc in results.items():
        out += [f"### {model}", "", f"| cap GiB | {OURS} | against | steps | host 0 | host 1 ms | host bench |",
                "|---:|---|---|---|---:|---:|---:|"]
        for cap, grids in doc.get("what_if", {}).items():
            for name, grid in grids.items():
                against = grid.get("against")
                if "measured" not in grid:  # nothing to compare
                    why = f"{name} {doc['caps'][cap][name].get('status')}" + ("" if against else ", no other fits")
                    out.append(f"| {cap} | {name} | {against or '–'} | – ({why}) | – | – | – |")
                    continue
                for steps in ("1.00", "1.05", "measured"):
                    row = grid.get(steps)
                    cells = [("–" if row is None else "not measured" if row[h] is None else f"{row[h]:+.1f} %")
                             for h in ("0", "1 ms", "bench")]
                    label = steps
                    if steps == "measured" and doc["caps"][cap][name].get("steps_ratio") is not None:
                        label = f"measured ({doc['caps'][cap][name]['steps_ratio']:.3f})"
                    out.append(f"| {cap} | {name} | {against} | {label} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def table_md(results: dict[str, dict]) -> str:
    """The headline (lrmoe vs the best symi that fits), the what-if grids, then per model and
    memory cap every system: step time (device, host), kept ratio and keep mode, steps and MoE
    time to target, reductions vs symi, expert-side peak and whole-step memory vs static."""
    out = ["# Projected MoE-layer training: time to target and memory", "", HEADER, ""]
    out += headline_md(results)
    out += what_if_md(results)
    for model, doc in results.items():
        meta = doc["meta"]
        out += [f"## {model} — {meta['gpus']} GPUs, {meta['tokens_per_gpu']} tokens/GPU, "
                f"{meta['link_gbps']:g} Gbit/s inter-node", "",
                f"Routing: {meta['routing']}. Steps to target: {'; '.join(meta.get('steps_sources', []))}; "
                f"{meta['compare']} ({REF} = {meta['target_steps_static']} steps). {OURS} selection: "
                f"{meta['selection']}; network budget {meta.get('network_budget')} × a balanced backward. "
                f"Host planning: {meta.get('planning_reference')} at {meta.get('planning_shape')}.{_warm(meta)}", ""]
        for cap, rows in doc["caps"].items():
            symi = rows.get(BASE, {})
            static = rows.get(REF, {})
            ref_t = symi.get("moe_time_to_target_s")
            ref_m = static.get("peak_expert_side_bytes")
            ref_d = symi.get("device_time_to_target_s")
            ref_s = static.get("step_peak_bytes")
            out += [f"### GPU memory cap {cap} GiB", "",
                    f"| system | status | slots a rank | keep | step ms | device ms | host ms | all planning ms | kept "
                    f"| steps × {REF} "
                    f"| MoE time to target s | vs {BASE} | device-only vs {BASE} | expert-side peak GiB | vs {REF} "
                    f"| step memory GiB | vs {REF} |",
                    "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for name, r in rows.items():
                peak = r.get("peak_expert_side_bytes")
                step_mem = r.get("step_peak_bytes")
                out.append(
                    f"| {name} | {r.get('status')} | {r.get('copies_per_rank', '–')} | {_keep(r.get('keep_modes'))} | "
                    f"{_num(r.get('step_ms'), '.0f')} | {_num(r.get('device_step_ms'), '.0f')} | "
                    f"{_num(r.get('host_ms'), '.0f')} | {_num(r.get('host_total_ms'), '.0f')} | "
                    f"{_num(r.get('kept_ratio'), '.3f')} | "
                    f"{_num(r.get('steps_ratio'), '.3f')} | "
                    f"{_num(r.get('moe_time_to_target_s'), '.0f')} | {_pct(r.get('moe_time_to_target_s'), ref_t)} | "
                    f"{_pct(r.get('device_time_to_target_s'), ref_d)} | "
                    f"{_num(None if peak is None else peak / GIB, '.2f')} | {_pct(peak, ref_m)} | "
                    f"{_num(None if step_mem is None else step_mem / GIB, '.1f')} | {_pct(step_mem, ref_s)} |")
            notes = [f"- {name}: {r['note']}" for name, r in rows.items() if r.get("note")]
            out += [""] + notes + ([""] if notes else [])
    return "\n".join(out)


def _warm(meta: dict) -> str:
    """The header's line on lrmoe's warm phase and later floors (none: empty)."""
    warm, late = meta.get("warm_phase"), meta.get("late_floors")
    if not (warm or late):
        return ""
    balance = "" if warm is None or warm.get("balance") is None else \
        f", no rank above {1 + warm['balance']:g}× the balanced mean"
    parts = [f"the first {warm['share']:.0%} of its steps at kept ratio ≤ {warm['ratio']:g}{balance} with no "
             f"time objective"] if warm else []
    parts += [f"from {f['from_share']:.0%} of its steps on the floor {f['floor']:g}" for f in late or ()]
    return (f" {OURS}'s phases: {'; '.join(parts)} (its rows: the phases weighted by their steps; memory: "
            f"the largest).")


def write_results(out: Path, results: dict[str, dict]) -> None:
    """``results.json`` and ``table.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {model: doc["caps"] for model, doc in results.items()}
    doc["_meta"] = {model: doc_["meta"] for model, doc_ in results.items()}
    doc["_what_if"] = {model: doc_.get("what_if", {}) for model, doc_ in results.items()}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    (out / "table.md").write_text(table_md(results))


def plot_sensitivity(out: Path, results: dict[str, dict], bandwidth: dict[str, dict[str, dict[float, float]]]
                     ) -> list[Path]:
    """``memory_sensitivity.png`` (time to target vs GPU memory cap) and
    ``bandwidth_sensitivity.png`` (vs inter-node link), one panel per model."""
    models = list(results)
    by_memory = {}  # model -> system -> {cap: MoE time to target}
    for model in models:
        caps = results[model]["caps"]
        by_memory[model] = {name: {float(c): caps[c][name].get("moe_time_to_target_s") for c in caps}
                            for name in next(iter(caps.values()))}
    largest = {model: max(results[model]["caps"], key=float) for model in models}
    return [
        _panels(out / "memory_sensitivity.png", by_memory, lambda m: f"{m}: sensitivity to GPU memory",
                "GPU memory cap (GiB)", "linear"),
        _panels(out / "bandwidth_sensitivity.png", {m: bandwidth.get(m, {}) for m in models},
                lambda m: f"{m}: sensitivity to link bandwidth ({largest[m]} GiB)", "inter-node Gbit/s per GPU",
                "log"),
    ]


def _panels(path: Path, series: dict[str, dict[str, dict[float, float | None]]], title, xlabel: str,
            xscale: str) -> Path:
    """One panel per model, one line per system (points without a value left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4), squeeze=False)
    for ax, (model, systems) in zip(axes[0], series.items()):
        for name, points in systems.items():
            xs = sorted(x for x, y in points.items() if y is not None)
            if xs:
                ax.plot(xs, [points[x] for x in xs], marker="o", label=name)
        ax.set(title=title(model), xlabel=xlabel, ylabel="MoE time to target (s)", xscale=xscale)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
