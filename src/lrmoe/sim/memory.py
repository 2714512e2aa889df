"""Expert-side memory of one rank in one layer call, analytically (docs/design.md "Expert-side memory").

This is the layer's :class:`lrmoe.layer.MemoryMeter` replayed on numbers instead of tensors:
the same holds and drops in the same order, so for the rows a rank receives it gives exactly
``layer.last_stats["peak_expert_side_bytes"]`` (tests/test_simulate.py checks it against the
real layer, world sizes 1 and 2). The simulator then applies it at paper scale, where
building the tensors is impossible.

The sequence, per rank (s = dtype size, R_f forward rows, R_b backward rows, L local copies):

- base: every local copy's parameters and gradient buffer (``2·3·D·F·s`` each), plus, when the
  rank holds replicas, the owned weights' second copy in the concatenated slot weights;
- forward: received rows x (``R_f·D·s``; reordered slot-major through a second buffer when the
  rank has several slots and the world several ranks), then y (``R_f·D·s``) and either the four
  (R_f, F) activations (gate, up, silu, h) or, when the controller chunks the forward, one
  chunk's; ‖h‖² (8 bytes a row) for the selective systems;
- kept to the backward (read from the system's :class:`lrmoe.systems.SystemSpec`): systems that
  save activations (static, symi, capacity) keep x and the activations; those that only save
  rows (static-recompute, masked) keep x; the compacting backward (lrmoe) keeps nothing;
- backward: dy rows (and, when the backward compacts, the re-sent x rows of kept pairs), the four
  recomputed activations unless saved, and the replica-gradient send buffer.

Byte figures come from :class:`lrmoe.meter.ByteModel`, the layer's own byte model.
"""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.meter import H_SQ_BYTES, ByteModel
from lrmoe.systems import SystemSpec, spec_of


@dataclass(frozen=True)
class RankWork:
    """What one rank's expert side handles in one layer call."""

    fwd_rows: int  # rows received for the forward (capacity: the kept ones)
    bwd_rows: int  # rows received for the backward (lrmoe: kept pairs only)
    copies: int  # expert copies held (owned + replicas)
    owned: int  # experts owned
    chunk_rows: int | None = None  # forward computed this many rows at a time; None: all at once
    world: int = 1
    replicas_anywhere: bool = False  # some rank holds a replica: gradients are reduced to owners


def expert_side_peak(system: str | SystemSpec, dim: int, ffn_dim: int, dtype_bytes: int, work: RankWork) -> int:
    """Peak expert-side bytes of one rank over a layer call's forward and backward."""
    spec = spec_of(system)
    bm = ByteModel(dim, ffn_dim, dtype_bytes, spec.selective)
    replicas = work.copies - work.owned
    regroup = work.world > 1 and work.copies > 1
    row, acts_row = bm.row, bm.fwd_compute

    now = bm.slots_held(work.copies, work.owned)
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
    now -= h_sq + Rf * row  # ‖h‖² and y went home
    saved_acts = spec.saves_activations and not chunked
    if not spec.saves_activations and not chunked:
        now -= Rf * acts_row
    if not spec.saves_rows:
        now -= Rf * row

    # backward
    Rb = work.bwd_rows
    receive(Rb)  # dy
    if spec.compacts:
        receive(Rb)  # x of the kept pairs, re-sent by their home ranks
    peak = max(peak, now + (0 if saved_acts else Rb * acts_row))
    if saved_acts:
        now -= Rf * acts_row
    if work.replicas_anywhere:
        now += replicas * bm.slot_params  # replica gradients' send buffer
        peak = max(peak, now)
    return int(peak)


def kept_between_passes(system: str | SystemSpec, dim: int, ffn_dim: int, dtype_bytes: int, fwd_rows: int) -> int:
    """Bytes the expert side keeps from a layer's forward to its backward: held for every MoE
    layer at once when the backward starts (what makes ``static`` run out of memory)."""
    spec = spec_of(system)
    bm = ByteModel(dim, ffn_dim, dtype_bytes, spec.selective)
    if spec.saves_activations:
        return fwd_rows * (bm.row + bm.fwd_compute)
    if spec.saves_rows:
        return fwd_rows * bm.row
    return 0


def home_bytes(tokens: int, dim: int, top_k: int, dtype_bytes: int, selective: bool) -> int:
    """Home-side bytes one layer keeps to its backward (the layer's ``home_bytes``: expert
    outputs y per pair, routing weights, ids, pair order, ‖h‖² when ``selective``) plus its input x."""
    P = tokens * top_k
    return P * dim * dtype_bytes + P * (dtype_bytes + 8 + 8) + (H_SQ_BYTES * P if selective else 0) \
        + tokens * dim * dtype_bytes
