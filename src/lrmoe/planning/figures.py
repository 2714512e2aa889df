"""A plan's own figures, as the ``last_stats`` keys they fill."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lrmoe.planning.peaks import Fit


@dataclass(frozen=True)
class PlanFigures:
    """A plan's own figures for ``last_stats`` (None: not reported by this system or call)."""

    replicas: int | None = None  # replica copies this call (per-call replica planners)
    shadowed_experts: int | None = None  # experts broadcast to every rank this call
    assembled_experts: int | None = None  # expert copies assembled from slices this call
    replanned_in_call: bool | None = None  # the replicas were re-planned because the forward did not fit
    keep_mode: str | None = None  # a training call: what its expert side keeps to the backward
    replica_slots: int | None = None  # expert copies this rank holds in the call
    memory_cap_bytes: int | None = None  # this rank's cap (ClusterBudget.memory_bytes)
    predicted_peak_bytes: int | None = None  # this rank's predicted peak (a capped non-controller system)
    fwd_chunk_rows: int | None = None  # a capped call: rows this rank's forward computes at once
    bwd_chunk_rows: int | None = None  # a capped call: rows this rank's backward recomputes at once
    kept_acts_rows: int | None = None  # a call keeping by the row: this rank's rows keeping x and activations
    kept_gate_up_rows: int | None = None  # ... keeping x and gate/up (the rest keep x alone)
    memory_trimmed: bool | None = None  # the noise objective: memory or the network kept fewer pairs than its ratio

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def cap_figures(fit: Fit, memory_R: list[int] | None, rank: int, exact_backward: bool) -> dict:
    """A capped call's :class:`PlanFigures` fields: this rank's cap, predicted peak and the rows
    its forward and (``exact_backward``: an exact training call's) backward compute at once, all
    its rows where not chunked; none without a cap. A compacting backward's rows are its kept ones."""
    if memory_R is None:
        return {}
    rows = int(fit.assignment.rows_R()[rank]) if fit.chunk_rows_R is None or fit.bwd_chunk_rows_R is None else 0
    bwd = rows if fit.bwd_chunk_rows_R is None else fit.bwd_chunk_rows_R[rank]
    return {"memory_cap_bytes": memory_R[rank],
            "predicted_peak_bytes": None if fit.peak_R is None else fit.peak_R[rank],
            "fwd_chunk_rows": rows if fit.chunk_rows_R is None else fit.chunk_rows_R[rank],
            "bwd_chunk_rows": bwd if exact_backward else None,
            "kept_acts_rows": None if fit.split_R is None else fit.split_R[rank].acts,
            "kept_gate_up_rows": None if fit.split_R is None else fit.split_R[rank].gate_up}
