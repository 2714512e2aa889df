"""Where a layer call's time goes: the wall time between the passes' stage boundaries, summed per
stage over the call (``CallStats.stage_ms``; per step in ``metrics.jsonl``'s ``moe_stage_ms``).

The forward's stages (:mod:`lrmoe.passes.forward`) and the backward's
(:mod:`lrmoe.passes.backward`); a stage that ends in a collective also holds the wait for the
slowest rank, so a rank with less work shows it in its exchanges, not its compute. An exact call
under a cap that exchanges in rounds has its exchanges inside ``compute``. Host time: on CUDA it
is what the host spent issuing a stage, not the device's time (benchmarks/gpu_layer.py times the
device). ``bwd_noise`` is the noise objective's measurement of the call's scores (for the next
step's ratio), apart from ``bwd_select``'s scoring and draw.
"""

from __future__ import annotations

import time

FORWARD_STAGES = ("plan", "fetch", "dispatch", "compute", "combine", "plan_backward", "save")
BACKWARD_STAGES = ("router", "select", "noise", "dispatch", "compact", "compute", "home", "reduce_grads")
STAGES = tuple(f"fwd_{s}" for s in FORWARD_STAGES) + tuple(f"bwd_{s}" for s in BACKWARD_STAGES)


class StageClock:
    """Milliseconds per stage of one call: :meth:`lap` gives the time since the last boundary to a
    stage (added to what it had: a stage may be entered more than once)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def start(self) -> float:
        """A pass begins: the next lap counts from now. Returns now (perf_counter seconds)."""
        self._t = time.perf_counter()
        return self._t

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.ms[stage] = self.ms.get(stage, 0.0) + (now - self._t) * 1e3
        self._t = now

    def aside(self, stage: str, seconds: float) -> None:
        """``seconds`` spent inside the current stage on ``stage``'s work (host work done during an
        exchange's wait): counted as ``stage``'s, and not as the current stage's."""
        self.ms[stage] = self.ms.get(stage, 0.0) + seconds * 1e3
        self._t += seconds


__all__ = ["BACKWARD_STAGES", "FORWARD_STAGES", "STAGES", "StageClock"]
