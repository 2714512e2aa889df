"""Host planning time of a layer call from a fixed reference, not from this machine's clock.

The layer runs its planners on the host, so their time counts: what the forward waits for on
the critical path, the backward's plan only where it outlasts the forward's device work it is
planned during (:func:`lrmoe.sim.cost.host_on_path`; the simulator counts its calls apart). Measuring
it live made the projection depend on how busy the simulation host was (a busy 2-core VM once
tripled symi's planning time and flipped the sign of a headline figure). Instead, while the
library's :class:`lrmoe.planning.planner.LayerPlanner` plans a call, :class:`PlannerCalls` counts how often
it runs each planner that ``benchmarks/bench_planning.py`` measures, and the call's host time is
those counts times the benchmark's recorded median per call (``planning_reference.json``, copied
from docs/results.md) at the nearest recorded shape: the same on an idle and on a busy machine.

What this leaves out: Python work of the planner outside those eight functions (chunk rows,
capacities, placement bookkeeping); the simulator still measures the live wall time of the whole
planning as a diagnostic (``host_live_ms`` in results.json), never in a time to target.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lrmoe.sim.errors import SimError

PLANNING_REFERENCE = Path(__file__).with_name("planning_reference.json")

# Where the planner looks each benchmarked function up at call time (module, attribute), and the
# benchmark's name for it. The min-peak assignment is named by whether it got capacities (the
# backward's kept pairs under the controller's capacities, or a forward within a memory cap).
_TARGETS = (
    ("lrmoe.planning.pair_rules", "min_peak_assignment"),
    ("lrmoe.planning.strategies.load", "plan_replicas"),
    ("lrmoe.planning.strategies.node_aware", "plan_replicas"),
    ("lrmoe.planning.replica_search", "plan_replicas"),  # lrmoe's replica-count search
    ("lrmoe.planning.placement", "holder_index"),  # once per new placement (Placement.holder_index is cached)
    ("lrmoe.planning.controller", "max_min_quotas"),
    ("lrmoe.planning.strategies.node_aware", "localize"),
    ("lrmoe.planning.strategies.shadow", "shadow_experts"),
    ("lrmoe.planning.strategies.assembled", "laer_layout"),
    ("lrmoe.planning.strategies.greedy", "flexmoe_replan"),
    ("lrmoe.planning.backward_plan", "plan_strata"),  # a local selection's strata, in the backward's plan
)
_NAMES = {"plan_strata": "strata"}  # the benchmark's name where it is not the function's


def _bench_name(attr: str, args: tuple, kwargs: dict) -> str:
    if attr == "min_peak_assignment":
        capacity = kwargs.get("capacity_R", args[2] if len(args) > 2 else None)
        return "assign_min_peak" if capacity is None else "assign_min_peak_cap"
    return _NAMES.get(attr, attr)


class PlannerCalls:
    """Counts the benchmarked planners the library runs inside a ``with`` block (outermost calls
    only: a planner that calls another counts once, as the benchmark timed it). The counting
    wraps the functions where the planning modules look them up and puts
    the originals back on exit; nothing in the library is changed."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._depth = 0
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, attr: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.counts[_bench_name(attr, args, kwargs)] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def __enter__(self) -> PlannerCalls:
        for module_name, attr in _TARGETS:
            module = importlib.import_module(module_name)
            fn = getattr(module, attr)
            self._saved.append((module, attr, fn))
            setattr(module, attr, self._wrap(attr, fn))
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved.clear()


@dataclass(frozen=True)
class PlanningReference:
    """Recorded per-call host time of every benchmarked planner, by shape (experts × ranks)."""

    shapes: dict[tuple[int, int], dict[str, float]]  # (E, W) -> planner -> median ms
    source: str

    @staticmethod
    def load(path: str | Path | None = None) -> PlanningReference:
        """``planning_reference.json`` (default), or a ``bench_planning.py --out`` JSON."""
        p = Path(path) if path is not None else PLANNING_REFERENCE
        try:
            doc = json.loads(p.read_text())
            rows = doc.get("shapes", doc)
            shapes = {}
            for shape, planners in rows.items():
                if shape == "source":
                    continue
                E, W = (int(v) for v in shape.lower().split("x"))
                shapes[(E, W)] = {name: float(f["median_ms"]) for name, f in planners.items()}
        except FileNotFoundError:
            raise SimError(f"planning reference {str(p)!r} not found") from None
        except (json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
            raise SimError(f"planning reference {str(p)!r}: expected bench_planning.py's JSON "
                           f"{{'ExW': {{planner: {{'median_ms': ...}}}}}} ({type(e).__name__}: {e})") from None
        if not shapes:
            raise SimError(f"planning reference {str(p)!r} has no shapes")
        return PlanningReference(shapes, str(p))

    def per_call_ms(self, experts: int, world: int) -> tuple[dict[str, float], str]:
        """Median ms per call of every planner at E × W, and how it was found: the recorded
        shape itself; between two recorded rank counts of the same E, interpolated linearly in
        log W (the benchmark's growth between its shapes); otherwise the nearest recorded shape
        in log E + log W, unscaled."""
        if (experts, world) in self.shapes:
            return dict(self.shapes[(experts, world)]), f"{experts}x{world} as recorded"
        same_e = sorted(w for e, w in self.shapes if e == experts)
        lo = [w for w in same_e if w < world]
        hi = [w for w in same_e if w > world]
        if lo and hi:
            a, b = self.shapes[(experts, lo[-1])], self.shapes[(experts, hi[0])]
            t = (math.log(world) - math.log(lo[-1])) / (math.log(hi[0]) - math.log(lo[-1]))
            return ({k: (1 - t) * a[k] + t * b[k] for k in a if k in b},
                    f"between {experts}x{lo[-1]} and {experts}x{hi[0]} (log W)")
        near = min(self.shapes, key=lambda s: (abs(math.log(s[0] / experts)) + abs(math.log(s[1] / world)), -s[1]))
        return dict(self.shapes[near]), f"{near[0]}x{near[1]} (nearest recorded shape)"


def host_seconds(counts: Counter[str] | dict[str, int], per_call_ms: dict[str, float]) -> float:
    """Reference host time of the counted planner calls."""
    missing = sorted(set(counts) - set(per_call_ms))
    if missing:
        raise SimError(f"planning reference has no figure for {missing}")
    return sum(n * per_call_ms[name] for name, n in counts.items()) / 1e3
