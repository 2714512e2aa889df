"""The two searches of the projection's fair rules (docs/simulation.md "Fair rules"): the
replicated baseline's slot count (every count from its owned experts upward, its fastest that
fits reported) and the trimming system's per-layer budget (the largest whose whole step fits).

Functions of a :class:`lrmoe.sim.runner.Runner` (the projection, :class:`lrmoe.sim.run.Projection`,
is one), which runs a system (:meth:`run`) and measures a step's memory (:meth:`step_bytes`) for them.
"""

from __future__ import annotations

from lrmoe.config import BackwardConfig
from lrmoe.planning.replica_search import replica_candidates
from lrmoe.sim.budget import GIB, lrmoe_budget
from lrmoe.sim.config import DTYPE_BYTES, LRMOE_SLOTS_FIXED
from lrmoe.sim.errors import SimError
from lrmoe.sim.layer_calls import LayerCall, SystemPlanner
from lrmoe.sim.runner import Run, Runner
from lrmoe.sim.summary import summarise
from lrmoe.systems import REPLICATED_BASELINE, TRIMMING_SYSTEM

PREFIX_STEPS = 4  # steps of a trial run in lrmoe's budget search (replicas exist from the second)
BUDGET_TRIES = 5  # trial runs per cap in that search
BUDGET_TOLERANCE = 0.02  # stop once the step is within this share of the cap


def default_slots(proj: Runner) -> int:
    """The replicated baseline's default slot count a rank (the layer's own default)."""
    return SystemPlanner(REPLICATED_BASELINE, proj.config, proj.cfg.gpus, reference=proj.reference).planner.slots_R[0]


def symi_candidates(proj: Runner) -> list[dict]:
    """symi at every slot count from its owned experts upward (0, 1, 2, 3, 4, 6, 8, ... extra
    slots a rank, up to max(8, 4 × its default's extra)), each with its step time and step
    memory; the search stops once two counts in a row were slower than the fastest so far
    and lowered no one's step memory (more replicas then only cost)."""
    base = SystemPlanner(REPLICATED_BASELINE, proj.config, proj.cfg.gpus, reference=proj.reference).planner
    owned, default = len(base.base.owned(0)), base.slots_R[0]  # MoELayer's SYMI default
    out: list[dict] = []
    best_ms, least_bytes, worse = float("inf"), float("inf"), 0
    for extra in replica_candidates(max(8, 4 * (default - owned))):
        calls = proj.run(REPLICATED_BASELINE, slots=owned + extra).calls
        s = summarise(calls, proj.cfg, proj.cfg.hw)
        out.append({"slots": owned + extra, "default": owned + extra == default, "calls": calls,
                    "step_ms": s["step_ms"], "step_peak_bytes": s["step_peak_bytes"]})
        improved = s["step_ms"] < best_ms or s["step_peak_bytes"] < least_bytes
        best_ms, least_bytes = min(best_ms, s["step_ms"]), min(least_bytes, s["step_peak_bytes"])
        worse = 0 if improved else worse + 1
        if worse == 2:
            break
    return out


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


def lrmoe_at_cap(proj: Runner, cap: int, ratio: float, backward: BackwardConfig | None = None
                 ) -> tuple[list[list[LayerCall]] | None, str, dict]:
    """lrmoe at the largest per-layer budget M whose whole step fits ``cap``
    (:func:`budgeted_at_cap`), its replicas its controller's cost search (or symi's default count
    with ``--lrmoe-slots fixed``); ``backward``: one of its phases' (:meth:`SimConfig.extra_phases`;
    default: the configured one). Returns (calls or None, note, search)."""
    cfg = proj.cfg
    fixed = default_slots(proj) if cfg.lrmoe_slots == LRMOE_SLOTS_FIXED else None
    backward = cfg.backward if backward is None else backward
    ratio = min(ratio, backward.ratio)  # --ratios caps every phase; a warm phase's ratio caps its own
    kw = dict(ratio=ratio, slots=fixed, selection=cfg.selection, network_bytes=cfg.network_bytes,
              link_gbps=cfg.link_gbps, backward=backward)
    return budgeted_at_cap(proj, TRIMMING_SYSTEM, cap, kw)


def exact_at_cap(proj: Runner, system: str, cap: int, slots: int | None = None
                 ) -> tuple[list[list[LayerCall]] | None, str, dict]:
    """An exact (or capacity-dropping) system whose uncapped step does not fit ``cap``, given the
    same per-layer budget search as lrmoe (:func:`budgeted_at_cap`): under its budget M the
    layer's own fitter keeps x alone, chunks the forward and the backward's recompute, and takes
    replicas away (``slots``: the replicated baseline's count to start from; None: the system's
    own, its owned experts for a fixed placement). Returns (calls or None, note, search)."""
    return budgeted_at_cap(proj, system, cap, {"slots": slots} if slots is not None else {})


def budgeted_at_cap(proj: Runner, system: str, cap: int, kw: dict
                    ) -> tuple[list[list[LayerCall]] | None, str, dict]:
    """``system`` (planner keywords ``kw``) at the largest per-layer budget M whose whole step
    fits ``cap``: trial runs of the first :data:`PREFIX_STEPS` steps, from the conservative
    :func:`lrmoe_budget` towards the cap (secant steps by the step's distance to the cap,
    inside the bracket of budgets known to fit and not to fit), then the best trial continued
    to every step (and M lowered by the excess if a later step no longer fits)."""
    cfg, spec = proj.cfg, proj.cfg.spec
    fixed = kw.get("slots")
    if fixed is None and system != TRIMMING_SYSTEM:  # the start: every layer at its owned experts
        fixed = len(SystemPlanner(system, proj.config, cfg.gpus, reference=proj.reference).planner.base.owned(0))
    try:
        M = lrmoe_budget(spec, cfg.gpus, cap, cfg.tokens_per_gpu, DTYPE_BYTES, cfg.optimizer_bytes_per_param,
                         fixed, system)
    except SimError as e:
        return None, str(e), {}
    trials: list[dict] = []
    fit_run, fit_M, over_M, under_M, last_error = None, None, None, 0, ""
    prefix = min(PREFIX_STEPS, proj.counts.shape[0])
    for _ in range(BUDGET_TRIES):
        try:
            run = proj.run(system, steps=prefix, memory_bytes=M, **kw)
        except SimError as e:  # too small a budget for some call
            trials.append({"budget_bytes": M, "error": str(e)})
            under_M, last_error = max(under_M, M), str(e)
            nxt = (M + (over_M or cap)) // 2
        else:
            step = proj.step_bytes(run.calls)
            trials.append({"budget_bytes": M, "step_peak_bytes": step})
            if step <= cap:
                same = fit_run is not None and proj.step_bytes(fit_run.calls) == step
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
    return _whole_run(proj, system, fit_run, fit_M, cap, kw, search)


def _whole_run(proj: Runner, system: str, fit_run: Run, fit_M: int, cap: int, kw: dict, search: dict
               ) -> tuple[list[list[LayerCall]] | None, str, dict]:
    """The best trial continued to every step; where a later step no longer fits, M lowered by
    the excess and the run repeated (three tries)."""
    for _ in range(3):  # the whole run at the chosen budget
        fit_run.advance(proj.counts, proj.counts.shape[0], proj.bar)
        step = proj.step_bytes(fit_run.calls)
        if step <= cap:
            break
        fit_M -= step - cap
        search["trials"].append({"budget_bytes": fit_M, "note": "a later step did not fit: lowered"})
        try:
            fit_run = proj.run(system, memory_bytes=fit_M, **kw)
        except SimError as e:
            return None, str(e), search
    search["budget_bytes"] = fit_M
    return fit_run.calls, f"per-layer budget {fit_M / GIB:.2f} GiB (the largest whose step fits)", search
