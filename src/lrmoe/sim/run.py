"""Paper-scale projection: per model and memory cap, each system's step time, memory and time
to target, from routing counts, the library's planners and the cost model.

Flow (one way): counts (trace or skew model) → :mod:`plan` (library placement, quotas,
redistribution; host planning from :mod:`host`'s reference) → :mod:`budget` (whole-step memory
vs the cap) → :mod:`cost` (α–β and roofline time) → :mod:`target` (steps to target from measured
runs) → :mod:`whatif`, :mod:`report`.

Fair rules (docs/simulation.md "Fair rules"): every system sees the same cap; symi's replica
slots are searched in both directions from its default and its fastest fitting count is
reported; lrmoe's replicas are its controller's per-step cost search, its kept ratio the
controller's quotas at the cap (with a network budget; ``--ratios`` only caps it), its per-layer
budget the largest whose whole step fits; exact backwards (static, symi) take static's steps;
host planning is a fixed reference, never this machine's clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lrmoe.planning.replica_search import replica_candidates
from lrmoe.sim.budget import GIB, lrmoe_budget, step_peak_bytes
from lrmoe.sim.config import DTYPE_BYTES, SimConfig, check_caps, routing_counts
from lrmoe.sim.cost import PHASES, layer_seconds
from lrmoe.sim.errors import SimError
from lrmoe.sim.hardware import Hardware
from lrmoe.sim.host import PlanningReference
from lrmoe.sim.layer_calls import LayerCall, SystemPlanner
from lrmoe.sim.report import plot_sensitivity, write_results
from lrmoe.sim.target import StepsToTarget
from lrmoe.sim.whatif import what_if, what_if_reference
from lrmoe.systems import PlacementKind, parse_system_name

PREFIX_STEPS = 4  # steps of a trial run in lrmoe's budget search (replicas exist from the second)
BUDGET_TRIES = 5  # trial runs per cap in that search
BUDGET_TOLERANCE = 0.02  # stop once the step is within this share of the cap


@dataclass
class Run:
    """One system's planners (one per representative layer) and the calls simulated so far."""

    planners: list[SystemPlanner]
    calls: list[list[LayerCall]] = field(default_factory=list)

    def advance(self, counts: np.ndarray, steps: int, bar: tqdm) -> Run:
        """Simulate up to ``steps`` steps in all (continuing where the run stands)."""
        for t in range(len(self.calls), min(steps, counts.shape[0])):
            self.calls.append([p.call(counts[t, li], DTYPE_BYTES) for li, p in enumerate(self.planners)])
            bar.update(1)
        return self


def summarise(calls: list[list[LayerCall]], cfg: SimConfig, hw: Hardware) -> dict:
    """Step time (all MoE layers), per-phase layer time, memory and kept ratio of one system.
    Host time is the reference cost of the planner calls (the same on every machine), its mean
    over calls; one-time planning (lrmoe's first, full replica-count search) is left out of it
    and reported as ``host_once_ms`` (all MoE layers, once per run); the live wall time of the
    same planning on this machine is reported beside it."""
    spec = cfg.spec
    flat = [c for step in calls for c in step]
    secs = [layer_seconds(c, spec, hw, DTYPE_BYTES) for c in flat]
    phases = {p: 1e3 * float(np.mean([s[p] for s in secs])) for p in (*PHASES, "total")}
    keeps = [c.keep for c in flat if c.keep is not None]
    planner_calls: dict[str, float] = {}
    for c in flat:
        for name, n in c.planner_calls.items():
            planner_calls[name] = planner_calls.get(name, 0.0) + n / len(flat)
    L = spec.moe_layers
    return {
        "step_ms": phases["total"] * L,
        "device_step_ms": (phases["total"] - phases["host"]) * L,
        "host_ms": phases["host"] * L,
        "host_live_ms": 1e3 * float(np.median([c.host_live_s for c in flat])) * L,
        "host_once_ms": 1e3 * float(sum(c.once_host_s for c in flat)) / len(calls[0]) * L,
        "layer_ms": phases,
        "peak_expert_side_bytes": int(max(int(c.peak_R.max()) for c in flat)),
        "step_peak_bytes": step_peak_bytes(spec, calls, DTYPE_BYTES, cfg.optimizer_bytes_per_param),
        "kept_ratio": float(sum(c.kept_pairs for c in flat) / sum(c.total_pairs for c in flat)),
        "copies_per_rank": int(max(int(c.copies_R.max()) for c in flat)),
        "replicas_per_layer": float(np.mean([int(c.copies_R.sum() - c.owned_R.sum()) for c in flat])),
        "keep_modes": {k: keeps.count(k) / len(keeps) for k in sorted(set(keeps))},
        "planner_calls_per_layer_call": planner_calls,
    }


class Projection:
    """The runs of one model's projection (shared by every cap where they do not depend on it)."""

    def __init__(self, cfg: SimConfig, counts: np.ndarray, layers: list[int], reference: PlanningReference,
                 bar: tqdm) -> None:
        self.cfg, self.counts, self.layers, self.reference, self.bar = cfg, counts, layers, reference, bar
        self.config = cfg.spec.moe_config()

    def run(self, system: str, steps: int | None = None, **kw) -> Run:
        planners = [SystemPlanner(system, self.config, self.cfg.gpus, reference=self.reference, **kw)
                    for _ in self.layers]
        return Run(planners).advance(self.counts, steps or self.counts.shape[0], self.bar)

    def step_bytes(self, calls: list[list[LayerCall]]) -> int:
        return step_peak_bytes(self.cfg.spec, calls, DTYPE_BYTES, self.cfg.optimizer_bytes_per_param)

    # ------------------------------------------------------------------ symi
    def symi_candidates(self) -> list[dict]:
        """symi at every slot count from its owned experts upward (0, 1, 2, 3, 4, 6, 8, ... extra
        slots a rank, up to max(8, 4 × its default's extra)), each with its step time and step
        memory; the search stops once two counts in a row were slower than the fastest so far
        and lowered no one's step memory (more replicas then only cost)."""
        base = SystemPlanner("symi", self.config, self.cfg.gpus, reference=self.reference).planner
        owned, default = len(base.base.owned(0)), base.slots_R[0]  # MoELayer's SYMI default
        out: list[dict] = []
        best_ms, least_bytes, worse = float("inf"), float("inf"), 0
        for extra in replica_candidates(max(8, 4 * (default - owned))):
            calls = self.run("symi", slots=owned + extra).calls
            s = summarise(calls, self.cfg, self.cfg.hw)
            out.append({"slots": owned + extra, "default": owned + extra == default, "calls": calls,
                        "step_ms": s["step_ms"], "step_peak_bytes": s["step_peak_bytes"]})
            improved = s["step_ms"] < best_ms or s["step_peak_bytes"] < least_bytes
            best_ms, least_bytes = min(best_ms, s["step_ms"]), min(least_bytes, s["step_peak_bytes"])
            worse = 0 if improved else worse + 1
            if worse == 2:
                break
        return out

    @staticmethod
    def best_symi(candidates: list[dict], cap: int) -> tuple[dict, str]:
        """The fastest candidate whose step fits (ties: fewer slots); if none fits, the one with
        the least step memory (reported oom)."""
        fits = [c for c in candidates if c["step_peak_bytes"] <= cap]
        default = next((c["slots"] for c in candidates if c["default"]), "not tried")
        tried = ", ".join(f"{c['slots']}: {c['step_ms']:.0f} ms / {c['step_peak_bytes'] / GIB:.1f} GiB"
                          for c in candidates)
        if not fits:
            least = min(candidates, key=lambda c: (c["step_peak_bytes"], c["slots"]))
            return least, f"no slot count fits (slots a rank: step ms / step memory: {tried})"
        best = min(fits, key=lambda c: (c["step_ms"], c["slots"]))
        return best, (f"{best['slots']} slots a rank, the fastest that fits (default {default}; "
                      f"tried {tried})")

    # ------------------------------------------------------------------ lrmoe
    def lrmoe(self, cap: int, ratio: float) -> tuple[list[list[LayerCall]] | None, str, dict]:
        """lrmoe at the largest per-layer budget M whose whole step fits ``cap``: trial runs of
        the first :data:`PREFIX_STEPS` steps, from the conservative :func:`lrmoe_budget` towards
        the cap (secant steps by the step's distance to the cap, inside the bracket of budgets
        known to fit and not to fit), then the best trial continued to every step (and M lowered
        by the excess if a later step no longer fits). Returns (calls or None, note, search)."""
        cfg, spec = self.cfg, self.cfg.spec
        fixed = None
        if cfg.lrmoe_slots == "symi":
            base = SystemPlanner("symi", self.config, cfg.gpus, reference=self.reference).planner
            fixed = base.slots_R[0]
        try:
            M = lrmoe_budget(spec, cfg.gpus, cap, cfg.tokens_per_gpu, DTYPE_BYTES, cfg.optimizer_bytes_per_param,
                             fixed)
        except SimError as e:
            return None, str(e), {}
        kw = dict(ratio=ratio, slots=fixed, selection=cfg.selection, network_bytes=cfg.network_bytes,
                  link_gbps=cfg.link_gbps)
        trials: list[dict] = []
        fit_run, fit_M, over_M, under_M, last_error = None, None, None, 0, ""
        prefix = min(PREFIX_STEPS, self.counts.shape[0])
        for _ in range(BUDGET_TRIES):
            try:
                run = self.run("lrmoe", steps=prefix, memory_bytes=M, **kw)
            except SimError as e:  # too small a budget for some call
                trials.append({"budget_bytes": M, "error": str(e)})
                under_M, last_error = max(under_M, M), str(e)
                nxt = (M + (over_M or cap)) // 2
            else:
                step = self.step_bytes(run.calls)
                trials.append({"budget_bytes": M, "step_peak_bytes": step})
                if step <= cap:
                    same = fit_run is not None and self.step_bytes(fit_run.calls) == step
                    if fit_M is None or fit_M < M:
                        fit_run, fit_M = run, M
                    if cap - step <= BUDGET_TOLERANCE * cap or (same and fit_M == M):
                        break  # close enough, or a larger budget changed nothing (every call keeps all it can)
                    nxt = M + (cap - step)
                    if over_M is not None:
                        nxt = min(nxt, (M + over_M) // 2)
                else:
                    over_M = M if over_M is None else min(over_M, M)
                    lower = max(fit_M or 0, under_M)
                    nxt = M - (step - cap)
                    if nxt <= lower:
                        nxt = (lower + M) // 2
            lo, hi = max(fit_M or 0, under_M), over_M or cap
            if not lo < nxt < hi or (hi - lo) <= BUDGET_TOLERANCE * hi:
                break
            M = int(nxt)
        search = {"trials": trials}
        if fit_run is None:
            return None, f"no per-layer budget fits the cap ({last_error or 'every trial step over the cap'})", search
        for _ in range(3):  # the whole run at the chosen budget
            fit_run.advance(self.counts, self.counts.shape[0], self.bar)
            step = self.step_bytes(fit_run.calls)
            if step <= cap:
                break
            fit_M -= step - cap
            search["trials"].append({"budget_bytes": fit_M, "note": "a later step did not fit: lowered"})
            try:
                fit_run = self.run("lrmoe", memory_bytes=fit_M, **kw)
            except SimError as e:
                return None, str(e), search
        search["budget_bytes"] = fit_M
        return fit_run.calls, f"per-layer budget {fit_M / GIB:.2f} GiB (the largest whose step fits)", search


def lrmoe_name(selection: str, ratio: float) -> str:
    """``lrmoe-<selection>`` (``lrmoe`` for lrm) with ``@ratio`` when a ratio caps the quotas."""
    name = "lrmoe" if selection == "lrm" else f"lrmoe-{selection}"
    return name if ratio >= 1 else f"{name}@{ratio:g}"


def simulate(cfg: SimConfig, progress: bool = True) -> tuple[dict, dict]:
    """Run the projection of one model. Returns ({"meta": ..., "caps": {cap: {system: row}},
    "what_if": {cap: {name: grid}}}, {cap: {system: calls}}), the calls kept for re-costing
    (link-bandwidth sensitivity)."""
    spec, W = cfg.spec, cfg.gpus
    check_caps(cfg)
    counts, layers, source = routing_counts(cfg)
    target = StepsToTarget.load(cfg.compare, cfg.convergence, use_convergence=True)
    reference = PlanningReference.load(cfg.planning)
    bar = tqdm(desc=f"simulate {cfg.model}", unit="step", disable=not progress, leave=False)
    proj = Projection(cfg, counts, layers, reference, bar)
    fixed = {name: proj.run(name).calls for name in ("static", "static-recompute", "capacity")}
    symi_candidates = proj.symi_candidates()
    caps: dict[str, dict] = {}
    grids: dict[str, dict] = {}
    kept_calls: dict[str, dict] = {}
    for cap_gib in cfg.memory_caps_gib:
        cap = int(cap_gib * GIB)
        calls_by: dict[str, list[list[LayerCall]] | None] = dict(fixed)
        notes: dict[str, str] = {}
        extra: dict[str, dict] = {}
        symi, notes["symi"] = proj.best_symi(symi_candidates, cap)
        calls_by["symi"] = symi["calls"]
        extra["symi"] = {"slots_per_rank": symi["slots"], "slot_search": [
            {"slots": c["slots"], "step_ms": c["step_ms"], "step_peak_bytes": c["step_peak_bytes"],
             "fits": c["step_peak_bytes"] <= cap} for c in symi_candidates]}
        for ratio in cfg.ratios:
            name = lrmoe_name(cfg.selection, ratio)
            calls_by[name], notes[name], search = proj.lrmoe(cap, ratio)
            extra[name] = {"budget_search": search, "ratio_cap": ratio}
        rows = {name: {**_row(name, calls, cfg, cap, target, notes.get(name)), **extra.get(name, {})}
                for name, calls in calls_by.items()}
        key = f"{cap_gib:g}"
        caps[key] = rows
        against = what_if_reference(rows)
        grids[key] = {n: {"against": against, **({} if against is None else what_if(r, rows[against], spec.moe_layers))}
                      for n, r in rows.items() if parse_system_name(n).spec.compacts}
        kept_calls[key] = calls_by
    bar.close()
    meta = {
        "model": spec.name, "moe_layers": spec.moe_layers, "gpus": W,
        "tokens_per_gpu": cfg.tokens_per_gpu, "link_gbps": cfg.link_gbps,
        "routing": source, "layers_simulated": layers, "steps_simulated": int(counts.shape[0]),
        "compare": target.source, "steps_sources": sorted({c.source for c in target.curves.values()}),
        "selection": cfg.selection, "lrmoe_slots": cfg.lrmoe_slots, "ratios": list(cfg.ratios),
        "network_budget": cfg.network_budget, "network_bytes": cfg.network_bytes,
        "planning_reference": reference.source,
        "planning_shape": reference.per_call_ms(spec.num_experts, W)[1],
        "target_steps_static": cfg.target_steps,
        "hardware": cfg.hw.to_dict(), "optimizer_bytes_per_param": cfg.optimizer_bytes_per_param,
    }
    return {"meta": meta, "caps": caps, "what_if": grids}, kept_calls


def _steps_ratio(name: str, row: dict, target: StepsToTarget, cfg: SimConfig) -> tuple[float | None, str]:
    parsed = parse_system_name(name)
    spec = parsed.spec
    if not (spec.selective or spec.forward_drop):
        if spec.placement is PlacementKind.STATIC:
            return 1.0, "exact backward (= static)"
        measured = target.ratio(name)
        return 1.0, ("exact backward (= static; the compare run measured "
                     f"{'no step count' if measured is None else f'{measured:.3f}×'}, one seed)")
    if not spec.selective:
        r = target.ratio(name)
        return r, "measured" if r is not None else "never reached the target in the compare run"
    ratio = parsed.ratio if parsed.ratio is not None else 1.0
    kind = "ratio" if ratio < 1 and row["kept_ratio"] >= ratio - 0.005 else "budget"
    return target.lrmoe_steps(parsed.selection or "lrm", row["kept_ratio"], kind)


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
    row["steps_ratio"] = ratio
    row["steps_to_target"] = None if ratio is None else ratio * cfg.target_steps
    row["steps_source"] = how
    oom = row["step_peak_bytes"] > cap
    row["status"] = "oom" if oom else ("not reached" if ratio is None else "ok")
    ok = not oom and ratio is not None
    row["moe_time_to_target_s"] = row["step_ms"] / 1e3 * row["steps_to_target"] if ok else None
    # the same without host planning time
    row["device_time_to_target_s"] = row["device_step_ms"] / 1e3 * row["steps_to_target"] if ok else None
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


__all__ = ["SimConfig", "lrmoe_name", "project", "simulate", "summarise", "time_to_target"]
