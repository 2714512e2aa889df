"""The layer's meter replayed on numbers: a rank's expert-side peak over one call, predicted from
the rows its plan gives it before any row moves (a memory cap's fitting, the controller's keep
mode, the simulator at paper scale)."""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.memory.bytes import (
    GATE_UP,
    H_SQ_BYTES,
    KEEP_X,
    KEEP_X_ACTS,
    ByteModel,
    RowSplit,
    in_place,
    in_rounds,
    kept_to_backward,
)
from lrmoe.systems import SystemSpec, spec_of


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
    keep: str | None = None  # what the expert side keeps (KEEP_MODES); None: what the system keeps
    bwd_chunk_rows: int | None = None  # a recomputing backward works this many rows at a time; None: all at once
    split: RowSplit | None = None  # a capped exact training call keeping by the row (keep: x)


class _Replay:
    """Bytes held and their peak, as :class:`~lrmoe.memory.meter.MemoryMeter` counts them."""

    def __init__(self, base: int) -> None:
        self.now = self.peak = base

    def hold(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)

    def reach(self, extra: int) -> None:
        self.peak = max(self.peak, self.now + extra)

    def receive(self, rows: int, row: int, regroup: bool) -> None:
        """Rows received, reordered slot-major through a second buffer when ``regroup``."""
        self.now += rows * row
        self.peak = max(self.peak, self.now + (rows * row if regroup else 0))


def expert_side_peak(system: str | SystemSpec, dim: int, ffn_dim: int, dtype_bytes: int, work: RankWork) -> int:
    """Peak expert-side bytes of one rank over a layer call's forward and backward: the layer's
    :class:`~lrmoe.memory.meter.MemoryMeter` replayed on numbers, the same holds and drops in
    the same order, so it equals ``last_stats["peak_expert_side_bytes"]`` for the rows a rank
    receives (the memory-cap and simulator tests check it against the real layer).

    The sequence (s = dtype size, R_f forward rows, R_b backward rows, L local copies):

    - base: every local copy's parameters and gradient buffer (``2·3·D·F·s`` each; laer: its
      slices of every expert and their gradients, plus the assembled copies);
    - forward (:func:`_forward`): received rows x (``R_f·D·s``; reordered slot-major through a
      second buffer when the rank has several slots and the world several ranks), then y
      (``R_f·D·s``) and either the four (R_f, F) activations (gate, up, silu, h) or, when the
      forward is chunked, one chunk's, or (keeping gate/up) every row's gate and up and one
      chunk's silu and h; ‖h‖² (8 bytes a row) for the selective systems; then what
      :func:`~lrmoe.memory.bytes.kept_to_backward` does not keep is freed;
    - backward (:func:`_backward`): dy rows (and, when the backward compacts and kept nothing,
      the re-sent x rows of kept pairs); a compacting backward that kept x then gathers the kept
      rows (x, then each saved activation) out of the forward's, dropping each full tensor after
      its gather (nothing to gather when every row is kept) — after dy, because a local
      selection's dy message is what says which rows are kept; then the four recomputed
      activations unless saved (silu and h alone beside kept gate/up), and the replica-gradient
      send buffer. A call that kept the activations and keeps most rows compacts them in place
      instead (:func:`~lrmoe.memory.bytes.in_place`): no gather, the saved tensors keep their
      size. One that kept gate/up always gathers, so that silu and h are recomputed for the kept
      rows alone.
      A chunked backward (one that recomputes) holds one chunk's activations at a time; an exact
      one reads dy in its received order, so dy has no regrouped copy, and gathers a chunk's dy
      rows (a compacting one's dy arrives slot-major, as unchunked). The kept rows' positions
      (4 bytes a row in dy's message) or the global selections' one byte per forward row are
      bookkeeping, like the row plans' indices, and not counted.
    - a call keeping by the row (:class:`~lrmoe.memory.bytes.RowSplit`, :func:`_by_the_row`).
    - an exact call that keeps nothing (:func:`~lrmoe.memory.bytes.in_rounds`) moves its rows in
      rounds (:mod:`lrmoe.parallel.rounds`): its largest forward round, then its largest
      backward round, on top of the slots (:meth:`~lrmoe.memory.bytes.ByteModel.round_forward`).
    """
    spec = spec_of(system)
    bm = ByteModel(dim, ffn_dim, dtype_bytes, spec.selective)
    slices = 2 * work.sliced * 3 * dim * (ffn_dim // work.world) * dtype_bytes
    replay = _Replay(bm.slots_held(work.copies, work.owned) + slices)
    if in_rounds(spec, work.keep):
        _in_rounds(replay, bm, work)
        return int(replay.peak)
    if work.split is not None:
        _by_the_row(replay, spec, bm, work)
        return int(replay.peak)
    chunked = work.chunk_rows is not None and work.chunk_rows < work.fwd_rows
    _forward(replay, spec, bm, work, chunked)
    if work.backward:
        _backward(replay, spec, bm, work, chunked)
    return int(replay.peak)


def _forward(replay: _Replay, spec: SystemSpec, bm: ByteModel, work: RankWork, chunked: bool) -> None:
    """x received; y and the activations (or one chunk's) computed; ‖h‖²; what is not kept freed."""
    Rf, row, acts_row = work.fwd_rows, bm.row, bm.fwd_compute
    replay.receive(Rf, row, work.world > 1 and work.copies > 1)
    h_sq = H_SQ_BYTES * Rf if spec.selective else 0
    kept = kept_to_backward(spec, work.keep, chunked)
    if kept.gate_up:  # every row's gate/up held, silu, h and y a chunk at a time beside them
        replay.hold(Rf * row + h_sq)
        replay.hold(Rf * acts_row // 2)
        replay.reach(min(work.chunk_rows or Rf, Rf) * acts_row // 2)
    elif chunked:
        replay.now += Rf * row + h_sq
        replay.reach(work.chunk_rows * acts_row)
    else:
        replay.hold(Rf * row + Rf * acts_row)
        replay.hold(h_sq)
    if not work.backward:
        return
    replay.now -= h_sq + Rf * row  # ‖h‖² and y went home
    if not kept.acts and not kept.gate_up and not chunked:
        replay.now -= Rf * acts_row
    if not kept.rows:
        replay.now -= Rf * row


def _backward(replay: _Replay, spec: SystemSpec, bm: ByteModel, work: RankWork, chunked: bool) -> None:
    """dy (and re-sent x) received, kept rows gathered, activations recomputed, replica gradients sent."""
    Rf, Rb, row, acts_row = work.fwd_rows, work.bwd_rows, bm.row, bm.fwd_compute
    kept = kept_to_backward(spec, work.keep, chunked)
    regroup = work.world > 1 and work.copies > 1
    acts_rows = Rf
    chunked_bwd = work.bwd_chunk_rows is not None and work.bwd_chunk_rows < Rb
    dy_in_order = chunked_bwd and not spec.compacts  # an exact chunked backward reads dy as received
    compact_in_place = spec.compacts and kept.acts and in_place(Rf, Rb)
    reorder = regroup or (compact_in_place and work.world > 1)  # dy through a second buffer (world 1: packed so)
    replay.receive(Rb, row, reorder and not dy_in_order)  # dy
    if spec.compacts and not kept.rows:
        replay.receive(Rb, row, regroup)  # x of the kept pairs, re-sent by their home ranks
    if spec.compacts and kept.rows and Rb < Rf and not compact_in_place:
        # the kept rows gathered out of the saved ones (compacted in place: nothing new held)
        acts_rows = Rb
        for size in [row] + [acts_row // 4] * (4 if kept.acts else 2 if kept.gate_up else 0):
            replay.reach(Rb * size)
            replay.now += (Rb - Rf) * size
    if chunked_bwd:  # one chunk's activations, and (read as received) its dy rows gathered
        replay.reach(work.bwd_chunk_rows * (acts_row + (row if regroup and dy_in_order else 0)))
    elif kept.gate_up:  # silu and h recomputed beside the kept rows' gate/up
        replay.reach(acts_rows * acts_row // 2)
    else:
        replay.reach(0 if kept.acts else Rb * acts_row)
    if kept.acts or kept.gate_up:
        replay.now -= acts_rows * acts_row // (1 if kept.acts else 2)
    if work.replicas_anywhere:
        replay.hold((work.copies - work.owned) * bm.slot_params)  # replica gradients' send buffer (laer: every copy's)


def _by_the_row(replay: _Replay, spec: SystemSpec, bm: ByteModel, work: RankWork) -> None:
    """A training call keeping by the row (:mod:`lrmoe.passes.by_row`): x received, y and ‖h‖²
    held; the activations' rows computed at once and held, the gate/up rows' products held with
    silu and h a forward chunk at a time, the x-only rows a chunk at a time; y and ‖h‖² home.
    The backward reads dy in its received order (no slot-major copy), each part a backward chunk
    at a time (a chunk's dy rows gathered where the world regroups them; silu and h recomputed
    for the gate/up rows, all four for the x-only rows), then frees what the forward kept."""
    R, row, act = work.fwd_rows, bm.row, bm.ffn_dim * bm.dtype_bytes  # act: one (row, F) activation
    regroup = work.world > 1 and work.copies > 1
    rows = {kind: hi - lo for kind, lo, hi in work.split.spans(R)}
    a, g, rest = rows.get(KEEP_X_ACTS, 0), rows.get(GATE_UP, 0), rows.get(KEEP_X, 0)
    kept = a * 4 * act + g * 2 * act
    replay.receive(R, row, regroup)
    h_sq = H_SQ_BYTES * R if spec.selective else 0
    replay.hold(R * row + h_sq)
    replay.hold(kept)
    chunk = work.chunk_rows or R
    replay.reach(max(min(chunk, g) * 2 * act, min(chunk, rest) * 4 * act))
    replay.now -= R * row + h_sq  # y and ‖h‖² went home
    replay.now += R * row  # dy
    chunk, gather = work.bwd_chunk_rows or R, row if regroup else 0
    replay.reach(max(min(chunk, n) * (per_row + gather) for n, per_row in ((a, 0), (g, 2 * act), (rest, 4 * act))))
    replay.now -= kept
    if work.replicas_anywhere:
        replay.hold((work.copies - work.owned) * bm.slot_params)


def _largest_round(rows: int, chunk: int | None) -> int:
    return rows if chunk is None else min(rows, chunk)


def _in_rounds(replay: _Replay, bm: ByteModel, work: RankWork) -> None:
    """An exact call keeping nothing, every exchange in rounds of at most ``chunk_rows`` (forward)
    and ``bwd_chunk_rows`` (backward) rows: the largest round of each pass on top of the slots,
    then the replica-gradient send buffer."""
    replay.reach(bm.round_forward(_largest_round(work.fwd_rows, work.chunk_rows)))
    if not work.backward:
        return
    replay.reach(bm.round_backward(_largest_round(work.bwd_rows, work.bwd_chunk_rows)))
    if work.replicas_anywhere:
        replay.hold((work.copies - work.owned) * bm.slot_params)
