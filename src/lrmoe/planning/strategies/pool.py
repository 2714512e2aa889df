"""SmartMoE-style placement pool: offline, placements planned for the clusters of a routing
trace's loads (k-means); online, the pool entry with the lowest predicted peak for the smoothed
load. Without a given trace the layer records its own first loads first."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.strategies.base import PlacementStrategy, StrategyInputs, predicted_rank_load, trim_replicas

POOL_SIZE = 4  # placements in the offline pool
WARMUP = 20  # without a given trace, this many calls' loads are recorded first


class PlacementPool(PlacementStrategy):
    """Between steps: the pool entry for the smoothed load, trimmed to the slots."""

    replicas_beside_owned = True

    def __init__(self, inputs: StrategyInputs) -> None:
        super().__init__(inputs)
        self._trace: list[torch.Tensor] = []  # without a given trace: its own first loads
        given = inputs.routing_trace
        self._pool = None if given is None else self._build(torch.as_tensor(given))

    def _build(self, trace_NE: torch.Tensor) -> list[Placement]:
        return placement_pool(trace_NE, self.base, self.inputs.default_slots_R, POOL_SIZE)

    def step_placement(self, current: Placement, load_E: torch.Tensor, slots_R: list[int]) -> Placement:
        chosen = current if self._pool is None else self._pool[pick_from_pool(self._pool, load_E)]
        return trim_replicas(chosen, self.base, load_E, slots_R)

    def before_replan(self) -> None:
        if self._pool is None and len(self._trace) >= WARMUP:
            self._pool = self._build(torch.stack(self._trace))

    def observe(self, counts_E: torch.Tensor) -> None:
        if self._pool is None:
            self._trace.append(counts_E.to(torch.float64))

    @property
    def trace(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._trace]

    def load_trace(self, trace: list[torch.Tensor]) -> None:
        self._trace = [t.clone() for t in trace]
        if len(self._trace) >= WARMUP:
            self._pool = self._build(torch.stack(self._trace))


def placement_pool(trace_NE: torch.Tensor, base: Placement, slots_R: list[int], size: int) -> list[Placement]:
    """SmartMoE's offline phase: cluster the trace's load vectors (normalised per step) into
    ``size`` centroids by k-means (farthest-point initialisation from step 0, 20 Lloyd rounds,
    deterministic) and plan one replica placement per centroid."""
    loads = trace_NE.to(torch.float64).numpy()
    if loads.ndim != 2 or loads.shape[1] != base.num_experts or not len(loads):
        raise ValueError(f"routing trace must be (steps, {base.num_experts}) with at least one step, "
                         f"got {tuple(loads.shape)}")
    X = loads / np.maximum(loads.sum(1, keepdims=True), 1e-12)
    k = min(size, len(X))
    centres = [X[0]]
    for _ in range(1, k):
        d = np.min([((X - c) ** 2).sum(1) for c in centres], axis=0)
        centres.append(X[int(np.argmax(d))])
    C = np.stack(centres)
    for _ in range(20):
        label = np.argmin(((X[:, None, :] - C[None]) ** 2).sum(2), axis=1)
        C = np.stack([X[label == j].mean(0) if (label == j).any() else C[j] for j in range(k)])
    return [plan_replicas(base, torch.from_numpy(c), slots_R) for c in C]


def pick_from_pool(pool: list[Placement], load_E: torch.Tensor) -> int:
    """SmartMoE's online phase: the pool entry with the lowest predicted peak for ``load_E``."""
    load = [float(v) for v in load_E.tolist()]
    return min(range(len(pool)), key=lambda i: (max(predicted_rank_load(pool[i], load)), i))
