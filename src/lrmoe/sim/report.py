"""Output of a projection: ``table.md`` (the published results' form), ``results.json`` and
sensitivity plots (GPU memory, link bandwidth).

``results.json``: ``{model: {memory_cap_gib: {system: {"moe_time_to_target_s", "step_ms",
"peak_expert_side_bytes", ...}}}}`` plus ``"_meta"`` with every assumption of each model's run.
"""

from __future__ import annotations

import json
from pathlib import Path

from lrmoe.meter import GIB
from lrmoe.systems import REFERENCE_SYSTEM

SYMI = "symi"  # the reference of the time columns (the memory columns': REFERENCE_SYSTEM)


def _pct(new: float | None, ref: float | None) -> str:
    if new is None or ref is None or ref == 0:
        return "–"
    return f"{100 * (ref - new) / ref:+.1f} %"


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def table_md(results: dict[str, dict]) -> str:
    """Per model and memory cap: MoE time to target and its reduction vs symi, per-layer-call
    expert-side peak and its reduction vs static, whole-step memory and status."""
    out = ["# Projected MoE-layer training: time to target and memory", "",
           "Reduction vs symi: (symi − system) / symi of cumulative MoE-layer time to the target loss "
           "(positive = faster). Memory reduction vs static: (static − system) / static of the peak "
           "expert-side bytes of one layer call (placement + replicas + token buffers), max over ranks. "
           "Device-only: the same without the host time of the library's planners (measured on the "
           "simulation host, in Python). Step memory: the whole training step per GPU, all MoE layers. "
           "`oom`: the whole step does not fit the cap; `not reached`: the compare run measured no step "
           "count at this kept ratio. Assumptions: docs/simulation.md.", ""]
    for model, doc in results.items():
        meta = doc["meta"]
        out += [f"## {model} — {meta['gpus']} GPUs, {meta['tokens_per_gpu']} tokens/GPU, "
                f"{meta['link_gbps']:g} Gbit/s inter-node", "",
                f"Routing: {meta['routing']}. Steps to target: {meta['compare']} "
                f"(lrmoe variant: {meta['selection']}; static = {meta['target_steps_static']} steps).", ""]
        for cap, rows in doc["caps"].items():
            symi = rows.get(SYMI, {})
            static = rows.get(REFERENCE_SYSTEM, {})
            ref_t = symi.get("moe_time_to_target_s")
            ref_m = static.get("peak_expert_side_bytes")
            ref_d = symi.get("device_time_to_target_s")
            ref_s = static.get("step_peak_bytes")
            out += [f"### GPU memory cap {cap} GiB", "",
                    "| system | status | step ms | of which host ms | kept | steps to target "
                    "| MoE time to target s | vs symi | device-only vs symi | expert-side peak GiB | vs static "
                    "| step memory GiB | vs static |",
                    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for name, r in rows.items():
                peak = r.get("peak_expert_side_bytes")
                host = r["layer_ms"]["host"] * meta["moe_layers"] if "layer_ms" in r else None
                step_mem = r.get("step_peak_bytes")
                out.append(
                    f"| {name} | {r.get('status')} | {_num(r.get('step_ms'), '.0f')} | {_num(host, '.0f')} | "
                    f"{_num(r.get('kept_ratio'), '.3f')} | {_num(r.get('steps_to_target'), '.0f')} | "
                    f"{_num(r.get('moe_time_to_target_s'), '.0f')} | {_pct(r.get('moe_time_to_target_s'), ref_t)} | "
                    f"{_pct(r.get('device_time_to_target_s'), ref_d)} | "
                    f"{_num(None if peak is None else peak / GIB, '.2f')} | {_pct(peak, ref_m)} | "
                    f"{_num(None if step_mem is None else step_mem / GIB, '.1f')} | {_pct(step_mem, ref_s)} |")
            out.append("")
    return "\n".join(out)


def write_results(out: Path, results: dict[str, dict]) -> None:
    """``results.json`` and ``table.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {model: doc["caps"] for model, doc in results.items()}
    doc["_meta"] = {model: doc_["meta"] for model, doc_ in results.items()}
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
