"""One system's simulated calls as a results row: step time (device, host), memory, kept ratio
(:func:`summarise`; with a warm phase or later floors, the phases' figures weighted by their share
of the steps, :func:`with_phases`), its steps to target from the measured runs and the time to
target under the cap (:func:`result_row`), and that time re-costed on other hardware
(:func:`time_to_target`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lrmoe.sim.budget import step_peak_bytes
from lrmoe.sim.config import DTYPE_BYTES, WARM_PHASE, SimConfig
from lrmoe.sim.cost import PHASES, layer_seconds
from lrmoe.sim.hardware import Hardware
from lrmoe.sim.layer_calls import LayerCall
from lrmoe.sim.target import StepsToTarget
from lrmoe.systems import REFERENCE_SYSTEM, PlacementKind, parse_system_name


def summarise(calls: list[list[LayerCall]], cfg: SimConfig, hw: Hardware) -> dict:
    """Step time (all MoE layers), per-phase layer time, memory and kept ratio of one system.
    Host time is the reference cost of the planner calls (the same on every machine) on the
    critical path (:func:`lrmoe.sim.cost.host_on_path`), its mean over calls, with every call's
    total beside it (``host_total_ms``, diagnostic: the figure before the backward's plan was
    moved off the forward's path); one-time planning (lrmoe's first, full replica-count search) is left out of it
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
        "host_total_ms": 1e3 * float(np.mean([x["host_total"] for x in secs])) * L,
        "host_deferred_ms": 1e3 * float(np.mean([c.deferred_host_s for c in flat])) * L,
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


# per-step figures the phases weight by their share of the steps; memory and copies take the larger
_PER_STEP = ("step_ms", "device_step_ms", "host_ms", "host_total_ms", "host_deferred_ms", "host_live_ms",
             "kept_ratio", "replicas_per_layer")
_LARGEST = ("peak_expert_side_bytes", "step_peak_bytes", "copies_per_rank")


# one of lrmoe's phases outside its main one: (label, share of its steps, its calls or its row)
Phase = tuple[str, float, Any]


def with_phases(main: dict, phases: list[Phase]) -> dict:
    """:func:`summarise`'s row of a run whose steps follow ``main``'s row except for ``phases``
    (label, share of the steps, row: lrmoe's warm phase, BackwardConfig.trim_after; its later
    floors, min_ratio_after): per-step figures, per-phase layer times, keep modes and planner
    calls weighted by the steps, memory the largest (every phase must fit), the one-time planning
    every phase's (each plans once); each phase's own step time and kept ratio under
    ``phases``, the warm phase's also under ``warm_phase`` with the main phase's beside it."""
    weighted = [(1 - sum(share for _, share, _ in phases), main), *((share, r) for _, share, r in phases)]

    def mixed(key: str) -> float:
        return sum(share * r[key] for share, r in weighted)

    def mixed_dict(key: str) -> dict:
        return {k: sum(share * r[key].get(k, 0.0) for share, r in weighted)
                for k in sorted(set().union(*(r[key] for _, r in weighted)))}

    row = dict(main)
    row.update({k: mixed(k) for k in _PER_STEP})
    row.update({k: max(r[k] for _, r in weighted) for k in _LARGEST})
    row["host_once_ms"] = sum(r["host_once_ms"] for _, r in weighted)
    for k in ("layer_ms", "keep_modes", "planner_calls_per_layer_call"):
        row[k] = mixed_dict(k)
    row["phases"] = [{"phase": label, "share": share, "step_ms": r["step_ms"], "kept_ratio": r["kept_ratio"]}
                     for label, share, r in (("main", weighted[0][0], main), *phases)]
    for label, share, r in phases:
        if label == WARM_PHASE:
            row["warm_phase"] = {"share": share, "step_ms": r["step_ms"], "kept_ratio": r["kept_ratio"],
                                 "trimmed_step_ms": main["step_ms"], "trimmed_kept_ratio": main["kept_ratio"]}
    return row


def _summarise_phases(calls: list[list[LayerCall]], cfg: SimConfig, hw: Hardware,
                      phases: list[Phase] | None) -> dict:
    """:func:`summarise` of ``calls``, with ``phases``' (label, share, calls) weighted in where given."""
    row = summarise(calls, cfg, hw)
    if not phases:
        return row
    return with_phases(row, [(label, share, summarise(c, cfg, hw)) for label, share, c in phases])


def steps_ratio(name: str, row: dict, target: StepsToTarget) -> tuple[float | None, str]:
    """(steps to target × the reference's, where it comes from) of one row: exact backwards take
    the reference's steps, a forward drop its measured ratio, a selective backward the measured
    curve at its kept ratio."""
    parsed = parse_system_name(name)
    spec = parsed.spec
    if not (spec.selective or spec.forward_drop):
        if spec.placement is PlacementKind.STATIC:
            return 1.0, f"exact backward (= {REFERENCE_SYSTEM})"
        measured = target.ratio(name)
        return 1.0, (f"exact backward (= {REFERENCE_SYSTEM}; the compare run measured "
                     f"{'no step count' if measured is None else f'{measured:.3f}×'}, one seed)")
    if not spec.selective:
        r = target.ratio(name)
        return r, "measured" if r is not None else "never reached the target in the compare run"
    ratio = parsed.ratio if parsed.ratio is not None else 1.0
    kind = "ratio" if ratio < 1 and row["kept_ratio"] >= ratio - 0.005 else "budget"
    return target.lrmoe_steps(parsed.selection or "lrm", row["kept_ratio"], kind)


def time_to_target(row: dict, calls: list[list[LayerCall]] | None, cfg: SimConfig, hw: Hardware,
                   phases: list[Phase] | None = None) -> float | None:
    """MoE time to target of a simulated row on other hardware (same plans, same steps;
    ``phases``: its other phases' (label, share, calls))."""
    if calls is None or row.get("status") != "ok":
        return None
    return _summarise_phases(calls, cfg, hw, phases)["step_ms"] / 1e3 * row["steps_to_target"]


def result_row(name: str, calls: list[list[LayerCall]] | None, cfg: SimConfig, cap: int, target: StepsToTarget,
               note: str | None, phases: list[Phase] | None = None) -> dict:
    """``results.json``'s row of one system at one cap (``infeasible`` where no calls ran;
    ``phases``: its other phases' (label, share, calls), :func:`with_phases`)."""
    if calls is None:
        return {"moe_time_to_target_s": None, "step_ms": None, "peak_expert_side_bytes": None,
                "status": "infeasible", "note": note}
    row = _summarise_phases(calls, cfg, cfg.hw, phases)
    ratio, how = steps_ratio(name, row, target)
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
