"""The figures of one layer call, typed: what ``MoELayer.last_stats`` shows as a dict.

Every key a call reports is a field here, filled by the pass that measures it (a field left
None is not reported: a forward-only call has no backward figures, a system without a node map
no inter-node bytes). :meth:`CallStats.as_dict` gives the ``last_stats`` view, its keys and
their order a public contract (docs/design.md "Definitions").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from lrmoe.planning.figures import PlanFigures


@dataclass
class CallStats:
    figures: PlanFigures | None = None  # the plan's own (replicas, keep_mode, replica_slots, caps, ...)
    # forward
    counts_E: torch.Tensor | None = None  # int64 (E,) global pairs routed to each expert
    recv_rows: int | None = None  # rows this rank's expert side received in the forward
    forward_pairs_computed: int | None = None
    fwd_a2a_bytes: int | None = None  # sent to other ranks in every exchange of the forward
    fwd_a2a_recv_bytes: int | None = None
    fwd_a2a_inter_bytes: int | None = None  # of fwd_a2a_bytes, those to another node (with a node map)
    home_bytes: int | None = None  # home-side tensors sized by this rank's own tokens
    peak_expert_side_bytes: int | None = None  # forward's peak, raised by the backward to the call's
    placement_bytes: int | None = None  # parameter bytes moved for copies since the last training call
    optimizer_bytes: int | None = None  # Adam(W) moments of the owned experts
    fwd_ms: float | None = None
    stage_ms: dict[str, float] | None = None  # ms per stage of the passes run so far (lrmoe.passes.stages)
    bound_optimizer_bytes: int | None = None  # optimizer state bound to new copies (modelled)
    exchange_rounds: int | None = None  # an exact call keeping nothing under a cap: rounds of each exchange
    # backward
    nonfinite: bool | torch.Tensor | None = None  # non-finite scores alone exceeded a quota (a device flag)
    quota_E: torch.Tensor | None = None  # pairs each expert's backward was to keep
    trim_ratio: float | None = None  # the noise objective: the ratio its quotas took this call
    variance_ratio: float | None = None  # ... sampling noise / ‖minibatch gradient‖² of the step before
    minibatch_ratio: float | None = None  # ... sampling noise / the minibatch's own (VCAS's) of the step before
    kept_E: torch.Tensor | None = None  # pairs each expert's backward kept
    bwd_gemm_rows: int | None = None  # rows through this rank's expert backward
    compaction: str | None = None  # a keep-x backward that dropped rows: "in place" or "gathered" (passes.compaction)
    compacted_rows: int | None = None  # ... the saved rows it moved in place, or gathered
    select_ms: float | None = None  # scoring, selection (and exchange), the kept rows' plan; not dy's packing
    bwd_a2a_bytes: int | None = None
    bwd_a2a_recv_bytes: int | None = None
    bwd_a2a_inter_bytes: int | None = None
    bwd_ms: float | None = None
    cuda_max_memory_allocated: int | None = None  # the allocator's view on CUDA, since its last reset

    def as_dict(self) -> dict:
        """The ``last_stats`` view. A local selection's ``nonfinite`` flag stays on the device
        until read here, so the backward itself never waits for it."""
        if isinstance(self.nonfinite, torch.Tensor):
            self.nonfinite = bool(self.nonfinite)
        out = {} if self.figures is None else self.figures.as_dict()
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value
        return out
