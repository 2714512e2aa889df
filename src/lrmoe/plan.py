"""LayerPlanner: every planning decision of one MoE layer, pure and deterministic.

One planner per layer observes the load, owns the placement (replicas re-planned between
steps, or per call), and turns each call's global per-(source rank, expert) counts into a
:class:`CallPlan`: placement, forward assignment of pairs to copies, forward chunk rows within
the budget, and for a selective backward the kept capacities and quotas. It runs no
collective and touches no tensor of the model: every rank computes the same plan from the same
counts. :class:`lrmoe.layer.MoELayer` and the simulator (``lrmoe.sim.plan``) drive the same
object, so what the simulator projects is what the layer does. Which planner and assignment
rule apply is read from the :class:`~lrmoe.systems.SystemSpec` (docs/design.md "Systems").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from lrmoe import planners
from lrmoe.balance import assign_min_peak
from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.controller import Controller
from lrmoe.meter import expert_param_bytes
from lrmoe.placement import Placement, plan_replicas
from lrmoe.planners import CostModel
from lrmoe.selection import fixed_ratio_quota
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
    assign_ESR: torch.Tensor  # int64 (E, W, W) forward pairs of expert e from source s computed at r
    chunk_rows_R: list[int] | None  # rows each rank may compute at once (None: all at once)
    kept_capacity_R: list[int] | None  # backward rows each rank may keep (None: unbounded)
    quota_E: torch.Tensor | None  # selective backward: pairs each expert keeps
    fetch: bool  # the call placed new copies: fetch them before the forward (collective)
    stats: dict = field(default_factory=dict)  # the plan's own figures (shadows, replicas, ...)


class LayerPlanner:
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
        budgeted = budget is not None and budget.memory_bytes is not None
        use_controller = budgeted and spec.planner is Planner.CONTROLLER
        self.controller = Controller(config, budget, world) if use_controller else None
        link = budget.inter_node_gbps if budget is not None and budget.inter_node_gbps else CostModel.link_gbps
        self.costs = CostModel(config.dim, config.ffn_dim, config.torch_dtype.itemsize, link_gbps=link)
        self.slots_R = self._plan_slots(budget)
        self.load_E = torch.ones(config.num_experts, dtype=torch.float64)
        self.steps = 0
        self.bound_optimizer_bytes = 0  # flexmoe: modelled, not moved (docs/systems.md)
        self._trace: list[torch.Tensor] = []  # smartmoe without a given trace: its own first loads
        self._pool = None if routing_trace is None else self._build_pool(torch.as_tensor(routing_trace))
        if self.keeps_replicas:
            self._replan()

    # ---------------------------------------------------------------- placement
    @property
    def keeps_replicas(self) -> bool:
        """Replicas live across calls (refreshed after each optimizer step)."""
        return self.slots_R is not None and self.spec.placement is not PlacementKind.PER_CALL \
            and self.spec.placement is not PlacementKind.SHARDED

    def _plan_slots(self, budget: ClusterBudget | None) -> list[int] | None:
        """Expert slots per rank for the replicated systems; None: single copies."""
        if self.controller is not None:
            return self.controller.slots(self.base)
        if not self.spec.uses_slots:  # fastermoe shadows on every rank
            return None
        fixed = budget.per_rank(self.world)[2] if budget is not None else None
        if fixed is not None:
            return fixed
        # SYMI default: half as many replica slots as owned experts (at least one); for laer the
        # experts a rank may assemble in one call
        owned = [len(self.base.owned(r)) for r in range(self.world)]
        return [o + max(1, math.ceil(o / 2)) for o in owned]

    def _replan(self) -> None:
        """Re-plan replicas from the smoothed load (between steps)."""
        planner = self.spec.planner
        if planner is Planner.FLEXMOE:
            old = self.placement
            self.placement, _ = planners.flexmoe_replan(old, self.load_E, self.slots_R, self.costs, FLEXMOE_HORIZON)
            # the optimizer state this rank, as owner, would send along with its experts' new copies
            owner_E = self.base.owner_E
            sent = sum(int(owner_E[e]) == self.rank for new, was in zip(self.placement.slots, old.slots)
                       for e in set(new) - set(was))
            self.bound_optimizer_bytes += sent * ADAM_STATES * expert_param_bytes(
                self.config.dim, self.config.ffn_dim, self.config.torch_dtype.itemsize)
        elif planner is Planner.SMARTMOE:
            if self._pool is None and len(self._trace) >= SMARTMOE_WARMUP:
                self._pool = self._build_pool(torch.stack(self._trace))
            if self._pool is not None:
                self.placement = self._pool[planners.pick_from_pool(self._pool, self.load_E)]
        else:
            node_of = self.node_of if planner is Planner.NODE_AWARE else None
            self.placement = plan_replicas(self.base, self.load_E, self.slots_R, node_of)
        if self.controller is not None:
            self.controller.check_slots(self.placement)

    def _build_pool(self, trace_NE: torch.Tensor) -> list[Placement]:
        """SmartMoE's offline pool of placements from a (calls, E) load trace."""
        return planners.placement_pool(trace_NE, self.base, self.slots_R, SMARTMOE_POOL)

    def _place_call(self, counts_SE: torch.Tensor) -> dict:
        """Per-call planners: this call's placement from its own counts. Returns its stats."""
        counts_E = counts_SE.sum(0)
        planner = self.spec.planner
        if planner is Planner.LAER:  # assembled in the routed forward, from the slices
            self.placement = planners.laer_layout(counts_E, self.base, self.slots_R)
            return {"assembled_experts": self.placement.num_copies}
        if planner is Planner.SHADOW:
            shadow = planners.shadow_experts(counts_SE, self.base, self.costs)
            owner_E = self.base.owner_E
            self.placement = self.base.with_replicas(
                [[e for e in shadow if int(owner_E[e]) != r] for r in range(self.world)])
            return {"shadowed_experts": len(shadow)}
        # replica counts ∝ this call's load; per-replica quotas by assign_min_peak (UltraEP)
        self.placement = plan_replicas(self.base, counts_E.to(torch.float64), self.slots_R)
        return {"replicas": self.placement.num_copies - self.config.num_experts}

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
               capacity_R: list[int] | None = None) -> torch.Tensor:
        """assign_ESR: single copies go to their owner; replicated experts are spread min-peak
        (shadowed experts compute where their pairs are; node-aware systems then re-match
        sources to holders to keep pairs inside their node)."""
        rule = self.spec.assignment
        if rule is Assignment.LOCAL:
            return planners.local_assignment(counts_SE, placement)
        if placement.owners_only:
            return placement.owner_assignment(counts_SE)
        assign_ESR = assign_min_peak(counts_SE.t(), placement.holder_lists, capacity_R)
        if rule is Assignment.LOCALIZED:
            assign_ESR = planners.localize(assign_ESR, self.node_of)
        return assign_ESR

    def plan_call(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor | None = None,
                  training: bool = True) -> CallPlan:
        """Plan one call from its global counts (``forward_SE``: the pairs a forward drop kept).
        A training call updates the load and, for a selective backward, fixes the quotas."""
        forward_SE = counts_SE if forward_SE is None else forward_SE
        if training:
            self.observe(counts_SE.sum(0))
        per_call = self.spec.placement in (PlacementKind.PER_CALL, PlacementKind.SHARDED)
        stats = self._place_call(counts_SE) if per_call else {}
        placement = self.placement
        assign_ESR = self.assign(forward_SE, placement)
        chunk_rows_R = kept_capacity_R = quota_E = None
        if self.controller is not None:  # every rank checks every rank, so all raise together
            recv_R = assign_ESR.sum((0, 1)).tolist()
            chunk_rows_R = [self.controller.forward_chunk_rows(placement, r, int(n)) for r, n in enumerate(recv_R)]
        if self.spec.selective and training:
            kept_capacity_R = self.controller.kept_capacity(placement) if self.controller is not None else None
            quota_E = self.quotas(counts_SE.sum(0), placement, kept_capacity_R)
        fetch = per_call and self.spec.placement is PlacementKind.PER_CALL
        return CallPlan(placement, counts_SE, forward_SE, assign_ESR, chunk_rows_R, kept_capacity_R, quota_E,
                        fetch, stats)

    def quotas(self, counts_E: torch.Tensor, placement: Placement, cap_R: list[int] | None) -> torch.Tensor:
        """The controller's max–min fair quotas capped by the ratio's, or the ratio's alone."""
        quota_E = fixed_ratio_quota(counts_E, self.backward.ratio)
        if self.controller is not None:
            quota_E = torch.minimum(quota_E, self.controller.quotas(counts_E, placement, cap_R))
        return quota_E

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        return {"load_E": self.load_E.clone(), "steps": self.steps,
                "slots": [list(s) for s in self.placement.slots], "trace": [t.clone() for t in self._trace]}

    def load_state(self, state: dict) -> None:
        self.load_E = state["load_E"].clone()
        self.steps = int(state["steps"])
        self._trace = [t.clone() for t in state.get("trace", [])]
        if self.spec.planner is Planner.SMARTMOE and len(self._trace) >= SMARTMOE_WARMUP:
            self._pool = self._build_pool(torch.stack(self._trace))
        if self.keeps_replicas:
            owner_E = self.base.owner_E
            replicas = [[e for e in s if int(owner_E[e]) != r] for r, s in enumerate(state["slots"])]
            self.placement = self.base.with_replicas(replicas)
