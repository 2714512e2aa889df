"""One byte model of the expert side, shared by the layer's meter, the controller, the
planners' cost models and the simulator (docs/design.md "Expert-side memory").

With D model dim, F expert hidden dim and s bytes per element:

- an expert copy's parameters (gate, up, down): ``3·D·F·s``; a slot holds them and their
  gradient buffer;
- a row of x, y, dy or dx: ``D·s``; the four (row, F) activations gate, up, silu(gate), h:
  ``4·F·s``; ‖h‖² for the LRM scores: 8 bytes (float64);
- with replicas, replica gradients leave through a send buffer of one copy's parameters per
  replica (the owned and replica weights are two sets the grouped GEMMs read in place).

What the expert side keeps from a call's forward to its backward is decided once, by
:func:`kept_to_backward`, for the layer, the replay and the simulator alike.
:class:`lrmoe.memory.meter.MemoryMeter` follows the tensors the routed path really allocates;
the controller and the simulator use the same figures through :class:`ByteModel`;
:func:`lrmoe.memory.replay.expert_side_peak` replays the meter on numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.config import (  # noqa: F401 (re-exported)
    KEEP_MODES,
    KEEP_NOTHING,
    KEEP_X,
    KEEP_X_ACTS,
    KEEP_X_GATE_UP,
    MoEConfig,
)
from lrmoe.systems import SystemSpec

# What a compacting backward's expert side keeps from forward to backward (docs/design.md "Recompute"):
# KEEP_NOTHING: home re-sends x of kept pairs (an exact call: of every pair, in rounds); recomputed
# KEEP_X: the received x rows: only dy travels, to where the forward computed the pair; recomputed
# KEEP_X_ACTS: x and the activations: static's backward on the kept rows, no recompute
# KEEP_X_GATE_UP: x and the gate/up products (half the activations): silu and h recomputed for
# the kept rows, two elementwise ops, where KEEP_X recomputes the gate/up GEMMs too
H_SQ_BYTES = 8  # ‖h‖² per row, float64, for the LRM scores


def position_bytes(dtype_bytes: int) -> int:
    """A local selection's kept dy row carries its place among the forward's rows: an int32
    (int64 beside 8-byte rows), as extra columns of dy's message (lrmoe.parallel.dispatch)."""
    return 8 if dtype_bytes == 8 else 4


GIB = 1 << 30


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expert_param_bytes(dim: int, ffn_dim: int, dtype_bytes: int) -> int:
    """Parameters of one expert copy: gate and up (F×D each) and down (D×F)."""
    return 3 * dim * ffn_dim * dtype_bytes


@dataclass(frozen=True)
class ByteModel:
    """Expert-side bytes per slot and per row for one layer shape."""

    dim: int
    ffn_dim: int
    dtype_bytes: int
    selective: bool = True  # the forward also computes ‖h‖² per row (selective backwards)

    @staticmethod
    def of(config: MoEConfig, selective: bool = True) -> ByteModel:
        return ByteModel(config.dim, config.ffn_dim, config.torch_dtype.itemsize, selective)

    @property
    def slot_params(self) -> int:
        """Parameters of one expert copy (a replica refresh, a replica's gradient buffer)."""
        return expert_param_bytes(self.dim, self.ffn_dim, self.dtype_bytes)

    @property
    def slot(self) -> int:
        """Parameters and gradient buffer of one expert copy."""
        return 2 * self.slot_params

    @property
    def row(self) -> int:
        """One row of x, y, dy or dx."""
        return self.dim * self.dtype_bytes

    @property
    def fwd_io(self) -> int:
        """x received and y returned per forward row (and ‖h‖² for the selective systems)."""
        return 2 * self.row + (H_SQ_BYTES if self.selective else 0)

    @property
    def fwd_compute(self) -> int:
        """gate, up, silu(gate) and h of one row being computed."""
        return 4 * self.ffn_dim * self.dtype_bytes

    @property
    def bwd_kept(self) -> int:
        """dy, x and the recomputed gate, up, silu, h per kept backward row."""
        return 2 * self.row + self.fwd_compute

    @property
    def bwd_wire(self) -> int:
        """dy and x in, dx out per kept backward row."""
        return 3 * self.row

    def round_forward(self, rows: int) -> int:
        """One forward round of an exchange in rounds (:mod:`lrmoe.parallel.rounds`) bringing
        ``rows`` rows: x as received and sorted by slot, then x sorted, y (with ‖h‖² beside it
        for a selective system) and the four activations (the larger); y's sorted-back copy
        beside y is smaller still."""
        return rows * (2 * self.row + self.fwd_compute + (H_SQ_BYTES if self.selective else 0))

    def round_backward(self, rows: int) -> int:
        """One backward round: x and dy received (one message) and their slot-sorted copies, then
        x, dy and the four recomputed activations (the larger); dx comes back in dy's buffer."""
        return rows * max(4 * self.row, 2 * self.row + self.fwd_compute)

    def slots_held(self, copies: int, owned: int) -> int:
        """A rank's persistent expert memory: its copies' parameters and gradient buffers (the
        owned experts' and the replicas' weights are two sets the GEMMs read in place, never
        concatenated)."""
        return copies * self.slot

    def slots_reserved(self, copies: int, owned: int) -> int:
        """:meth:`slots_held` plus the buffer replica gradients leave through: what a budget
        must set aside for a rank's slots."""
        return self.slots_held(copies, owned) + (copies - owned) * self.slot_params


@dataclass(frozen=True)
class Kept:
    """What the expert side keeps from a call's forward to its backward."""

    rows: bool  # the received x rows
    acts: bool  # the four activations gate, up, silu(gate), h (never from a chunked forward)
    gate_up: bool = False  # gate and up alone (a compacting call's KEEP_X_GATE_UP: its forward
    # computes silu, h and y a chunk at a time beside every row's gate/up)

    @property
    def recomputes(self) -> bool:
        """The backward recomputes the gate/up products (and silu, h) from x."""
        return not (self.acts or self.gate_up)


def spec_keep(spec: SystemSpec) -> str:
    """What a system's expert side keeps from forward to backward when nothing forces less: a
    full backward x and the activations, a recompute (or masked) one x, a compacting one nothing."""
    if spec.saves_activations:
        return KEEP_X_ACTS
    return KEEP_X if spec.saves_rows else KEEP_NOTHING


def in_rounds(spec: SystemSpec, keep: str | None) -> bool:
    """An exact (non-selective) call that keeps nothing to the backward: every exchange of its
    rows runs in rounds, x re-sent with dy (docs/design.md "Recompute")."""
    return keep == KEEP_NOTHING and not spec.selective


def kept_to_backward(spec: SystemSpec, keep: str | None, chunked: bool) -> Kept:
    """The one rule (docs/design.md "Recompute"): a call keeps what its ``keep`` mode says (x and
    the activations; x, gate/up/h recomputed in the backward; or nothing, home re-sending the x
    rows of kept pairs), and with ``keep`` None what its system keeps (:func:`spec_keep`). A
    capped call of an exact system may keep less than its system does (x instead of x and the
    activations); a compacting call's mode comes from its controller. A chunked forward never
    had every row's activations at once, so it keeps none; one keeping gate/up holds every row's
    of them, chunked or not."""
    keep = spec_keep(spec) if keep is None else keep
    return Kept(rows=keep in (KEEP_X, KEEP_X_ACTS, KEEP_X_GATE_UP), acts=keep == KEEP_X_ACTS and not chunked,
                gate_up=keep == KEEP_X_GATE_UP)


GATE_UP = "gate_up"  # a row part keeping x and the gate/up products (RowSplit)


@dataclass(frozen=True)
class RowSplit:
    """What one rank's received rows keep to the backward, row by row, richest first (docs/design.md
    "Keep by the row"): in slot-major order the first ``acts`` rows keep x and the four activations
    (nothing recomputed), the next ``gate_up`` keep x and gate/up (silu and h recomputed, two
    elementwise ops: Megatron-Core's ``moe_act`` recomputation), the rest x alone (gate/up/h
    recomputed in chunks). A capped exact call chooses one per rank (:mod:`lrmoe.planning.peaks`):
    a cold rank keeps everything, a hot one as much as its cap allows."""

    acts: int
    gate_up: int = 0

    def spans(self, rows: int) -> list[tuple[str, int, int]]:
        """(kind, first row, end row) of each non-empty part of ``rows`` received rows, richest first."""
        a, g = min(self.acts, rows), min(self.acts + self.gate_up, rows)
        parts = [(KEEP_X_ACTS, 0, a), (GATE_UP, a, g), (KEEP_X, g, rows)]
        return [(kind, lo, hi) for kind, lo, hi in parts if hi > lo]

    def richer(self, rows: int) -> list[RowSplit]:
        """Each split with one row kept one step richer (x → gate/up, gate/up → activations)."""
        return ([RowSplit(self.acts, self.gate_up + 1)] if self.acts + self.gate_up < rows else []) + (
            [RowSplit(self.acts + 1, self.gate_up - 1)] if self.gate_up > 0 else [])


IN_PLACE_FROM = 0.45  # a keep-x+acts backward compacts in place from this share of its saved rows kept


def in_place(saved_rows: int, kept_rows: int) -> bool:
    """Whether an expert side that kept x and the activations compacts its kept rows in place
    (:mod:`lrmoe.passes.compaction`) rather than gathering them: a moved row costs about twice a
    gathered one (out to a staging buffer and back) and dy and dx are reordered. With the rows
    laid in order of routing weight, about 0.2 of the saved rows move at 0.4 and 0.5 kept
    (configs/suite/paper.toml at 1 GB), so in place is level with the gather at 0.4 and faster
    at 0.5 (docs/results.md, "Compaction in place"). Decided from the plan's row
    counts alone, so the memory model knows it before any row moves: in place, nothing is
    gathered and the saved tensors keep their size until the backward frees them."""
    return 0 < kept_rows < saved_rows and kept_rows >= IN_PLACE_FROM * saved_rows
