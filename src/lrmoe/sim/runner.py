"""A projection's runs: each system's planners simulated step by step (:class:`Run`), and what
the fair rules' searches (:mod:`lrmoe.sim.search`) run systems and measure steps through
(:class:`Runner`). Below both the searches and the projection (:mod:`lrmoe.sim.run`), which
drives them, so that data flows one way: runner → search → run."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from lrmoe.sim.budget import step_peak_bytes
from lrmoe.sim.config import DTYPE_BYTES, SimConfig
from lrmoe.sim.host import PlanningReference
from lrmoe.sim.layer_calls import LayerCall, SystemPlanner


@dataclass
class Run:
    """One system's planners (one per representative layer) and the calls simulated so far."""

    planners: list[SystemPlanner]
    calls: list[list[LayerCall]] = field(default_factory=list)

    def advance(self, counts: np.ndarray, steps: int, bar: tqdm) -> Run:
        """Simulate up to ``steps`` steps in all (continuing where the run stands)."""
        for t in range(len(self.calls), min(steps, counts.shape[0])):
            self.calls.append([p.call(counts[t, li], DTYPE_BYTES) for li, p in enumerate(self.planners)])
            bar.update(1)
        return self


class Runner:
    """One model's routing counts and the systems run on them: a run of any system and planner
    keywords, and a step's whole memory (the projection, :class:`lrmoe.sim.run.Projection`, adds
    the searches on top)."""

    def __init__(self, cfg: SimConfig, counts: np.ndarray, layers: list[int], reference: PlanningReference,
                 bar: tqdm) -> None:
        self.cfg, self.counts, self.layers, self.reference, self.bar = cfg, counts, layers, reference, bar
        self.config = cfg.spec.moe_config()

    def run(self, system: str, steps: int | None = None, **kw) -> Run:
        planners = [SystemPlanner(system, self.config, self.cfg.gpus, reference=self.reference, **kw)
                    for _ in self.layers]
        return Run(planners).advance(self.counts, steps or self.counts.shape[0], self.bar)

    def step_bytes(self, calls: list[list[LayerCall]]) -> int:
        return step_peak_bytes(self.cfg.spec, calls, DTYPE_BYTES, self.cfg.optimizer_bytes_per_param)
