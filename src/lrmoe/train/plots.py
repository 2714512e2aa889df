"""The plots of ``lrmoe compare``: ``val_loss_vs_moe_time.png``, ``kept_ratio.png`` and
``expert_load.png``, drawn from the per-system runs' ``metrics.jsonl``, ``config.toml`` and
``routing.npz`` (the tables: :mod:`lrmoe.train.report`)."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lrmoe.systems import base_system, spec_of
from lrmoe.train.metrics import read_metrics

# ten colours, then the same ten dashed, dotted, dash-dotted: tab20's pairs of one hue in a light
# and a dark shade are too alike for lines, and 12-16 systems must stay apart
LINESTYLES = ("-", "--", ":", "-.")
MAX_COLUMNS = 4  # expert_load.png's grid: at most this many panels a row, so its width stays bounded
PANEL_IN = (3.4, 2.5)  # one expert_load.png panel, inches


def selective(name: str) -> bool:
    """A run folder's system keeps only some backward pairs: only their kept ratio varies, so only
    they get a line in kept_ratio.png (a system that keeps everything is a flat line at 1 that
    hides the rest). A folder that names no system (compare's ``static-uncapped``) is not one."""
    system = base_system(name)
    return system is not None and spec_of(system).selective


@dataclass(frozen=True)
class Outcome:
    """One run against the target, read from its metrics as ``to_target.summarise`` reads them:
    ``time_s``/``step`` of the first evaluation at or below the target (None: not reached),
    ``oom_step`` (None: it did not run out of memory), its last validation loss."""

    time_s: float | None = None
    step: int | None = None
    oom_step: int | None = None
    final_val: float | None = None


def outcome(records: list[dict], target: float) -> Outcome:
    """The :class:`Outcome` of one run's ``metrics.jsonl`` records."""
    oom = next((r for r in records if "oom" in r), None)
    evals = [r for r in records if "val_loss" in r]
    hit = next((r for r in evals if r["val_loss"] <= target), None)
    return Outcome(time_s=hit["moe_time_s"] if hit else None, step=hit["step"] if hit else None,
                   oom_step=oom["step"] if oom else None, final_val=evals[-1]["val_loss"] if evals else None)


def legend_label(name: str, o: Outcome) -> str:
    """``name`` and how it ended: its MoE time (and step) to the target, or ``never`` (with its
    last validation loss), or ``oom at step N``; a run that reached the target and then ran out of
    memory says both."""
    if o.time_s is not None:
        label = f"{name}: {o.time_s:.{1 if o.time_s < 100 else 0}f} s (step {o.step})"
        return label + (f", then oom at step {o.oom_step}" if o.oom_step is not None else "")
    if o.oom_step is not None:
        return f"{name}: oom at step {o.oom_step}"
    return f"{name}: never" + (f" (final {o.final_val:.3f})" if o.final_val is not None else "")


def line_styles(names: list[str]) -> dict[str, dict]:
    """A colour and line style per system, distinct for up to 40 systems, the same in every plot."""
    import matplotlib

    colours = matplotlib.colormaps["tab10"].colors
    return {n: {"color": colours[i % len(colours)], "linestyle": LINESTYLES[(i // len(colours)) % len(LINESTYLES)]}
            for i, n in enumerate(names)}


def rolling_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` values (shorter at the start, so the output keeps the length)."""
    x = np.asarray(x, dtype=np.float64)
    if len(x) == 0 or window <= 1:
        return x
    c = np.cumsum(np.insert(x, 0, 0.0))
    n = np.arange(1, len(x) + 1)
    lo = np.maximum(n - window, 0)
    return (c[n] - c[lo]) / (n - lo)


def _config(folder: Path) -> dict:
    """A run's ``config.toml`` ({} when it has none)."""
    path = folder / "config.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def plots(out: Path, names: list[str], target: float) -> None:
    """Write :func:`figures` into ``out``."""
    import matplotlib.pyplot as plt

    for file, fig in figures(out, names, target).items():
        fig.savefig(out / file, dpi=120)
        plt.close(fig)


def figures(out: Path, names: list[str], target: float) -> dict:
    """``val_loss_vs_moe_time.png`` (each system's time to target marked on the target line),
    ``kept_ratio.png`` (the systems with a selective backward) and ``expert_load.png`` (every MoE
    layer of every system on one step range), readable with 16 systems: file name -> figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {n: read_metrics(out / n) for n in names}
    style = line_styles(names)
    return {"val_loss_vs_moe_time.png": _val_loss_figure(plt, records, style, target),
            "kept_ratio.png": _kept_ratio_figure(plt, out, records, style),
            "expert_load.png": _expert_load_figure(plt, out, names, {n: outcome(r, target).oom_step
                                                                    for n, r in records.items()})}


def _legend(fig, n_entries: int) -> None:
    """The figure's legend to the right of its axes (16 systems do not fit inside them)."""
    fig.legend(loc="outside right upper", fontsize="small", ncols=1 if n_entries <= 22 else 2, frameon=False)


def _val_loss_figure(plt, records: dict[str, list[dict]], style: dict[str, dict], target: float):
    """Validation loss against MoE time: the whole run and, beside it, the band near the target
    where the systems part; a triangle on the target line at each system's time to target, a
    cross where a run ran out of memory."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    evals = {n: [r for r in rows if "val_loss" in r] for n, rows in records.items()}
    outcomes = {n: outcome(rows, target) for n, rows in records.items()}
    for ax in axes:
        for n, ev in evals.items():
            o = outcomes[n]
            t, v = [r["moe_time_s"] for r in ev], [r["val_loss"] for r in ev]
            ax.plot(t, v, marker="o", ms=2, lw=1.3, **style[n], label=legend_label(n, o) if ax is axes[0] else None)
            if o.time_s is not None:
                ax.plot([o.time_s], [target], marker="v", ms=9, color=style[n]["color"], mec="black", mew=0.6,
                        ls="none", zorder=5)
            if o.oom_step is not None and ev:
                ax.plot([t[-1]], [v[-1]], marker="X", ms=9, color=style[n]["color"], mec="black", mew=0.6,
                        ls="none", zorder=5)
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.4f}" if ax is axes[0] else None)
        ax.set_xlabel("cumulative MoE-layer time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss")
    axes[0].set_title("whole run")
    _zoom_near_target(axes[1], evals, target, {n for n, o in outcomes.items() if o.oom_step is not None})
    axes[1].set_title("near the target")
    axes[0].plot([], [], marker="v", ms=8, color="white", mec="black", ls="none", label="time to target")
    axes[0].plot([], [], marker="X", ms=8, color="white", mec="black", ls="none", label="out of memory")
    fig.suptitle("Validation loss against MoE time; legend: MoE time to target (step), never, or oom")
    _legend(fig, len(records) + 3)
    return fig


def _zoom_near_target(ax, evals: dict[str, list[dict]], target: float, oom: set[str]) -> None:
    """Limit ``ax`` to the losses from the lowest one to the highest final one of the runs that did
    not run out of memory (an early oom ends high and would undo the zoom), at least a fifth and
    at most half of the way from the target up to the highest loss of all, and to the times from
    when the first run enters that band."""
    vals = [r["val_loss"] for ev in evals.values() for r in ev if math.isfinite(r["val_loss"])]
    if not vals:
        return
    finals = [ev[-1]["val_loss"] for n, ev in evals.items()
              if ev and n not in oom and math.isfinite(ev[-1]["val_loss"])]
    drop = max(vals) - target
    hi = max(target, min(max([*finals, target + 0.2 * drop]), target + 0.5 * drop))
    lo = min(min(vals), target)
    pad = max(0.15 * (hi - lo), 0.01 * abs(target), 1e-3)
    ax.set_ylim(lo - pad, hi + 2 * pad)
    times = [r["moe_time_s"] for ev in evals.values() for r in ev]
    inside = [r["moe_time_s"] for ev in evals.values() for r in ev if r["val_loss"] <= hi + 2 * pad]
    x0, x1 = min(inside, default=min(times)), max(times)
    # start at the eval before the first one in the band, so the curves enter from above
    before = [t for t in times if t < x0]
    x0 = max(before) if before else x0
    margin = 0.03 * max(x1 - x0, 1e-9)
    ax.set_xlim(x0 - margin, x1 + margin)


def _kept_ratio_figure(plt, out: Path, records: dict[str, list[dict]], style: dict[str, dict]):
    """Kept ratio per step, as a rolling mean (a memory cap makes it vary step to step), for the
    systems with a selective backward (and any other that dropped pairs); the ratio a system was
    given as a dotted line; a note names the systems that kept everything."""
    fig, ax = plt.subplots(figsize=(11, 4.2), layout="constrained")
    kept = {n: [(r["step"], r["kept_ratio"]) for r in rows if "kept_ratio" in r] for n, rows in records.items()}
    longest = max((k[-1][0] for k in kept.values() if k), default=0)
    window = max(1, min(50, round(longest / 40)))
    drawn, full, lows, empty = [], [], [], []
    for n, pairs in kept.items():
        if not pairs:
            empty.append(n)  # e.g. out of memory at its first step
            continue
        steps, ratio = np.array(pairs).T
        if not (selective(n) or ratio.min() < 1.0):
            full.append(n)
            continue
        drawn.append(n)
        smooth = rolling_mean(ratio, window)
        ax.plot(steps, smooth, lw=1.4, **style[n], label=f"{n} (mean {ratio.mean():.3f})")
        lows.append(float(smooth.min()))
        given = _config(out / n).get("backward", {}).get("ratio")
        if isinstance(given, (int, float)) and given < 1.0:
            ax.axhline(given, color=style[n]["color"], ls=":", lw=1)
            lows.append(float(given))
    everything = all(r == 1.0 for pairs in kept.values() for _, r in pairs)
    notes = []
    if everything:
        notes.append("every system kept every backward pair (kept ratio 1 at every step)")
    elif full:
        notes.append("kept every pair, not drawn: " + ", ".join(full))
    if empty:
        notes.append("no step recorded: " + ", ".join(empty))
    caps = [c for n in records if isinstance(c := _config(out / n).get("budget", {}).get("memory_bytes"), int)]
    if caps:
        notes.append(f"memory cap {max(caps) / 1e6:.1f} MB a rank")
    if notes:  # centred and larger on an empty plot, where the note is all there is to read
        ax.text(*((0.5, 0.5) if not drawn else (0.01, 0.02)), "\n".join(notes), transform=ax.transAxes,
                fontsize="large" if not drawn else "small", ha="center" if not drawn else "left",
                va="center" if not drawn else "bottom", wrap=True)
    ax.set_xlim(0, max(longest, 1) + 1)
    ax.set_ylim(max(0.0, min(lows, default=1.0) - 0.1) if not everything else 0.0, 1.03)
    ax.set_xlabel("step")
    ax.set_ylabel("kept ratio (backward pairs)")
    ax.set_title(f"Kept ratio, rolling mean over {window} step{'s' if window > 1 else ''}"
                 " (dotted: a system's fixed ratio)")
    ax.grid(alpha=0.3)
    if drawn:
        _legend(fig, len(drawn))
    return fig


def _expert_load_figure(plt, out: Path, names: list[str], oom_steps: dict[str, int | None]):
    """One panel per system, at most :data:`MAX_COLUMNS` a row: each expert's share of its layer's
    pairs per step, every MoE layer stacked (a white row between layers), one step range and one
    colour scale for all panels."""
    loads = {}
    for n in names:
        path = out / n / "routing.npz"
        if path.exists():
            counts = np.load(path)["counts"].astype(np.float64)  # steps x layers x experts
            if counts.ndim == 3 and counts.size:
                loads[n] = counts / np.maximum(counts.sum(2, keepdims=True), 1)
    steps = max((v.shape[0] for v in loads.values()), default=1)
    shares = np.concatenate([v.ravel() for v in loads.values()]) if loads else np.ones(1)
    vmax = float(np.quantile(shares, 0.995)) or 1.0  # a few early skewed steps must not wash out the rest
    cols = max(1, min(MAX_COLUMNS, len(names)))
    rows = math.ceil(len(names) / cols) if names else 1
    fig, axes = plt.subplots(rows, cols, figsize=(PANEL_IN[0] * cols + 1.2, PANEL_IN[1] * rows + 0.6),
                             squeeze=False, sharex=True, layout="constrained")
    im = None
    for ax, n in zip(axes.flat, names):
        oom = oom_steps.get(n)
        ax.set_title(n if oom is None else f"{n} (oom at step {oom})", fontsize="medium")
        if n not in loads:
            ax.text(0.5, 0.5, "no routing.npz", ha="center", va="center", transform=ax.transAxes)
            ax.set_yticks([])
            continue
        load = loads[n]
        s, layers, experts = load.shape
        # layers stacked top to bottom, one NaN row (drawn blank) between them
        blocks = [load[:, 0, :]]
        for i in range(1, layers):
            blocks += [np.full((s, 1), np.nan), load[:, i, :]]
        image = np.concatenate(blocks, axis=1).T
        im = ax.imshow(image, aspect="auto", cmap="viridis", interpolation="nearest", vmin=0.0, vmax=vmax,
                       extent=(0.5, s + 0.5, image.shape[0] - 0.5, -0.5))
        ax.set_yticks([i * (experts + 1) + (experts - 1) / 2 for i in range(layers)],
                      [f"layer {i}" for i in range(layers)], fontsize="small")
        ax.set_xlim(0.5, steps + 0.5)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("experts, by layer")
    if im is not None:
        fig.colorbar(im, ax=axes, label="share of the layer's pairs", shrink=0.9,
                     extend="max" if float(shares.max()) > vmax else "neither")
    fig.suptitle("Expert load per step (every MoE layer; one step range and colour scale)")
    return fig
