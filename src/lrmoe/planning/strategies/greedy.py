"""FlexMoE-style greedy re-placement between steps: replicate or migrate copies while the
predicted peak falls, adopted only when the gain over a horizon outweighs the move, with the
optimizer state a new copy binds counted (modelled, not moved: docs/systems.md)."""

from __future__ import annotations

import torch

from lrmoe.memory.bytes import expert_param_bytes
from lrmoe.planning.cost import ADAM_STATES, CostModel
from lrmoe.planning.placement import Placement
from lrmoe.planning.strategies.base import PlacementStrategy, predicted_rank_load, trim_replicas

HORIZON = 10  # steps a re-placement is expected to last when weighing its cost


class GreedyMigration(PlacementStrategy):
    """Between steps: :func:`flexmoe_replan` from the current placement trimmed to the slots."""

    replicas_beside_owned = True

    def __init__(self, inputs) -> None:
        super().__init__(inputs)
        self.bound_optimizer_bytes = 0

    def step_placement(self, current: Placement, load_E: torch.Tensor, slots_R: list[int]) -> Placement:
        trimmed = trim_replicas(current, self.base, load_E, slots_R)
        return flexmoe_replan(trimmed, load_E, slots_R, self.inputs.costs, HORIZON)[0]

    def adopted(self, old: Placement, new: Placement) -> None:
        """The optimizer state this rank, as owner, would send along with its experts' new copies."""
        owner_E, rank = self.base.owner_E, self.inputs.rank
        sent = sum(int(owner_E[e]) == rank for now, was in zip(new.slots, old.slots) for e in set(now) - set(was))
        cfg = self.inputs.config
        self.bound_optimizer_bytes += sent * ADAM_STATES * expert_param_bytes(cfg.dim, cfg.ffn_dim,
                                                                              cfg.torch_dtype.itemsize)

    def take_bound_optimizer_bytes(self) -> int | None:
        out, self.bound_optimizer_bytes = self.bound_optimizer_bytes, 0
        return out


def flexmoe_replan(current: Placement, load_E: torch.Tensor, slots_R: list[int], cost: CostModel,
                   horizon: int) -> tuple[Placement, int]:
    """FlexMoE's greedy re-placement: repeatedly relieve the most loaded rank by a replica of its
    heaviest expert on the least-loaded rank not holding it — into a free slot (replicate) or in
    place of that rank's coldest replica (migrate) — while the predicted peak falls. The result
    is adopted only if the peak saved over ``horizon`` steps outweighs moving the new replicas'
    parameters and their bound optimizer state. Returns (placement, expert copies created)."""
    load = [max(float(v), 0.0) for v in load_E.tolist()]
    W = current.world
    replicas = [list(current.replicas(r)) for r in range(W)]
    plan = current
    peak0 = peak = max(predicted_rank_load(plan, load))
    for _ in range(current.num_experts * W):
        rank_load = predicted_rank_load(plan, load)
        hot = max(range(W), key=lambda r: (rank_load[r], -r))
        e = max(plan.slots[hot], key=lambda e: (load[e] / len(plan.holders(e)), -e))
        options = [r for r in range(W) if e not in plan.slots[r]]
        if not options:
            break
        t = min(options, key=lambda r: (rank_load[r], r))
        trial = [list(x) for x in replicas]
        if len(plan.slots[t]) >= slots_R[t]:
            if not trial[t]:
                break
            cold = min(trial[t], key=lambda u: (load[u] / len(plan.holders(u)), u))
            trial[t].remove(cold)
        trial[t].append(e)
        candidate = current.with_replicas(trial)
        new_peak = max(predicted_rank_load(candidate, load))
        if new_peak >= peak:
            break
        plan, replicas, peak = candidate, trial, new_peak
    created = sum(len(set(plan.replicas(r)) - set(current.replicas(r))) for r in range(W))
    gain_s = (peak0 - peak) * cost.row_s * horizon
    move_s = created * cost.expert_bytes * (1 + ADAM_STATES) * cost.byte_s
    if created and gain_s > move_s:
        return plan, created
    return current, 0
