"""A plan's own figures, as the ``last_stats`` keys they fill."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PlanFigures:
    """A plan's own figures for ``last_stats`` (None: not reported by this system or call)."""

    replicas: int | None = None  # replica copies this call (per-call replica planners)
    shadowed_experts: int | None = None  # experts broadcast to every rank this call
    assembled_experts: int | None = None  # expert copies assembled from slices this call
    replanned_in_call: bool | None = None  # the replicas were re-planned because the forward did not fit
    keep_mode: str | None = None  # a compacting training call: what its expert side keeps
    replica_slots: int | None = None  # expert copies this rank holds in the call
    memory_cap_bytes: int | None = None  # this rank's cap (ClusterBudget.memory_bytes)
    predicted_peak_bytes: int | None = None  # this rank's predicted peak (a capped non-controller system)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}
