"""The records the routed passes carry: what they use of their layer, and one call's record,
built by the forward and read by the backward. Everything the backward needs rides in the
:class:`CallRecord` (the plan, the forward's row layout, what the expert side kept, which
selection and row path the backward takes); the backward calls nothing in the planner or the
layer. The record names its selection and row path by their interfaces (:class:`Selector`,
:class:`RowPath`), defined here because their methods take the record; their kinds are
:mod:`lrmoe.passes.selectors`' and :mod:`lrmoe.passes.row_paths`'."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lrmoe import experts
from lrmoe.config import BackwardConfig
from lrmoe.memory.meter import MemoryMeter
from lrmoe.parallel.comm import Channel, Group, WireCounter
from lrmoe.parallel.replicas import Replicas
from lrmoe.parallel.rounds import Rounds
from lrmoe.parallel.rows import RowLayout
from lrmoe.passes.backward_rows import BackwardRows, DyRows, Kept
from lrmoe.passes.saved import Saved
from lrmoe.passes.stages import StageClock
from lrmoe.passes.stats import CallStats
from lrmoe.planning.call_plan import CallPlan
from lrmoe.planning.planner import LayerPlanner
from lrmoe.selection.streams import SelectionStreams
from lrmoe.systems import SystemSpec


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

    def stats(self) -> dict:
        """The latest call's figures (:class:`~lrmoe.passes.stats.CallStats` as a dict; {} before any)."""
        return {} if self.latest is None else self.latest.stats.as_dict()

    def kept_TK(self) -> torch.Tensor | None:
        """(T, K) bool: the pairs the latest backward kept."""
        return None if self.latest_backward is None else self.latest_backward.kept_TK


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

    def meanwhile(self, channel: Channel, stage: str, work: Callable[[], None]) -> None:
        """``work`` done in ``channel``'s next exchange's wait (:attr:`Channel.meanwhile`), or
        when the pass flushes it; its time counted as ``stage``'s, not the exchange's."""
        def timed() -> None:
            t0 = time.perf_counter()
            work()
            self.clock.aside(stage, time.perf_counter() - t0)

        channel.meanwhile.append(timed)


class Selector:
    """How a backward chooses its kept pairs (the kinds: :mod:`lrmoe.passes.selectors`)."""

    def select(self, call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor | None,
               channel: Channel) -> Kept:
        raise NotImplementedError


class RowPath:
    """How a backward moves its rows (the kinds: :mod:`lrmoe.passes.row_paths`): where they go,
    dy's factor, the exchange to the expert side, the expert backward and dx's way home."""

    def rows(self, call: CallRecord, kept: Kept, channel: Channel) -> BackwardRows:
        raise NotImplementedError

    def factor(self, factor_P: torch.Tensor, kept: Kept) -> torch.Tensor:
        raise NotImplementedError

    def dispatch(self, call: CallRecord, dy: DyRows, x_TD: torch.Tensor, rows: BackwardRows,
                 channel: Channel) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def compute(self, call: CallRecord, dy_RD: torch.Tensor, rows_RD: torch.Tensor, rows: BackwardRows,
                gate_up: torch.Tensor, down: torch.Tensor, channel: Channel
                ) -> tuple[torch.Tensor, experts.Slots, experts.Slots]:
        raise NotImplementedError

    def home(self, call: CallRecord, dx_RD: torch.Tensor, rows: BackwardRows, channel: Channel
             ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError
