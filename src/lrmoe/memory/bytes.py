"""One byte model of the expert side, shared by the layer's meter, the controller, the
planners' cost models and the simulator (docs/design.md "Expert-side memory").

With D model dim, F expert hidden dim and s bytes per element:

- an expert copy's parameters (gate, up, down): ``3·D·F·s``; a slot holds them and their
  gradient buffer;
- a row of x, y, dy or dx: ``D·s``; the four (row, F) activations gate, up, silu(gate), h:
  ``4·F·s``; ‖h‖² for the LRM scores: 8 bytes (float64);
- with replicas, the owned weights are copied once more into the concatenated slot weights,
  and replica gradients leave through a send buffer of one copy's parameters per replica.

:class:`MemoryMeter` follows the tensors the routed path really allocates; the controller and
the simulator use the same figures through :class:`ByteModel`. :func:`expert_side_peak` replays
the meter on numbers (:class:`RankWork`): the planner predicts every rank's peak from a call's
plan with it before any row moves (a memory cap), and the simulator applies it at paper scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.config import MoEConfig
from lrmoe.systems import SystemSpec, spec_of

# What a compacting backward's expert side keeps from forward to backward (docs/design.md "Recompute"):
KEEP_NOTHING = "nothing"  # home re-sends x of kept pairs; gate, up, silu, h recomputed
KEEP_X = "x"  # the received x rows: only dy travels, to where the forward computed the pair; recomputed
KEEP_X_ACTS = "x+acts"  # x and the activations: static's backward on the kept rows, no recompute
KEEP_MODES = (KEEP_X_ACTS, KEEP_X, KEEP_NOTHING)  # richest first
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

    def slots_held(self, copies: int, owned: int) -> int:
        """A rank's persistent expert memory: its copies' parameters and gradient buffers, plus
        the owned weights' second copy inside the concatenated slot weights when it holds
        replicas."""
        return copies * self.slot + (owned * self.slot_params if copies > owned else 0)

    def slots_reserved(self, copies: int, owned: int) -> int:
        """:meth:`slots_held` plus the buffer replica gradients leave through: what a budget
        must set aside for a rank's slots."""
        return self.slots_held(copies, owned) + (copies - owned) * self.slot_params


class MemoryMeter:
    """Bytes a rank holds for the experts during one layer call, and their peak.

    Follows the lifetimes of the tensors the routed path allocates: parameters and gradient
    buffers, received rows, intermediates, send/receive buffers of the backward.
    """

    def __init__(self, base: int) -> None:
        self.now = self.peak = base

    def hold(self, *tensors: torch.Tensor | None) -> None:
        self.now += nbytes(*tensors)
        self.peak = max(self.peak, self.now)

    def drop(self, *tensors: torch.Tensor | None) -> None:
        self.now -= nbytes(*tensors)

    def reach(self, extra: int) -> None:
        """A transient of ``extra`` bytes on top of what is held (freed at once)."""
        self.peak = max(self.peak, self.now + extra)


# ------------------------------------------------------------------------------ analytic replay
@dataclass(frozen=True)
class RankWork:
    """What one rank's expert side handles in one layer call."""

    fwd_rows: int  # rows received for the forward (capacity: the kept ones)
    bwd_rows: int  # rows received for the backward (lrmoe: kept pairs only)
    copies: int  # expert copies held (owned + replicas; laer: experts assembled here)
    owned: int  # experts owned (laer: 0, it owns slices)
    chunk_rows: int | None = None  # forward computed this many rows at a time; None: all at once
    world: int = 1
    replicas_anywhere: bool = False  # some rank holds a replica: gradients are reduced to owners (laer: always)
    sliced: int = 0  # laer: experts of which this rank holds a 1/world slice (and its gradient)
    backward: bool = True  # False: a forward-only call (nothing kept, no backward)
    keep: str = KEEP_NOTHING  # a compacting backward's keep mode (KEEP_MODES); other systems: their spec's


def expert_side_peak(system: str | SystemSpec, dim: int, ffn_dim: int, dtype_bytes: int, work: RankWork) -> int:
    """Peak expert-side bytes of one rank over a layer call's forward and backward: the layer's
    :class:`MemoryMeter` replayed on numbers, the same holds and drops in the same order, so it
    equals ``last_stats["peak_expert_side_bytes"]`` for the rows a rank receives
    (tests/test_simulate.py, tests/test_memory_cap.py check it against the real layer).

    The sequence (s = dtype size, R_f forward rows, R_b backward rows, L local copies):

    - base: every local copy's parameters and gradient buffer (``2·3·D·F·s`` each), plus, when
      the rank holds replicas, the owned weights' second copy in the concatenated slot weights
      (laer: its slices of every expert and their gradients, plus the assembled copies);
    - forward: received rows x (``R_f·D·s``; reordered slot-major through a second buffer when
      the rank has several slots and the world several ranks), then y (``R_f·D·s``) and either
      the four (R_f, F) activations (gate, up, silu, h) or, when the forward is chunked, one
      chunk's; ‖h‖² (8 bytes a row) for the selective systems;
    - kept to the backward (the system's :class:`~lrmoe.systems.SystemSpec`): systems that save
      activations keep x and the activations (unless the forward was chunked); those that only
      save rows keep x; the compacting backward (lrmoe) keeps what ``work.keep`` says: nothing,
      x, or x and the activations (unless the forward was chunked);
    - backward: dy rows (and, when the backward compacts and kept nothing, the re-sent x rows
      of kept pairs); a compacting backward that kept x then gathers the kept rows (x, then
      each saved activation) out of the forward's, dropping each full tensor after its gather
      (nothing to gather when every row is kept) — after dy, because a local selection's dy
      message is what says which rows are kept; then the four recomputed activations unless
      saved, and the replica-gradient send buffer. The kept rows' positions (4 bytes a row in
      dy's message) or the global selections' one byte per forward row are bookkeeping, like
      the row plans' indices, and not counted.
    """
    spec = spec_of(system)
    bm = ByteModel(dim, ffn_dim, dtype_bytes, spec.selective)
    replicas = work.copies - work.owned
    regroup = work.world > 1 and work.copies > 1
    row, acts_row = bm.row, bm.fwd_compute

    now = bm.slots_held(work.copies, work.owned) + 2 * work.sliced * 3 * dim * (ffn_dim // work.world) * dtype_bytes
    peak = now

    def receive(rows: int) -> None:
        nonlocal now, peak
        now += rows * row
        peak = max(peak, now + (rows * row if regroup else 0))

    # forward
    Rf = work.fwd_rows
    receive(Rf)
    h_sq = H_SQ_BYTES * Rf if spec.selective else 0
    chunked = work.chunk_rows is not None and work.chunk_rows < Rf
    if chunked:
        now += Rf * row + h_sq
        peak = max(peak, now, now + work.chunk_rows * acts_row)
    else:
        now += Rf * row + Rf * acts_row
        peak = max(peak, now)
        now += h_sq
        peak = max(peak, now)
    if not work.backward:
        return int(peak)
    now -= h_sq + Rf * row  # ‖h‖² and y went home
    keep = work.keep if spec.compacts else None
    keeps_x = keep in (KEEP_X, KEEP_X_ACTS)
    saved_acts = (spec.saves_activations or keep == KEEP_X_ACTS) and not chunked
    if not saved_acts and not chunked:
        now -= Rf * acts_row
    if not (spec.saves_rows or keeps_x):
        now -= Rf * row

    # backward
    Rb = work.bwd_rows
    acts_rows = Rf
    receive(Rb)  # dy
    if spec.compacts and not keeps_x:
        receive(Rb)  # x of the kept pairs, re-sent by their home ranks
    if keeps_x and Rb < Rf:  # the kept rows gathered out of the saved ones
        acts_rows = Rb
        for size in [row] + ([acts_row // 4] * 4 if saved_acts else []):
            peak = max(peak, now + Rb * size)
            now += (Rb - Rf) * size
    peak = max(peak, now + (0 if saved_acts else Rb * acts_row))
    if saved_acts:
        now -= acts_rows * acts_row
    if work.replicas_anywhere:
        now += replicas * bm.slot_params  # replica gradients' send buffer (laer: every assembled copy's)
        peak = max(peak, now)
    return int(peak)
