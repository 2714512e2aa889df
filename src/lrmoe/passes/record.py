"""The records the routed passes carry: what they use of their layer, and one call's record,
built by the forward and read by the backward. Everything the backward needs rides in the
:class:`CallRecord` (the plan, the forward's row layout, what the expert side kept, which
selection and row path the backward takes); the backward calls nothing in the planner or the
layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lrmoe.config import BackwardConfig
from lrmoe.memory.meter import MemoryMeter
from lrmoe.parallel.comm import Channel, Group, WireCounter
from lrmoe.parallel.replicas import Replicas
from lrmoe.parallel.rounds import Rounds
from lrmoe.parallel.rows import RowLayout
from lrmoe.passes.compaction import InPlace
from lrmoe.passes.stages import StageClock
from lrmoe.passes.stats import CallStats
from lrmoe.planning.call_plan import CallPlan
from lrmoe.planning.planner import LayerPlanner
from lrmoe.selection.streams import SelectionStreams
from lrmoe.systems import SystemSpec

if TYPE_CHECKING:  # the paths are chosen from the plan; only their types are needed here
    from lrmoe.passes.row_paths import RowPath
    from lrmoe.passes.selectors import Selector

class CallLog:
    """A layer's latest calls, as its ``last_stats`` and ``last_kept`` show them: the latest call
    begun or backward finished (a forward-only call between a training call's forward and its
    backward does not hide that backward's figures), and the latest backward."""

    def __init__(self) -> None:
        self.latest: CallRecord | None = None
        self.latest_backward: CallRecord | None = None

    def began(self, call: CallRecord) -> None:
        self.latest = call

    def finished_backward(self, call: CallRecord) -> None:
        self.latest = self.latest_backward = call


@dataclass(frozen=True)
class LayerContext:
    """What the routed passes use of their layer; fixed for the layer's life. The forward's plan
    stage asks the planner; the backward never does."""

    planner: LayerPlanner
    spec: SystemSpec
    replicas: Replicas
    group: Group
    rank: int
    backward: BackwardConfig
    streams: SelectionStreams
    node_of: list[int] | None = None  # rank -> node: inter-node bytes are counted apart

    def channel(self) -> Channel:
        """A fresh channel for one pass: its own byte counter (with the node map, if any)."""
        return Channel(self.group, WireCounter(node_of=self.node_of))


@dataclass
class Saved:
    """What the expert side keeps from a call's forward to its backward."""

    rows_RD: torch.Tensor | None = None  # the received x rows, slot-major
    acts: dict[str, torch.Tensor] | None = None  # gate, up, silu(gate), h of those rows
    slot_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # concatenated or assembled slot weights
    in_place: InPlace | None = None  # the backward compacted its kept rows in place (lrmoe.passes.compaction)

    def clear(self) -> None:
        self.rows_RD = self.acts = self.slot_weights = self.in_place = None


@dataclass
class CallRecord:
    """One layer call, carried from its forward to its backward."""

    layer: LayerContext
    ids_TK: torch.Tensor
    training: bool  # a grad-enabled call: it updates the load and may be followed by a backward
    pending_placement_bytes: int = 0  # parameter bytes moved since the last training call
    stats: CallStats = field(default_factory=CallStats)
    plan: CallPlan | None = None
    rows: RowLayout | None = None  # the forward's row layout
    forward_keep_P: torch.Tensor | None = None  # pairs a forward drop kept (None: all)
    meter: MemoryMeter | None = None
    saved: Saved = field(default_factory=Saved)
    selector: Selector | None = None  # the backward's selection, chosen from the plan
    path: RowPath | None = None  # the backward's row path, chosen from the plan
    kept_TK: torch.Tensor | None = None  # after the backward: the pairs it kept
    scale_TK: torch.Tensor | None = None  # and the weights of their contributions (sampled)
    log: CallLog | None = None  # where the layer reads its latest call's figures
    rounds: Rounds | None = None  # an exchange in rounds: the forward's, which the backward repeats
    clock: StageClock = field(default_factory=StageClock)  # where the call's time went, stage by stage
    overlap_grads: bool = False  # replica gradients finished at the backward pass's end (MoELayer's opt-in)
