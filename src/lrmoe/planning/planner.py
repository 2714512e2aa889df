"""LayerPlanner: every planning decision of one MoE layer, pure and deterministic.

One planner per layer observes the load, owns the placement, and turns each call's global
per-(source rank, expert) counts into a :class:`~lrmoe.planning.call_plan.CallPlan`. It runs no
collective and touches no tensor of the model: every rank computes the same plan from the same
counts, and the layer and the simulator drive the same object. The spec says what applies
(docs/design.md "Systems"): the placement strategy (:mod:`lrmoe.planning.strategies`) decides
where copies live, the assignment rule (:mod:`lrmoe.planning.pair_rules`) which copy computes
which pairs; the planner decides when (between steps, or per call).

Under a memory cap (``ClusterBudget(memory_bytes=M)``; docs/systems.md "Under a memory cap")
``lrmoe`` plans through its controller (:mod:`lrmoe.planning.controller`); every other system's
calls are fitted by a :class:`~lrmoe.planning.cap_fit.CapFitter` from each rank's predicted peak
(:mod:`lrmoe.planning.peaks`): the most copies keeping what the system keeps, else keeping x
alone, chunked. Where nothing fits, every rank raises the same ``MemoryBudgetExceeded``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.memory.bytes import ByteModel, in_rounds
from lrmoe.planning import peaks as peak_model
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.backward_plan import plan_backward
from lrmoe.planning.call_plan import BackwardPlan, CallPlan
from lrmoe.planning.cap_fit import CapFitter, first_that_fits
from lrmoe.planning.controller import Controller
from lrmoe.planning.cost import CostModel
from lrmoe.planning.figures import PlanFigures, cap_figures
from lrmoe.planning.noise_control import noise_controller
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.peaks import Fit, RankPeaks
from lrmoe.planning.placement import Placement
from lrmoe.planning.replica_search import ReplicaCountSearch
from lrmoe.planning.strategies import StrategyInputs, strategy_for
from lrmoe.systems import PlacementKind, Planner, SystemSpec


class LayerPlanner:
    """Placement state and per-call plans of one layer (see the module docstring)."""

    def __init__(self, spec: SystemSpec, config: MoEConfig, world: int, rank: int = 0,
                 budget: ClusterBudget | None = None, backward: BackwardConfig | None = None,
                 capacity_factor: float = 1.25, replan_interval: int = 10, load_ema: float = 0.9,
                 routing_trace: torch.Tensor | None = None) -> None:
        self.spec, self.config, self.world, self.rank = spec, config, world, rank
        self.backward = backward or BackwardConfig()
        self.noise = noise_controller(spec.selective, self.backward)  # its ratio, carried between steps
        self.capacity_factor = float(capacity_factor)
        self.replan_interval = 1 if spec.replan_every_step else replan_interval
        self.load_ema = load_ema
        self.node_of = budget.node_of(world) if budget is not None else None
        self.base = self.placement = Placement.static(config.num_experts, world)
        self.memory_R, _, self.fixed_slots_R = budget.per_rank(world) if budget is not None else (None, None, None)
        use_controller = self.memory_R is not None and spec.planner is Planner.CONTROLLER
        self.controller = Controller(config, budget, world) if use_controller else None
        if use_controller:  # replicas follow the load every step; their number is searched every replan_interval
            self.replan_interval = 1
        self.bytes = ByteModel.of(config, spec.selective)
        link = budget.inter_node_gbps if budget is not None and budget.inter_node_gbps else CostModel.link_gbps
        self.costs = CostModel(config.dim, config.ffn_dim, config.torch_dtype.itemsize, link_gbps=link)
        self.default_slots_R = self._plan_slots()
        self.slots_R = None if self.default_slots_R is None else list(self.default_slots_R)
        self.load_E = torch.ones(config.num_experts, dtype=torch.float64)
        self.steps = 0
        self._last_SE: torch.Tensor | None = None  # the last training call's rows (a capped re-plan's prediction)
        self.kept_activations = True  # the last backward kept x+acts: the next lays rows by weight (in place)
        self.strategy = strategy_for(spec.planner, StrategyInputs(self.base, config, rank, self.costs, self.node_of,
                                                                  self.default_slots_R, routing_trace))
        # peaks under a cap; a fitter where this planner fits every call (lrmoe's controller plans itself)
        self.peaks = None if self.memory_R is None else RankPeaks(spec, config, world, self.memory_R)
        self.fitter = None
        if self.peaks is not None and self.controller is None:
            self.fitter = CapFitter(self.peaks, self.assign, self.base, self.fixed_slots_R is not None,
                                    self.default_slots_R is not None or self.strategy.varies_copies)
            self.fitter.check_owned()
        self.fitters = [] if self.fitter is None else self.fitter.with_fallbacks()  # richest keep first
        self.search = None if self.controller is None else ReplicaCountSearch(
            self.base, self.controller, self.costs, self.bytes.slot_params, replan_interval, self.assign)
        if self.keeps_replicas:
            self._replan()

    # ---------------------------------------------------------------- placement
    @property
    def keeps_replicas(self) -> bool:
        """Replicas live across calls (refreshed after each optimizer step)."""
        return self.slots_R is not None and self.spec.placement not in (PlacementKind.PER_CALL, PlacementKind.SHARDED)

    def _plan_slots(self) -> list[int] | None:
        """Expert slots per rank for the replicated systems (the most a cap may leave them); None: single copies."""
        if self.controller is not None:
            return self.controller.slots(self.base)
        if not self.spec.uses_slots:  # fastermoe shadows on every rank
            return None
        if self.fixed_slots_R is not None:
            return list(self.fixed_slots_R)
        # SYMI: half as many replica slots as owned experts (at least one); laer: the experts it may assemble at once
        return [o + max(1, math.ceil(o / 2)) for o in self.base.owned_counts]

    def _step_placement(self, slots_R: list[int]) -> Placement:
        """The strategy's placement between steps within ``slots_R`` (pure: adopted by :meth:`_adopt`)."""
        return self.strategy.step_placement(self.placement, self.load_E, slots_R)

    def _replan(self) -> None:
        """Re-plan replicas from the smoothed load (between steps); under a cap, with the most
        slots (up to the default) whose plan fits the last call's rows."""
        self.strategy.before_replan()
        if self.fitter is not None and self.fixed_slots_R is None and self._last_SE is not None:
            for fitter in self.fitters:
                found = fitter.search_slots(self._step_placement, self.default_slots_R, self._last_SE, True)
                if found.fit is not None:
                    break
            self.slots_R = found.slots
            self._adopt(found.fit.placement if found.fit is not None else self._step_placement(self.slots_R))
        elif self.search is not None and self.fixed_slots_R is None:
            self._adopt(self._search_replicas())
        else:
            self._adopt(self._step_placement(self.slots_R))

    def _adopt(self, placement: Placement) -> None:
        """Make ``placement`` this layer's replica plan."""
        self.strategy.adopted(self.placement, placement)
        self.placement = placement
        if self.controller is not None:
            self.controller.check_slots(self.placement)

    def _search_replicas(self, in_call: bool = False) -> Placement:
        """lrmoe's replicas from its replica-count search (:mod:`lrmoe.planning.replica_search`)."""
        return self.search.choose(self.load_E, self._last_SE, self.steps, self.default_slots_R, in_call)

    def _may_replan_in_call(self, training: bool) -> bool:
        return training and self.keeps_replicas and self.fixed_slots_R is None  # (fixed slots stay as given)

    def _replan_in_call(self, forward_SE: torch.Tensor, failed: list[Fit], fitter: CapFitter | None = None) -> Fit:
        """The one re-plan inside a training call whose forward does not fit the replicas of the
        last step: the replicas re-planned by this call's rows (lrmoe: its replica-count search
        over every candidate; the others: the most slots that fit), adopted, and the call fitted
        on them. The new copies are fetched before any row moves. Raises
        :class:`MemoryBudgetExceeded` where no re-plan fits (``failed``: the plans tried before)."""
        if self.controller is not None:
            self._adopt(self._search_replicas(in_call=True))
            forward = self.controller.fit_forward(forward_SE, self.placement, self.assign(forward_SE, self.placement),
                                                  self.assign)
            return Fit(self.placement, forward.assignment, forward.chunks, None, True, rounds=forward.rounds)
        found = fitter.search_slots(self._step_placement, self.default_slots_R, forward_SE, True)
        if found.fit is None:
            raise fitter.exceeded(failed + found.failed)
        self.slots_R = found.slots
        self._adopt(found.fit.placement)
        return found.fit

    def observe(self, counts_E: torch.Tensor) -> None:
        """A training call's global load enters the smoothed load (and the strategy's own record)."""
        self.load_E = self.load_ema * self.load_E + (1 - self.load_ema) * counts_E.to(torch.float64)
        self.strategy.observe(counts_E)

    def step_end(self) -> bool:
        """After an optimizer step: re-plan when due. Returns whether replicas must be refreshed."""
        self.steps += 1
        if not self.keeps_replicas:
            return False
        if self.steps % self.replan_interval == 0:
            self._replan()
        return True

    def take_bound_optimizer_bytes(self) -> int | None:
        """Optimizer bytes bound to new copies since the last take (modelled); None: none moves."""
        return self.strategy.take_bound_optimizer_bytes()

    @property
    def replica_count_chosen(self) -> bool:
        """lrmoe: its replica-count search has run once (the first scores every candidate)."""
        return self.search is not None and self.search.chosen

    # ---------------------------------------------------------------- per call
    def forward_quota(self, counts_SE: torch.Tensor) -> torch.Tensor | None:
        """Capacity factor (GShard/Switch): each expert keeps ⌈C · pairs / E⌉ pairs at most (None: no drop)."""
        if not self.spec.forward_drop:
            return None
        E = self.config.num_experts  # (a factor past E keeps every pair already: no quota above the pairs)
        capacity = math.ceil(min(self.capacity_factor, E) * int(counts_SE.sum()) / E)
        return torch.clamp(counts_SE.sum(0), max=capacity)

    def assign(self, counts_SE: torch.Tensor, placement: Placement,
               capacity_R: list[int] | None = None) -> PairAssignment:
        """Where each pair is computed (:func:`~lrmoe.planning.pair_rules.assign_pairs` by the spec's rule)."""
        return assign_pairs(self.spec.assignment, counts_SE, placement, capacity_R, self.node_of)

    def plan_forward(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor | None = None, training: bool = True
                     ) -> CallPlan:
        """The forward's plan of one call from its global counts (``forward_SE``: the pairs a
        forward drop kept): placement, assignment, chunks. A training call updates the load;
        its backward's part follows from :meth:`plan_backward`. Under a memory cap, raises
        :class:`MemoryBudgetExceeded` (on every rank alike) where the call cannot fit."""
        forward_SE = counts_SE if forward_SE is None else forward_SE
        if training:  # the load the copies serve: a forward drop's overflow is computed nowhere
            self.observe(forward_SE.sum(0))
            if self.peaks is not None:
                self._last_SE = forward_SE.clone()
        if self.fitter is not None:
            fit, figures, replanned = self._fit_call(counts_SE, forward_SE, training)
        else:
            fit, figures, replanned = self._free_call(counts_SE, forward_SE, training)
        placement = fit.placement
        # an exact system keeps what its fit says (None: its own); a compacting one what its backward plan says
        keep = fit.keep if training and not self.spec.compacts else None
        capped = cap_figures(fit, self.memory_R, self.rank, training and not self.spec.compacts)
        figures = replace(figures, replica_slots=len(placement.slots[self.rank]), **capped)
        fetch = self.spec.placement is PlacementKind.PER_CALL or replanned
        rounds_R = fit.chunk_rows_R if fit.rounds or in_rounds(self.spec, fit.keep) else None
        return CallPlan(placement, counts_SE, forward_SE, fit.assignment, fit.chunk_rows_R, None, None, fetch, figures,
                        fit.peak_R, keep, self.spec.assignment, self.node_of, fit.bwd_chunk_rows_R, rounds_R,
                        fit.split_R if training else None)

    def plan_backward(self, plan: CallPlan) -> BackwardPlan:
        """The backward's part of a training call's plan (pure; :mod:`lrmoe.planning.backward_plan`)."""
        return plan_backward(self, plan)

    def plan_call(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor | None = None,
                  training: bool = True) -> CallPlan:
        """Both parts of one call's plan at once: what the layer's plan and deferred stages compute."""
        plan = self.plan_forward(counts_SE, forward_SE, training)
        return plan.with_backward(self.plan_backward(plan), self.spec) if training else plan

    def _fit_call(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor, training: bool
                  ) -> tuple[Fit, PlanFigures, bool]:
        """A capped call's plan within the cap: (plan, its figures, whether a per-step placement
        was re-planned inside the call), by the richest way of keeping to the backward that fits.
        Raises :class:`MemoryBudgetExceeded` where none fits: the error of the leanest way."""
        return first_that_fits(self.fitters, lambda fitter: self._fit_with(fitter, counts_SE, forward_SE, training))

    def _fit_with(self, fitter: CapFitter, counts_SE: torch.Tensor, forward_SE: torch.Tensor, training: bool
                  ) -> tuple[Fit, PlanFigures, bool]:
        """:meth:`_fit_call` by one fitter (pure until it returns)."""
        if self.spec.placement in (PlacementKind.PER_CALL, PlacementKind.SHARDED):
            fit, figures = self.strategy.fit_call(counts_SE, self.slots_R, fitter, forward_SE, training)
            self.placement = fit.placement
            return fit, figures, False
        fit = fitter.fit(forward_SE, self.placement, training)
        if fit.ok:
            return fit, PlanFigures(), False
        if not self._may_replan_in_call(training):
            raise fitter.exceeded([fit])
        return self._replan_in_call(forward_SE, [fit], fitter), PlanFigures(replanned_in_call=True), True

    def _free_call(self, counts_SE: torch.Tensor, forward_SE: torch.Tensor, training: bool
                   ) -> tuple[Fit, PlanFigures, bool]:
        """A call no cap fitting bounds: per-call systems place it from its own counts; lrmoe's
        controller chunks its forward within the budget, or moves its rows in rounds (re-planning
        replicas inside a training call whose forward does not fit, or fits only in rounds)."""
        figures = PlanFigures()
        if self.spec.placement in (PlacementKind.PER_CALL, PlacementKind.SHARDED):
            self.placement, figures = self.strategy.place_call(counts_SE, self.slots_R)
        assignment = self.assign(forward_SE, self.placement)
        if self.controller is None:
            return Fit(self.placement, assignment, None, None, True), figures, False
        try:
            forward = self.controller.fit_forward(forward_SE, self.placement, assignment, self.assign)
        except MemoryBudgetExceeded:
            if not self._may_replan_in_call(training):
                raise
            return self._replan_in_call(forward_SE, []), figures, True
        if forward.rounds and not self.placement.owners_only and self._may_replan_in_call(training):
            return self._replan_in_call(forward_SE, []), figures, True
        fit = Fit(self.placement, forward.assignment, forward.chunks, None, True, rounds=forward.rounds)
        return fit, figures, False

    def keep_mode(self, placement: Placement, assignment: PairAssignment, chunk_rows_R: list[int] | None,
                   quota_E: torch.Tensor) -> str:
        """What a compacting backward's expert side keeps (:func:`lrmoe.planning.peaks.keep_mode`),
        or what its ``BackwardConfig.keep`` fixes."""
        if self.backward.keep is not None:
            return self.backward.keep
        network_R = None if self.controller is None else self.controller.network_for(sum(assignment.rows_R()))
        return peak_model.keep_mode(self.peaks, placement, assignment, chunk_rows_R, quota_E, network_R,
                                    self.backward.local, self.backward.recompute_chunk)

    # ---------------------------------------------------------------- checkpoints
    def state(self) -> dict:
        return {"load_E": self.load_E.clone(), "steps": self.steps,
                "slots": [list(s) for s in self.placement.slots], "trace": self.strategy.trace,
                "replica_k": None if self.search is None else self.search.k, "kept_activations": self.kept_activations}

    def load_state(self, state: dict) -> None:
        self.load_E = state["load_E"].clone()
        self.steps = int(state["steps"])
        self.kept_activations = bool(state.get("kept_activations", True))
        self.strategy.load_trace(state.get("trace", []))
        if self.search is not None:
            self.search.k = state.get("replica_k")
        if self.keeps_replicas:
            owner_E = self.base.owner_E
            replicas = [[e for e in s if int(owner_E[e]) != r] for r, s in enumerate(state["slots"])]
            self.placement = self.base.with_replicas(replicas)
