"""Placement strategies: one small class per planner a :class:`~lrmoe.systems.SystemSpec` names,
chosen here and nowhere else (:func:`strategy_for`). ``docs/systems.md`` says what of each
published mechanism is reproduced and what is not.

    base.py        the interface, its inputs, and the default: every expert on its owner
    load.py        replicas ∝ load, min-peak: between steps (SYMI, lrmoe) or per call (UltraEP)
    node_aware.py  the same with the rank → node map, pairs kept inside their node (TopoEP)
    greedy.py      greedy replicate/migrate when the gain beats the cost (FlexMoE)
    pool.py        an offline pool of placements from a routing trace, one picked online (SmartMoE)
    shadow.py      hot experts broadcast by a cost model, computed where their pairs are (FasterMoE)
    assembled.py   experts sharded over all ranks, assembled where a call's load places them (LAER-MoE)
    least_loaded.py  overflow over a per-rank row cap spilled, with its weights, to the least-loaded ranks (LLEP)
"""

from __future__ import annotations

from lrmoe.planning.cost import CostModel
from lrmoe.planning.strategies.assembled import AssembledLayout, laer_layout
from lrmoe.planning.strategies.base import PlacementStrategy, StrategyInputs, predicted_rank_load, trim_replicas
from lrmoe.planning.strategies.greedy import GreedyMigration, flexmoe_replan
from lrmoe.planning.strategies.least_loaded import LeastLoaded, least_loaded_rows
from lrmoe.planning.strategies.load import LoadReplicas
from lrmoe.planning.strategies.node_aware import NodeAwareReplicas, localize
from lrmoe.planning.strategies.pool import PlacementPool, pick_from_pool, placement_pool
from lrmoe.planning.strategies.shadow import Shadowing, local_assignment, shadow_experts
from lrmoe.systems import Planner

_BY_PLANNER: dict[Planner, type[PlacementStrategy]] = {
    Planner.NONE: PlacementStrategy,
    Planner.CONTROLLER: LoadReplicas,  # the controller's search chooses how many; load places them
    Planner.LOAD: LoadReplicas,
    Planner.NODE_AWARE: NodeAwareReplicas,
    Planner.FLEXMOE: GreedyMigration,
    Planner.SMARTMOE: PlacementPool,
    Planner.SHADOW: Shadowing,
    Planner.LAER: AssembledLayout,
    Planner.LEAST_LOADED: LeastLoaded,
}


def strategy_for(planner: Planner, inputs: StrategyInputs) -> PlacementStrategy:
    """The strategy of a spec's planner."""
    return _BY_PLANNER[planner](inputs)


__all__ = ["AssembledLayout", "CostModel", "GreedyMigration", "LeastLoaded", "LoadReplicas", "NodeAwareReplicas",
           "PlacementPool", "PlacementStrategy", "Shadowing", "StrategyInputs", "flexmoe_replan", "laer_layout",
           "least_loaded_rows", "local_assignment", "localize", "pick_from_pool", "placement_pool",
           "predicted_rank_load", "shadow_experts", "strategy_for", "trim_replicas"]
