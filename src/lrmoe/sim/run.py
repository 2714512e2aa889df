"""Paper-scale projection: per model and memory cap, each system's step time, memory and time
to target, from routing counts, the library's planners and the cost model.

Flow (one way): counts (trace or skew model) → :mod:`plan` (library placement, quotas,
redistribution; host planning from :mod:`host`'s reference) → :mod:`budget` (whole-step memory
vs the cap) → :mod:`cost` (α–β and roofline time) → :mod:`target` (steps to target from measured
runs) → :mod:`whatif`, :mod:`report`. This module runs the systems and assembles the results;
the two searches below are :mod:`search`'s, a system's results row :mod:`summary`'s.

Fair rules (docs/simulation.md "Fair rules"): every system sees the same cap; symi's replica
slots are searched in both directions from its default and its fastest fitting count is
reported; lrmoe's replicas are its controller's per-step cost search, its kept ratio the
controller's quotas at the cap (with a network budget; ``--ratios`` only caps it), its per-layer
budget the largest whose whole step fits; exact backwards (static, symi) take static's steps;
host planning is a fixed reference, never this machine's clock.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from lrmoe.config import BackwardConfig
from lrmoe.sim import search
from lrmoe.sim.budget import GIB
from lrmoe.sim.config import WARM_PHASE, SimConfig, check_caps, routing_counts
from lrmoe.sim.host import PlanningReference
from lrmoe.sim.layer_calls import LayerCall
from lrmoe.sim.report import plot_sensitivity, write_results
from lrmoe.sim.runner import Runner
from lrmoe.sim.search import BUDGET_TOLERANCE, BUDGET_TRIES, PREFIX_STEPS
from lrmoe.sim.summary import Phase, result_row, summarise, time_to_target
from lrmoe.sim.target import StepsToTarget
from lrmoe.sim.whatif import what_if, what_if_reference
from lrmoe.systems import (
    FIXED_PLACEMENT_BASELINES,
    PER_CALL_BASELINES,
    REPLICATED_BASELINE,
    TRIMMING_SYSTEM,
    parse_system_name,
)


class Projection(Runner):
    """The runs of one model's projection (shared by every cap where they do not depend on it);
    the slot and budget searches run on it (:mod:`lrmoe.sim.search`)."""

    def symi_candidates(self) -> list[dict]:
        """The replicated baseline at each slot count (:func:`lrmoe.sim.search.symi_candidates`)."""
        return search.symi_candidates(self)

    best_symi = staticmethod(search.best_symi)

    def lrmoe(self, cap: int, ratio: float, backward: BackwardConfig | None = None
              ) -> tuple[list[list[LayerCall]] | None, str, dict]:
        """The trimming system at its largest fitting budget (:func:`lrmoe.sim.search.lrmoe_at_cap`;
        ``backward``: one of its phases')."""
        return search.lrmoe_at_cap(self, cap, ratio, backward)

    def fit_exact(self, cap: int, calls_by: dict, notes: dict, extra: dict) -> None:
        """Every system besides lrmoe whose step does not fit ``cap`` uncapped (the replicated
        baseline: at none of its slot counts; it then keeps its default slots)
        gets lrmoe's per-layer budget search
        (:func:`lrmoe.sim.search.exact_at_cap`): its calls, note and search replace the uncapped
        ones in ``calls_by``, ``notes`` and ``extra`` where a budget fits; else the uncapped
        run stays, reported ``oom``, with the search's note."""
        for name, calls in list(calls_by.items()):
            if calls is None or self.step_bytes(calls) <= cap:
                continue
            # symi at its default slots, fixed: derived from the budget they would be re-planned
            # inside every call that does not fit, whose host planning then dominates its step
            slots = search.default_slots(self) if name == REPLICATED_BASELINE else None
            fitted, note, budget_search = search.exact_at_cap(self, name, cap, slots)
            extra[name] = {**extra.get(name, {}), "budget_search": budget_search}
            if fitted is None:
                notes[name] = f"uncapped step over the cap; under a budget: {note}"
                continue
            calls_by[name] = fitted
            notes[name] = f"uncapped step over the cap; {note}"


def lrmoe_name(selection: str, ratio: float) -> str:
    """``lrmoe-<selection>`` (``lrmoe`` for lrm) with ``@ratio`` when a ratio caps the quotas."""
    name = TRIMMING_SYSTEM if selection == "lrm" else f"{TRIMMING_SYSTEM}-{selection}"
    return name if ratio >= 1 else f"{name}@{ratio:g}"


def phase_key(name: str, label: str) -> str:
    """Where :func:`simulate`'s calls keep the calls of ``name``'s phase ``label``
    (:meth:`SimConfig.extra_phases`)."""
    return f"{name} ({label})"


def warm_key(name: str) -> str:
    """Where :func:`simulate`'s calls keep the warm phase's calls of ``name``."""
    return phase_key(name, WARM_PHASE)


def phase_calls(cfg: SimConfig, calls: dict, name: str) -> list[Phase] | None:
    """``name``'s other phases as (label, share, calls) from :func:`simulate`'s calls (None:
    it has none)."""
    phases = [(label, share, calls.get(phase_key(name, label))) for label, share, _ in cfg.extra_phases()]
    return phases if phases and all(c is not None for _, _, c in phases) else None


def simulate(cfg: SimConfig, progress: bool = True) -> tuple[dict, dict]:
    """Run the projection of one model. Returns ({"meta": ..., "caps": {cap: {system: row}},
    "what_if": {cap: {name: grid}}}, {cap: {system: calls}}), the calls kept for re-costing
    (link-bandwidth sensitivity; lrmoe's other phases under :func:`phase_key`)."""
    spec, W = cfg.spec, cfg.gpus
    check_caps(cfg)
    counts, layers, source = routing_counts(cfg)
    target = StepsToTarget.load(cfg.compare, cfg.convergence, use_convergence=True)
    reference = PlanningReference.load(cfg.planning)
    bar = tqdm(desc=f"simulate {cfg.model}", unit="step", disable=not progress, leave=False)
    proj = Projection(cfg, counts, layers, reference, bar)
    fixed = {name: proj.run(name).calls for name in (*FIXED_PLACEMENT_BASELINES, *PER_CALL_BASELINES)}
    symi_candidates = proj.symi_candidates()
    caps: dict[str, dict] = {}
    grids: dict[str, dict] = {}
    kept_calls: dict[str, dict] = {}
    for cap_gib in cfg.memory_caps_gib:
        cap = int(cap_gib * GIB)
        calls_by: dict[str, list[list[LayerCall]] | None] = dict(fixed)
        notes: dict[str, str] = {}
        extra: dict[str, dict] = {}
        symi, notes[REPLICATED_BASELINE] = proj.best_symi(symi_candidates, cap)
        calls_by[REPLICATED_BASELINE] = symi["calls"]
        extra[REPLICATED_BASELINE] = {"slots_per_rank": symi["slots"], "slot_search": [
            {"slots": c["slots"], "step_ms": c["step_ms"], "step_peak_bytes": c["step_peak_bytes"],
             "fits": c["step_peak_bytes"] <= cap} for c in symi_candidates]}
        proj.fit_exact(cap, calls_by, notes, extra)
        phases_by: dict[str, list[Phase]] = {}
        for ratio in cfg.ratios:
            name = lrmoe_name(cfg.selection, ratio)
            calls_by[name], notes[name], budget_search = proj.lrmoe(cap, ratio)
            extra[name] = {"budget_search": budget_search, "ratio_cap": ratio}
            for label, share, backward in cfg.extra_phases():  # every phase must fit
                if calls_by[name] is None:
                    break
                calls, note, _ = proj.lrmoe(cap, ratio, backward)
                phases_by.setdefault(name, []).append((label, share, calls))
                if calls is None:
                    calls_by[name], notes[name] = None, f"{label}: {note}"
        rows = {name: {**result_row(name, calls, cfg, cap, target, notes.get(name), phases_by.get(name)),
                       **extra.get(name, {})}
                for name, calls in calls_by.items()}
        key = f"{cap_gib:g}"
        caps[key] = rows
        against = what_if_reference(rows)
        grids[key] = {n: {"against": against, **({} if against is None else what_if(r, rows[against], spec.moe_layers))}
                      for n, r in rows.items() if parse_system_name(n).spec.compacts}
        kept_calls[key] = {**calls_by, **{phase_key(n, label): c for n, phases in phases_by.items()
                                          for label, _, c in phases}}
    bar.close()
    meta = {
        "model": spec.name, "moe_layers": spec.moe_layers, "gpus": W,
        "tokens_per_gpu": cfg.tokens_per_gpu, "link_gbps": cfg.link_gbps,
        "routing": source, "layers_simulated": layers, "steps_simulated": int(counts.shape[0]),
        "compare": target.source, "steps_sources": sorted({c.source for c in target.curves.values()}),
        "selection": cfg.selection, "lrmoe_slots": cfg.lrmoe_slots, "ratios": list(cfg.ratios),
        "network_budget": cfg.network_budget, "network_bytes": cfg.network_bytes,
        "objective": {"objective": cfg.backward.objective, "drop_cost": cfg.backward.drop_cost,
                      "min_ratio": cfg.backward.min_ratio},
        "warm_phase": {"share": cfg.warm_share, "ratio": cfg.backward.warm_ratio,
                       "balance": cfg.backward.warm_balance} if cfg.warm_share else None,
        "late_floors": [{"from_share": share, "floor": floor} for share, floor in cfg.late_floors] or None,
        "planning_reference": reference.source,
        "planning_shape": reference.per_call_ms(spec.num_experts, W)[1],
        "target_steps_static": cfg.target_steps,
        "hardware": cfg.hw.to_dict(), "optimizer_bytes_per_param": cfg.optimizer_bytes_per_param,
    }
    return {"meta": meta, "caps": caps, "what_if": grids}, kept_calls


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
            name: {g: time_to_target(row, calls[cap][name], cfg, cfg.hardware.with_link_gbps(g),
                                     phase_calls(cfg, calls[cap], name))
                   for g in BANDWIDTHS_GBPS}
            for name, row in doc["caps"][cap].items()}
        doc["meta"]["bandwidth_sensitivity"] = {
            "memory_cap_gib": cap,
            "moe_time_to_target_s": {n: {f"{g:g}": v for g, v in s.items()} for n, s in bandwidth[cfg.model].items()}}
    write_results(out, results)
    if plots:
        plot_sensitivity(out, results, bandwidth)
    return results


# summarise, time_to_target (lrmoe.sim.summary) and the budget search's constants (lrmoe.sim.search)
# stay importable from here, where they lived before the split
__all__ = ["BUDGET_TOLERANCE", "BUDGET_TRIES", "PREFIX_STEPS", "Projection", "SimConfig", "lrmoe_name",
           "project", "simulate", "summarise", "time_to_target"]
