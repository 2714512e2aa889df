"""The systems the library compares, as data: one :class:`SystemSpec` per name.

This module is the only place that knows system names. Every other module reads a spec's
attributes (how it places experts, what its backward keeps, whether it drops in the forward,
what it takes from a budget, how it assigns pairs to copies) and never compares a name.

A system name may carry the backward's selection and ratio for the selective systems:
``lrmoe-random@0.25``, ``masked@0.5``; :func:`parse_system_name` is the one parser of that
form (docs/design.md "Systems").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class PlacementKind(StrEnum):
    STATIC = "static"  # one copy per expert, fixed
    PER_STEP = "per_step"  # replicas re-planned between optimizer steps, refreshed after each
    PER_CALL = "per_call"  # placement planned from each call's own counts, copies fetched in the call
    SHARDED = "sharded"  # every expert sharded over all ranks, assembled where a call places it


class BackwardKind(StrEnum):
    FULL = "full"  # every pair; the expert side saves x and the activations from the forward
    RECOMPUTE = "recompute"  # every pair; x saved, gate/up and h recomputed
    SELECTIVE = "selective"  # kept pairs only, compacted; x re-sent by home, gate/up/h recomputed
    MASKED = "masked"  # the selective kept set applied to full-size tensors (ablation)


class Assignment(StrEnum):
    OWNER = "owner"  # single copies: pairs go to the owner
    MIN_PEAK = "min_peak"  # replicated experts spread by assign_min_peak
    LOCAL = "local"  # shadowed experts compute where their pairs are (FasterMoE)
    LOCALIZED = "localized"  # min-peak, then pairs re-matched to holders inside their node (TopoEP)
    LEAST_LOADED = "least_loaded"  # owner up to a row cap, overflow to the least-loaded copies (LLEP)


class Planner(StrEnum):
    """Which planner decides a replicated system's placement."""

    NONE = "none"
    CONTROLLER = "controller"  # lrmoe: the budget's controller, replicas ∝ smoothed load
    LOAD = "load"  # replicas ∝ load, min-peak placement (SYMI; per call: UltraEP)
    NODE_AWARE = "node_aware"  # LOAD within nodes first (TopoEP)
    FLEXMOE = "flexmoe"  # greedy replicate/migrate when the gain beats the cost
    SMARTMOE = "smartmoe"  # an offline pool from a routing trace, one picked online
    SHADOW = "shadow"  # hot experts broadcast by a cost model (FasterMoE)
    LAER = "laer"  # experts assembled from slices where the call's load places them
    LEAST_LOADED = "least_loaded"  # overflow over a row cap spilled with its weights to the least loaded (LLEP)


@dataclass(frozen=True)
class SystemSpec:
    """What one system does; the layer, the planner, the simulator and training read this."""

    name: str
    placement: PlacementKind
    backward: BackwardKind
    assignment: Assignment
    planner: Planner = Planner.NONE
    forward_drop: bool = False  # capacity factor: overflow pairs dropped in both passes
    takes_budget: bool = False  # accepts a ClusterBudget (memory cap, slots, topology)
    needs_topology: bool = False  # needs ClusterBudget(ranks_per_node=...)
    takes_trace: bool = False  # accepts a routing trace for an offline placement pool
    uses_slots: bool = False  # replica slots per rank: the budget's, else SYMI's default
    replan_every_step: bool = False  # ignores replan_interval: re-plans after every step

    @property
    def selective(self) -> bool:
        """The backward keeps a selected subset of pairs (selection, quotas, ‖h‖² at home)."""
        return self.backward in (BackwardKind.SELECTIVE, BackwardKind.MASKED)

    @property
    def compacts(self) -> bool:
        """The backward carries only kept rows (a second row plan); x is re-sent by home."""
        return self.backward is BackwardKind.SELECTIVE

    @property
    def saves_activations(self) -> bool:
        return self.backward is BackwardKind.FULL

    @property
    def saves_rows(self) -> bool:
        """The expert side keeps the received x rows to the backward."""
        return self.backward is not BackwardKind.SELECTIVE

    @property
    def recomputes(self) -> bool:
        """The backward recomputes gate/up and h."""
        return not self.saves_activations

    @property
    def selects(self) -> bool:
        """Ranks pairs by a score in a global exchange (forward drop or selective backward)."""
        return self.forward_drop or self.selective


_S, _STEP, _CALL = PlacementKind.STATIC, PlacementKind.PER_STEP, PlacementKind.PER_CALL
_FULL = BackwardKind.FULL
SPECS: dict[str, SystemSpec] = {s.name: s for s in (
    SystemSpec("static", _S, _FULL, Assignment.OWNER, takes_budget=True),
    SystemSpec("static-recompute", _S, BackwardKind.RECOMPUTE, Assignment.OWNER, takes_budget=True),
    SystemSpec("lrmoe", _S, BackwardKind.SELECTIVE, Assignment.MIN_PEAK, Planner.CONTROLLER, takes_budget=True),
    # lrmoe over a capacity factor's forward: the overflow dropped in both passes, the rest trimmed in the backward
    SystemSpec("lrmoe-capacity", _S, BackwardKind.SELECTIVE, Assignment.MIN_PEAK, Planner.CONTROLLER,
               forward_drop=True, takes_budget=True),
    SystemSpec("masked", _S, BackwardKind.MASKED, Assignment.OWNER, takes_budget=True),
    SystemSpec("symi", _STEP, _FULL, Assignment.MIN_PEAK, Planner.LOAD, takes_budget=True,
               uses_slots=True, replan_every_step=True),
    SystemSpec("capacity", _S, _FULL, Assignment.OWNER, forward_drop=True, takes_budget=True),
    SystemSpec("fastermoe", _CALL, _FULL, Assignment.LOCAL, Planner.SHADOW, takes_budget=True),
    SystemSpec("flexmoe", _STEP, _FULL, Assignment.MIN_PEAK, Planner.FLEXMOE, takes_budget=True,
               uses_slots=True, replan_every_step=True),
    SystemSpec("smartmoe", _STEP, _FULL, Assignment.MIN_PEAK, Planner.SMARTMOE, takes_budget=True,
               takes_trace=True, uses_slots=True, replan_every_step=True),
    SystemSpec("laer", PlacementKind.SHARDED, _FULL, Assignment.MIN_PEAK, Planner.LAER, takes_budget=True,
               uses_slots=True),
    SystemSpec("ultraep", _CALL, _FULL, Assignment.MIN_PEAK, Planner.LOAD, takes_budget=True,
               uses_slots=True),
    SystemSpec("topoep", _STEP, _FULL, Assignment.LOCALIZED, Planner.NODE_AWARE, takes_budget=True,
               needs_topology=True, uses_slots=True, replan_every_step=True),
    SystemSpec("llep", _CALL, _FULL, Assignment.LEAST_LOADED, Planner.LEAST_LOADED, takes_budget=True),
)}
SYSTEMS: tuple[str, ...] = tuple(SPECS)
REPLICATION_FAMILY: tuple[str, ...] = ("fastermoe", "flexmoe", "smartmoe", "laer", "ultraep", "topoep", "llep")
# Roles other modules name a system by (they never spell a system's name themselves):
DEFAULT_SYSTEM = "static"  # what a layer, a training config or a patched model runs unless told
REFERENCE_SYSTEM = "static"  # compare's target comes from this system's run
TRIMMING_SYSTEM = "lrmoe"  # the system this library proposes: its controller trims the backward
REPLICATED_BASELINE = "symi"  # the exact replicated system time columns and breakdowns are measured against
FIXED_PLACEMENT_BASELINES: tuple[str, ...] = ("static", "static-recompute", "capacity")  # no replica to plan
# planned from each call's own counts alone (no state across steps): the simulator projects them
# uncapped beside the fixed baselines, their step's peak then held against each cap
PER_CALL_BASELINES: tuple[str, ...] = ("llep",)
COMPARE_DEFAULT: tuple[str, ...] = ("static", "symi", "lrmoe")  # compare's systems unless a config lists others


def spec_of(system: str | SystemSpec) -> SystemSpec:
    """The spec of a system name (a spec passes through); a clear ValueError for unknown names."""
    if isinstance(system, SystemSpec):
        return system
    if system not in SPECS:
        raise ValueError(f"system={system!r} is invalid: expected one of {SYSTEMS}")
    return SPECS[system]


def names_where(**attrs: object) -> tuple[str, ...]:
    """System names whose spec has every given attribute value, e.g. ``takes_budget=True``."""
    return tuple(n for n, s in SPECS.items() if all(getattr(s, k) == v for k, v in attrs.items()))


@dataclass(frozen=True)
class SystemName:
    """A parsed ``system[-selection][@ratio]`` name (``capacity@1.5``: a forward drop's factor)."""

    system: str
    selection: str | None = None
    ratio: float | None = None
    capacity_factor: float | None = None  # ``capacity@F``: each expert computes at most ⌈F · pairs / E⌉

    @property
    def spec(self) -> SystemSpec:
        return SPECS[self.system]

    def __iter__(self):  # (system, selection, ratio), as the tuple form of earlier releases
        return iter((self.system, self.selection, self.ratio))


def parse_system_name(name: str) -> SystemName:
    """``system[-selection][@ratio]`` → (system, selection or None, ratio or None), e.g.
    ``lrmoe@0.5``, ``lrmoe-random@0.25``, ``masked@0.25``, ``static-recompute``; selection and
    ratio only for the selective systems. A forward drop takes ``@factor``, its capacity factor
    (``capacity@1.0``). A bad name raises ``ValueError``."""
    base, _, ratio = name.partition("@")
    system, selection = (base, "") if base in SPECS else base.split("-", 1) if "-" in base else (base, "")
    bad = ValueError(f"system {name!r} is invalid: expected one of {SYSTEMS}, optionally "
                     f"<system>-<selection> and @<ratio> for {names_where(selective=True)} "
                     f"(e.g. lrmoe-random@0.5), @<capacity factor> for {names_where(forward_drop=True)}")
    spec = SPECS.get(system)
    if spec is None or (selection and not spec.selective) or (ratio and not (spec.selective or spec.forward_drop)):
        raise bad
    try:
        value = float(ratio) if ratio else None
    except ValueError:
        raise bad from None
    if spec.forward_drop:
        if value is not None and not (math.isfinite(value) and value > 0):
            raise bad
        return SystemName(system, capacity_factor=value)
    return SystemName(system, selection or None, value)


def base_system(name: str) -> str | None:
    """The system a ``system[-selection][@ratio]`` name runs (``lrmoe`` for ``lrmoe-random@0.5``),
    or None for a name that is no system's (a run folder such as ``static-uncapped``), so that a
    caller classifying folders or table rows by their system need not spell a name."""
    try:
        return parse_system_name(name).system
    except ValueError:
        return None
