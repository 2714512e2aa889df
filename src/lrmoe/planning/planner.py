"""LayerPlanner: every planning decision of one MoE layer, pure and deterministic.

One planner per layer observes the load, owns the placement (replicas re-planned between
steps, or per call), and turns each call's global per-(source rank, expert) counts into a
:class:`CallPlan`: placement, forward assignment of pairs to copies, forward chunk rows within
the budget, and for a selective backward the kept capacities and quotas. It runs no
collective and touches no tensor of the model: every rank computes the same plan from the same
counts. :class:`lrmoe.layer.MoELayer` and the simulator (``lrmoe.sim.plan``) drive the same
object, so what the simulator projects is what the layer does. Which planner and assignment
rule apply is read from the :class:`~lrmoe.systems.SystemSpec` (docs/design.md "Systems").

Under a memory cap (``ClusterBudget(memory_bytes=M)``) every system lives within M by the one
byte model (docs/design.md "The paper's regime"). ``lrmoe`` plans through its controller. For
every other system the planner predicts each rank's peak from the call's plan with
:func:`lrmoe.memory.bytes.expert_side_peak` (the layer's meter replayed on numbers) before any row
moves:

- a rank whose rows do not fit at once computes its forward in the largest chunks that do,
  where the system keeps no activations to the backward (static and capacity keep them, so
  their rows and activations must fit whole);
- replicated systems spread pairs min-peak within each rank's room where the unbounded spread
  does not fit, and hold the most copies that fit, never more than their unconstrained default
  and never fewer than their owned experts: one slot at a time is taken from the rank furthest
  over the cap, re-planning each time, until a plan fits. Per-step planners choose their slots
  at every re-plan against the last call's rows, and re-plan inside a training call that does
  not fit (its copies fetched before rows move); per-call planners choose for each call
  (ultraep replicas, laer assembled experts; fastermoe drops its least-loaded shadows first).
  Fixed ``ClusterBudget.slots`` are kept as given;
- where nothing fits, every rank raises the same :class:`~lrmoe.errors.MemoryBudgetExceeded`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.memory.bytes import ByteModel, expert_param_bytes
from lrmoe.planning import replication as planners
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.balance import min_peak_assignment
from lrmoe.planning.cap_fit import CapFitting
from lrmoe.planning.controller import Controller
from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.replica_search import ReplicaSearch
from lrmoe.planning.replication import CostModel
from lrmoe.selection.selections import fixed_ratio_quota
from lrmoe.systems import Assignment, PlacementKind, Planner, SystemSpec

ADAM_STATES = planners.ADAM_STATES  # optimizer_bytes assumes Adam(W): two moments per owned parameter
SMARTMOE_POOL = 4  # placements in SmartMoE's offline pool
SMARTMOE_WARMUP = 20  # without a given trace, SmartMoE records this many calls' loads first
FLEXMOE_HORIZON = 10  # steps a FlexMoE re-placement is expected to last when weighing its cost


@dataclass(frozen=True)
class CallPlan:
    """What one layer call does, identical on every rank."""

    placement: Placement
    counts_SE: torch.Tensor  # int64 (W, E) routed pairs per source rank and expert
    forward_SE: torch.Tensor  # pairs the forward computes (a capacity factor drops the rest)
    assignment: PairAssignment  # forward pairs of expert e from source s computed at r
    chunk_rows_R: list[int] | None  # rows each rank may compute at once (None: every rank all at once)
    kept_capacity_R: list[int] | None  # backward rows each rank may keep (None: unbounded)
    quota_E: torch.Tensor | None  # selective backward: pairs each expert keeps
    fetch: bool  # the call placed new copies: fetch them before the forward (collective)
    stats: dict = field(default_factory=dict)  # the plan's own figures (shadows, replicas, ...)
    peak_R: list[int] | None = None  # predicted expert-side peak per rank (a capped non-controller system)
    keep: str | None = None  # a compacting training call: what its expert side keeps (meter.KEEP_MODES)


class LayerPlanner(CapFitting, ReplicaSearch):
    """Placement state and per-call plans of one layer (see the module docstring)."""

    def __init__(self, spec: SystemSpec, config: MoEConfig, world: int, rank: int = 0,
                 budget: ClusterBudget | None = None, backward: BackwardConfig | None = None,
                 capacity_factor: float = 1.25, replan_interval: int = 10, load_ema: float = 0.9,
                 routing_trace: torch.Tensor | None = None) -> None:
        self.spec, self.config, self.world, self.rank = spec, config, world, rank
        self.backward = backward or BackwardConfig()
        self.capacity_factor = float(capacity_factor)
        self.replan_interval = 1 if spec.replan_every_step else replan_interval
        self.load_ema = load_ema
        self.node_of = budget.node_of(world) if budget is not None else None
        self.base = Placement.static(config.num_experts, world)
        self.placement = self.base
        self.memory_R, _, self.fixed_slots_R = budget.per_rank(world) if budget is not None else (None, None, None)
        use_controller = self.memory_R is not None and spec.planner is Planner.CONTROLLER
        self.controller = Controller(config, budget, world) if use_controller else None
        self._replica_k: int | None = None  # lrmoe: the extra slots its last cost search chose
        if use_controller:  # replicas follow the load every step; their number is searched every replan_interval
            self.search_interval, self.replan_interval = replan_interval, 1
        # a cap this planner keeps every call within by the byte model (lrmoe: its controller does)
        self.capped = self.memory_R is not None and self.controller is None
        self.bytes = ByteModel.of(config, spec.selective)
        link = budget.inter_node_gbps if budget is not None and budget.inter_node_gbps else CostModel.link_gbps
        self.costs = CostModel(config.dim, config.ffn_dim, config.torch_dtype.itemsize, link_gbps=link)
        self.default_slots_R = self._plan_slots()
        self.slots_R = None if self.default_slots_R is None else list(self.default_slots_R)
        self.load_E = torch.ones(config.num_experts, dtype=torch.float64)
        self.steps = 0
        self.bound_optimizer_bytes = 0  # flexmoe: modelled, not moved (docs/systems.md)
        self._last_SE: torch.Tensor | None = None  # the last training call's rows (a capped re-plan's prediction)
        self._trace: list[torch.Tensor] = []  # smartmoe without a given trace: its own first loads
        self._pool = None if routing_trace is None else self._build_pool(torch.as_tensor(routing_trace))
        if self.capped:
            self._check_owned()
        if self.keeps_replicas:
            self._replan()

    # ---------------------------------------------------------------- placement
    @property
    def keeps_replicas(self) -> bool:
        """Replicas live across calls (refreshed after each optimizer step)."""
        return self.slots_R is not None and self.spec.placement is not PlacementKind.PER_CALL \
            and self.spec.placement is not PlacementKind.SHARDED

    def _plan_slots(self) -> list[int] | None:
        """Expert slots per rank for the replicated systems (the most a cap may leave them);
        None: single copies."""
        if self.controller is not None:
            return self.controller.slots(self.base)
        if not self.spec.uses_slots:  # fastermoe shadows on every rank
            return None
        if self.fixed_slots_R is not None:
            return list(self.fixed_slots_R)
        # SYMI default: half as many replica slots as owned experts (at least one); for laer the
        # experts a rank may assemble in one call
        owned = [len(self.base.owned(r)) for r in range(self.world)]
        return [o + max(1, math.ceil(o / 2)) for o in owned]

    def _step_placement(self, slots_R: list[int]) -> Placement:
        """A per-step planner's placement within ``slots_R`` (pure: adopted by :meth:`_adopt`)."""
        planner = self.spec.planner
        if planner is Planner.FLEXMOE:
            current = self._trim(self.placement, slots_R)
            return planners.flexmoe_replan(current, self.load_E, slots_R, self.costs, FLEXMOE_HORIZON)[0]
        if planner is Planner.SMARTMOE:
            chosen = self.placement if self._pool is None else self._pool[planners.pick_from_pool(self._pool,
                                                                                                 self.load_E)]
            return self._trim(chosen, slots_R)
        node_of = self.node_of if planner is Planner.NODE_AWARE else None
        return plan_replicas(self.base, self.load_E, slots_R, node_of)

    def _trim(self, placement: Placement, slots_R: list[int]) -> Placement:
        """``placement`` with, on every rank over its slots, its coldest replicas (least smoothed
        load per copy) dropped."""
        load = self.load_E.tolist()
        keep = []
        for r in range(self.world):
            room = max(slots_R[r] - len(self.base.owned(r)), 0)
            mine = sorted(placement.replicas(r), key=lambda e: (-load[e] / len(placement.holders(e)), e))
            keep.append(mine[:room])
        return self.base.with_replicas(keep)

    def _replan(self) -> None:
        """Re-plan replicas from the smoothed load (between steps); under a cap, with the most
        slots (up to the default) whose plan fits the last call's rows."""
        if self.spec.planner is Planner.SMARTMOE and self._pool is None and len(self._trace) >= SMARTMOE_WARMUP:
            self._pool = self._build_pool(torch.stack(self._trace))
        if self.capped and self.fixed_slots_R is None and self._last_SE is not None:
            fit, self.slots_R, _ = self._search_slots(self._step_placement, self.default_slots_R, self._last_SE, True)
            self._adopt(fit.placement if fit is not None else self._step_placement(self.slots_R))
        elif self.controller is not None and self.fixed_slots_R is None:
            self._adopt(self._controller_replicas())
        else:
            self._adopt(self._step_placement(self.slots_R))

    def _adopt(self, placement: Placement) -> None:
        """Make ``placement`` this layer's replica plan (flexmoe: the optimizer state it binds)."""
        if self.spec.planner is Planner.FLEXMOE:
            # the optimizer state this rank, as owner, would send along with its experts' new copies
            owner_E = self.base.owner_E
            sent = sum(int(owner_E[e]) == self.rank for new, was in zip(placement.slots, self.placement.slots)
                       for e in set(new) - set(was))
            self.bound_optimizer_bytes += sent * ADAM_STATES * expert_param_bytes(
                self.config.dim, self.config.ffn_dim, self.config.torch_dtype.itemsize)
        self.placement = placement
        if self.controller is not None:
            self.controller.check_slots(self.placement)

    def _build_pool(self, trace_NE: torch.Tensor) -> list[Placement]:
        """SmartMoE's offline pool of placements from a (calls, E) load trace."""
        return planners.placement_pool(trace_NE, self.base, self.default_slots_R, SMARTMOE_POOL)

    def _shadow_placement(self, shadow: list[int]) -> Placement:
        """FasterMoE: every shadowed expert copied to every rank."""
        owner_E = self.base.owner_E
        return self.base.with_replicas([[e for e in shadow if int(owner_E[e]) != r] for r in range(self.world)])

    def _call_placement(self, counts_SE: torch.Tensor, slots_R: list[int]) -> Placement:
        """Per-call slot planners: laer's assembled experts or ultraep's replicas within ``slots_R``."""
        counts_E = counts_SE.sum(0)
        if self.spec.planner is Planner.LAER:  # assembled in the routed forward, from the slices
            return planners.laer_layout(counts_E, self.base, slots_R)
        # replica counts ∝ this call's load; per-replica quotas by assign_min_peak (UltraEP)
        return plan_replicas(self.base, counts_E.to(torch.float64), slots_R)

    def _call_stats(self, placement: Placement, shadowed: int = 0) -> dict:
        planner = self.spec.planner
        if planner is Planner.LAER:
            return {"assembled_experts": placement.num_copies}
        if planner is Planner.SHADOW:
            return {"shadowed_experts": shadowed}
        return {"replicas": placement.num_copies - self.config.num_experts}

    def _place_call(self, counts_SE: torch.Tensor) -> dict:
        """Per-call planners without a cap: this call's placement from its own counts. Returns its stats."""
        if self.spec.planner is Planner.SHADOW:
            shadow = planners.shadow_experts(counts_SE, self.base, self.costs)
            self.placement = self._shadow_placement(shadow)
            return self._call_stats(self.placement, len(shadow))
        self.placement = self._call_placement(counts_SE, self.slots_R)
        return self._call_stats(self.placement)

    def observe(self, counts_E: torch.Tensor) -> None:
        """A training call's global load enters the smoothed load (and smartmoe's trace)."""
        self.load_E = self.load_ema * self.load_E + (1 - self.load_ema) * counts_E.to(torch.float64)
        if self.spec.planner is Planner.SMARTMOE and self._pool is None:
            self._trace.append(counts_E.to(torch.float64))

    def step_end(self) -> bool:
        """After an optimizer step: re-plan when due. Returns whether replicas must be refreshed."""
        self.steps += 1
        if not self.keeps_replicas:
            return False
        if self.steps % self.replan_interval == 0:
            self._replan()
        return True

    def take_bound_optimizer_bytes(self) -> int | None:
        """flexmoe: modelled optimizer bytes bound to new copies since the last take; else None."""
        if self.spec.planner is not Planner.FLEXMOE:
            return None
        out, self.bound_optimizer_bytes = self.bound_optimizer_bytes, 0
        return out

    # ---------------------------------------------------------------- per call
    def forward_quota(self, counts_SE: torch.Tensor) -> torch.Tensor | None:
        """Capacity factor (GShard/Switch): each expert computes at most ceil(C · pairs / E)
        pairs, the rest dropped in both passes; None for systems with a complete forward."""
        if not self.spec.forward_drop:
            return None
        capacity = math.ceil(self.capacity_factor * int(counts_SE.sum()) / self.config.num_experts)
        return torch.clamp(counts_SE.sum(0), max=capacity)

    def assign(self, counts_SE: torch.Tensor, placement: Placement,
               capacity_R: list[int] | None = None) -> PairAssignment:
        """Where each pair is computed: single copies go to their owner; replicated experts are spread min-peak
        (shadowed experts compute where their pairs are; node-aware systems then re-match
        sources to holders to keep pairs inside their node)."""
        rule = self.spec.assignment
        if rule is Assignment.LOCAL:
            return planners.local_assignment(counts_SE, placement)
        if placement.owners_only:
            return placement.owner_assignment(counts_SE)
        assignment = min_peak_assignment(counts_SE.t(), placement.holder_index, capacity_R)
        if rule is Assignment.LOCALIZED:
            assignment = planners.localize(assignment, self.node_of)
        return assignment

    def plan_call(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor | None = None,
                  training: bool = True) -> CallPlan:
        """Plan one call from its global counts (``forward_SE``: the pairs a forward drop kept).
        A training call updates the load and, for a selective backward, fixes the quotas. Under
        a memory cap, raises :class:`MemoryBudgetExceeded` (on every rank alike) where the call
        cannot fit."""
        forward_SE = counts_SE if forward_SE is None else forward_SE
        if training:
            self.observe(counts_SE.sum(0))
            if self.capped or self.controller is not None:
                self._last_SE = forward_SE.clone()
        per_call = self.spec.placement in (PlacementKind.PER_CALL, PlacementKind.SHARDED)
        fetch = self.spec.placement is PlacementKind.PER_CALL
        chunk_rows_R = kept_capacity_R = quota_E = peak_R = None
        if self.capped:
            fit, stats, replanned = self._fit_call(counts_SE, forward_SE, training)
            placement, assignment, chunk_rows_R, peak_R = fit.placement, fit.assignment, fit.chunk_rows_R, fit.peak_R
            fetch = fetch or replanned
        else:
            stats = self._place_call(counts_SE) if per_call else {}
            placement = self.placement
            assignment = self.assign(forward_SE, placement)
            if self.controller is not None:
                try:
                    assignment, chunk_rows_R = self._controller_forward(forward_SE, placement, assignment)
                except MemoryBudgetExceeded:
                    if not (training and self.keeps_replicas and self.fixed_slots_R is None):
                        raise
                    # re-plan the replicas by this call's rows; the new copies are fetched before any row moves
                    self._adopt(self._controller_replicas(in_call=True))
                    placement, fetch = self.placement, True
                    assignment, chunk_rows_R = self._controller_forward(forward_SE, placement,
                                                                        self.assign(forward_SE, placement))
        if self.spec.selective and training:
            kept_capacity_R = self.controller.kept_capacity(placement) if self.controller is not None else None
            quota_E = self.quotas(counts_SE.sum(0), placement, kept_capacity_R)
        keep = None
        if self.spec.compacts and training:
            keep = stats["keep_mode"] = self.keep_mode(placement, assignment, chunk_rows_R, quota_E)
        stats["replica_slots"] = len(placement.slots[self.rank])
        if self.memory_R is not None:
            stats["memory_cap_bytes"] = self.memory_R[self.rank]
        if peak_R is not None:
            stats["predicted_peak_bytes"] = peak_R[self.rank]
        return CallPlan(placement, counts_SE, forward_SE, assignment, chunk_rows_R, kept_capacity_R, quota_E,
                        fetch, stats, peak_R, keep)

    def quotas(self, counts_E: torch.Tensor, placement: Placement, cap_R: list[int] | None) -> torch.Tensor:
        """The controller's max–min fair quotas capped by the ratio's, or the ratio's alone."""
        quota_E = fixed_ratio_quota(counts_E, self.backward.ratio)
        if self.controller is not None:
            quota_E = torch.minimum(quota_E, self.controller.quotas(counts_E, placement, cap_R))
        return quota_E

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        return {"load_E": self.load_E.clone(), "steps": self.steps,
                "slots": [list(s) for s in self.placement.slots], "trace": [t.clone() for t in self._trace],
                "replica_k": self._replica_k}

    def load_state(self, state: dict) -> None:
        self.load_E = state["load_E"].clone()
        self.steps = int(state["steps"])
        self._trace = [t.clone() for t in state.get("trace", [])]
        self._replica_k = state.get("replica_k")
        if self.spec.planner is Planner.SMARTMOE and len(self._trace) >= SMARTMOE_WARMUP:
            self._pool = self._build_pool(torch.stack(self._trace))
        if self.keeps_replicas:
            owner_E = self.base.owner_E
            replicas = [[e for e in s if int(owner_E[e]) != r] for r, s in enumerate(state["slots"])]
            self.placement = self.base.with_replicas(replicas)
