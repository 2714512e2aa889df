"""Paper-scale projection: per model and memory cap, each system's step time, memory and time
to target, from routing counts, the library's planners and the cost model.

Flow (one way): counts (trace or skew model) → :mod:`plan` (library placement, quotas,
redistribution) → :mod:`budget` (whole-step memory vs the cap) → :mod:`cost` (α–β and roofline
time) → :mod:`target` (steps to target from a measured compare run) → :mod:`report`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lrmoe.config import is_int_at_least
from lrmoe.meter import expert_param_bytes
from lrmoe.sim.budget import GIB, lrmoe_budget, step_peak_bytes
from lrmoe.sim.cost import PHASES, layer_seconds
from lrmoe.sim.errors import SimError
from lrmoe.sim.hardware import H200, Hardware
from lrmoe.sim.models import MODELS, ModelSpec
from lrmoe.sim.plan import LayerCall, SystemPlanner
from lrmoe.sim.report import plot_sensitivity, write_results
from lrmoe.sim.target import StepsToTarget
from lrmoe.sim.trace import load_trace, pick_layers, rescale_counts, zipf_counts
from lrmoe.systems import PlacementKind, parse_system_name

DTYPE_BYTES = 2  # bf16
SELECTIONS = ("lrm", "sampled", "random")


@dataclass(frozen=True)
class SimConfig:
    """Everything one projection depends on; each default is documented in docs/simulation.md."""

    model: str
    gpus: int
    memory_caps_gib: tuple[float, ...]
    link_gbps: float = 400.0
    trace: str | None = None
    compare: str | None = None
    steps: int = 20
    layers: int = 4
    tokens_per_gpu: int = 4096
    ratios: tuple[float, ...] = (0.5,)
    selection: str = "sampled"
    lrmoe_slots: str = "symi"  # "symi": SYMI's default slot count; "budget": the controller's from memory
    optimizer_bytes_per_param: float = 12.0
    zipf: float = 0.3
    drift: int = 4
    seed: int = 0
    target_steps: int = 1000
    hardware: Hardware = field(default=H200)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise SimError(f"unknown model {self.model!r}: expected one of {sorted(MODELS)}")
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise SimError(f"--gpus={self.gpus!r} is invalid: expected an integer >= 1")
        if not self.memory_caps_gib or any(not (c > 0) for c in self.memory_caps_gib):
            raise SimError(f"--gpu-memory={self.memory_caps_gib!r} is invalid: expected GiB values > 0")
        if not (self.link_gbps > 0):
            raise SimError(f"--link-gbps={self.link_gbps!r} is invalid: expected a number > 0")
        for name in ("steps", "layers", "tokens_per_gpu", "target_steps"):
            v = getattr(self, name)
            if not is_int_at_least(v, 1):
                raise SimError(f"{name}={v!r} is invalid: expected an integer >= 1")
        if not self.ratios or any(not (0 < r <= 1) for r in self.ratios):
            raise SimError(f"--ratios={self.ratios!r} is invalid: expected values in (0, 1]")
        if self.lrmoe_slots not in ("symi", "budget"):
            raise SimError(f"--lrmoe-slots={self.lrmoe_slots!r} is invalid: expected 'symi' or 'budget'")
        if self.selection not in SELECTIONS:
            raise SimError(f"--selection={self.selection!r} is invalid: expected one of {SELECTIONS}")

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]

    @property
    def hw(self) -> Hardware:
        return self.hardware.with_link_gbps(self.link_gbps)


def _check_caps(cfg: SimConfig) -> None:
    """Every cap must at least hold static's expert parameters, gradients and optimizer state."""
    spec = cfg.spec
    owned = -(-spec.num_experts // cfg.gpus)
    params = expert_param_bytes(spec.dim, spec.ffn_dim, 1) * owned
    need = spec.moe_layers * params * (2 * DTYPE_BYTES + cfg.optimizer_bytes_per_param)
    for cap in cfg.memory_caps_gib:
        if cap * GIB < need:
            raise SimError(f"--gpu-memory {cap:g} GiB is too small for {spec.name} on {cfg.gpus} GPUs: static's "
                           f"{owned} experts per GPU × {spec.moe_layers} layers need {need / GIB:.1f} GiB for "
                           f"parameters, gradients and optimizer state alone")


def routing_counts(cfg: SimConfig) -> tuple[np.ndarray, list[int], str]:
    """(steps, layers, E) int64 global counts at the model's scale, the layer indices they
    stand for, and a description of their source."""
    spec = cfg.spec
    tokens = cfg.tokens_per_gpu * cfg.gpus
    if cfg.trace is None:
        layers = pick_layers(spec.moe_layers, cfg.layers)
        counts = zipf_counts(cfg.steps, len(layers), spec.num_experts, tokens, spec.top_k, cfg.zipf, cfg.drift,
                             cfg.seed)
        return counts, layers, f"Zipf skew model (exponent {cfg.zipf}, {cfg.drift} swaps/step, seed {cfg.seed})"
    trace = load_trace(cfg.trace)
    steps = np.linspace(0, trace.shape[0] - 1, min(cfg.steps, trace.shape[0])).round().astype(int)
    layers = pick_layers(trace.shape[1], cfg.layers)
    counts = np.stack([np.stack([rescale_counts(trace[t, li], spec.num_experts, tokens, spec.top_k)
                                 for li in layers]) for t in steps])
    return counts, layers, (f"trace {cfg.trace} ({trace.shape[0]} steps × {trace.shape[1]} layers × "
                            f"{trace.shape[2]} experts; {len(steps)} steps used, rescaled)")


def _simulate_system(planners: list[SystemPlanner], counts: np.ndarray, bar: tqdm) -> list[list[LayerCall]]:
    out = []
    for t in range(counts.shape[0]):
        out.append([p.call(counts[t, li], DTYPE_BYTES) for li, p in enumerate(planners)])
        bar.update(1)
    return out


def summarise(calls: list[list[LayerCall]], cfg: SimConfig, hw: Hardware) -> dict:
    """Step time (all MoE layers), per-phase layer time, memory and kept ratio of one system.
    Host time (measured planner wall time) enters as its median over calls: a noisy host
    must not decide a projection."""
    spec = cfg.spec
    flat = [c for step in calls for c in step]
    host = statistics.median(c.host_s for c in flat)
    secs = [layer_seconds(replace(c, host_s=host), spec, hw, DTYPE_BYTES) for c in flat]
    phases = {p: 1e3 * float(np.mean([s[p] for s in secs])) for p in (*PHASES, "total")}
    return {
        "step_ms": phases["total"] * spec.moe_layers,
        "layer_ms": phases,
        "peak_expert_side_bytes": int(max(int(c.peak_R.max()) for c in flat)),
        "step_peak_bytes": step_peak_bytes(spec, calls, DTYPE_BYTES, cfg.optimizer_bytes_per_param),
        "kept_ratio": float(sum(c.kept_pairs for c in flat) / sum(c.total_pairs for c in flat)),
        "copies_per_rank": int(max(int(c.copies_R.max()) for c in flat)),
    }


def simulate(cfg: SimConfig, progress: bool = True) -> tuple[dict, dict]:
    """Run the projection of one model. Returns ({"meta": ..., "caps": {cap: {system: row}}},
    {cap: {system: calls}}), the calls kept for re-costing (link-bandwidth sensitivity)."""
    spec, W = cfg.spec, cfg.gpus
    config = spec.moe_config()
    _check_caps(cfg)
    counts, layers, source = routing_counts(cfg)
    target = StepsToTarget.load(cfg.compare)
    n_runs = 3 + len(cfg.memory_caps_gib) * (1 + len(cfg.ratios))
    bar = tqdm(total=n_runs * counts.shape[0], desc=f"simulate {cfg.model}", unit="step", disable=not progress,
               leave=False)

    def run(system: str, **kw) -> list[list[LayerCall]]:
        planners = [SystemPlanner(system, config, W, **kw) for _ in layers]
        return _simulate_system(planners, counts, bar)

    fixed = {name: run(name) for name in ("static", "static-recompute", "capacity")}
    symi = SystemPlanner("symi", config, W).planner
    owned, default_slots = len(symi.base.owned(0)), symi.slots_R[0]  # MoELayer's SYMI default
    lrmoe_slots = default_slots if cfg.lrmoe_slots == "symi" else None
    caps: dict[str, dict] = {}
    kept_calls: dict[str, dict] = {}
    for cap_gib in cfg.memory_caps_gib:
        cap = int(cap_gib * GIB)
        rows: dict[str, dict] = {}
        calls_by: dict[str, list[list[LayerCall]] | None] = {}
        notes: dict[str, str] = {}
        for name, calls in fixed.items():
            calls_by[name] = calls
        # symi: the library's default replica slots, fewer while the step does not fit
        for slots in range(default_slots, owned - 1, -1):
            calls = run("symi", slots=slots)
            if step_peak_bytes(spec, calls, DTYPE_BYTES, cfg.optimizer_bytes_per_param) <= cap or slots == owned:
                break
        calls_by["symi"] = calls
        for ratio in cfg.ratios:
            name = f"lrmoe-{cfg.selection}@{ratio:g}" if cfg.selection != "lrm" else f"lrmoe@{ratio:g}"
            # SYMI's slot count when the budget holds it, fewer otherwise (or the controller's own)
            tries = [None] if lrmoe_slots is None else list(range(lrmoe_slots, owned - 1, -1))
            for slots in tries:
                try:
                    M = lrmoe_budget(spec, W, cap, cfg.tokens_per_gpu, DTYPE_BYTES, cfg.optimizer_bytes_per_param,
                                     slots)
                    calls_by[name] = run("lrmoe", ratio=ratio, memory_bytes=M, slots=slots)
                    notes[name] = f"per-layer budget {M / GIB:.2f} GiB"
                    break
                except SimError as e:
                    calls_by[name] = None
                    notes[name] = str(e)
        for name, calls in calls_by.items():
            rows[name] = _row(name, calls, cfg, cap, target, notes.get(name))
        caps[f"{cap_gib:g}"] = rows
        kept_calls[f"{cap_gib:g}"] = calls_by
    bar.close()
    meta = {
        "model": spec.name, "moe_layers": spec.moe_layers, "gpus": W,
        "tokens_per_gpu": cfg.tokens_per_gpu, "link_gbps": cfg.link_gbps,
        "routing": source, "layers_simulated": layers, "steps_simulated": int(counts.shape[0]),
        "compare": target.source, "selection": cfg.selection, "lrmoe_slots": cfg.lrmoe_slots,
        "target_steps_static": cfg.target_steps,
        "hardware": cfg.hw.to_dict(), "optimizer_bytes_per_param": cfg.optimizer_bytes_per_param,
    }
    return {"meta": meta, "caps": caps}, kept_calls


def _steps_ratio(name: str, row: dict, target: StepsToTarget, cfg: SimConfig) -> tuple[float | None, str]:
    spec = parse_system_name(name).spec
    if spec.placement is PlacementKind.STATIC and not (spec.selective or spec.forward_drop):
        return 1.0, "exact backward (= static)"
    if not spec.selective:
        r = target.ratio(name)
        return r, "measured" if r is not None else "never reached the target in the compare run"
    r = target.lrmoe_ratio(cfg.selection, row["kept_ratio"])
    pts = ", ".join(f"{k:g}:{'not reached' if v is None else v}" for k, v in target.points(cfg.selection))
    how = f"interpolated at kept ratio {row['kept_ratio']:.3f} from {cfg.selection} points {{{pts}}}"
    return r, how if r is not None else "not reached / not measured at this kept ratio (" + how + ")"


def time_to_target(row: dict, calls, cfg: SimConfig, hw: Hardware) -> float | None:
    """MoE time to target of a simulated row on other hardware (same plans, same steps)."""
    if calls is None or row.get("status") != "ok":
        return None
    return summarise(calls, cfg, hw)["step_ms"] / 1e3 * row["steps_to_target"]


def _row(name: str, calls, cfg: SimConfig, cap: int, target: StepsToTarget, note: str | None) -> dict:
    if calls is None:
        return {"moe_time_to_target_s": None, "step_ms": None, "peak_expert_side_bytes": None,
                "status": "infeasible", "note": note}
    row = summarise(calls, cfg, cfg.hw)
    ratio, how = _steps_ratio(name, row, target, cfg)
    row["steps_to_target"] = None if ratio is None else ratio * cfg.target_steps
    row["steps_source"] = how
    oom = row["step_peak_bytes"] > cap
    row["status"] = "oom" if oom else ("not reached" if ratio is None else "ok")
    ok = not oom and ratio is not None
    row["moe_time_to_target_s"] = row["step_ms"] / 1e3 * row["steps_to_target"] if ok else None
    # the same without host planning time (measured on the simulation host, in Python)
    device_ms = row["step_ms"] - row["layer_ms"]["host"] * cfg.spec.moe_layers
    row["device_time_to_target_s"] = device_ms / 1e3 * row["steps_to_target"] if ok else None
    if note:
        row["note"] = note
    return row


BANDWIDTHS_GBPS = (100.0, 200.0, 400.0, 800.0, 1600.0)


def project(cfgs: list[SimConfig], out: Path, progress: bool = True, plots: bool = True) -> dict[str, dict]:
    """Simulate every model's config, then write table.md, results.json and the sensitivity
    plots (link bandwidth: the same plans re-costed, at each model's largest memory cap)."""
    results: dict[str, dict] = {}
    bandwidth: dict[str, dict[str, dict[float, float | None]]] = {}
    for cfg in cfgs:
        doc, calls = simulate(cfg, progress)
        results[cfg.model] = doc
        cap = max(doc["caps"], key=float)
        bandwidth[cfg.model] = {
            name: {g: time_to_target(row, calls[cap][name], cfg, cfg.hardware.with_link_gbps(g))
                   for g in BANDWIDTHS_GBPS}
            for name, row in doc["caps"][cap].items()}
        doc["meta"]["bandwidth_sensitivity"] = {
            "memory_cap_gib": cap,
            "moe_time_to_target_s": {n: {f"{g:g}": v for g, v in s.items()} for n, s in bandwidth[cfg.model].items()}}
    write_results(out, results)
    if plots:
        plot_sensitivity(out, results, bandwidth)
    return results
