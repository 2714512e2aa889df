"""Every rank's expert-side peak predicted from a call's plan before any row moves: the layer's
meter replayed on numbers (:func:`lrmoe.memory.replay.expert_side_peak`), so what is predicted
here is what the layer then measures. Cap fitting searches plans with it; the controller's
compacting backward chooses what its expert side keeps with it (:func:`keep_mode`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from lrmoe.config import MoEConfig
from lrmoe.memory.bytes import (
    KEEP_MODES,
    KEEP_NOTHING,
    KEEP_X_ACTS,
    KEEP_X_GATE_UP,
    ByteModel,
    RowSplit,
    in_rounds,
    kept_to_backward,
    position_bytes,
)
from lrmoe.memory.replay import RankWork, expert_side_peak
from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.chunks import gate_up_least_chunks, largest_fitting
from lrmoe.planning.placement import Placement
from lrmoe.planning.row_split import fit_by_row
from lrmoe.systems import PlacementKind, SystemSpec


@dataclass(frozen=True)
class Fit:
    """One candidate plan of a call under a memory cap, with every rank's predicted peak."""

    placement: Placement
    assignment: PairAssignment
    chunk_rows_R: list[int] | None  # forward rows each rank computes at once (None: all)
    peak_R: list[int] | None
    ok: bool  # every rank within its cap
    bwd_chunk_rows_R: list[int] | None = None  # backward rows each rank recomputes at once (None: all)
    keep: str | None = None  # what the expert side keeps (None: what the system keeps)
    split_R: list[RowSplit] | None = None  # a training call keeping by the row: each rank's parts
    rounds: bool = False  # lrmoe's forward moves its rows in rounds (its controller's last resort)


@dataclass(frozen=True)
class RankPeaks:
    """Predicted peaks of one layer's ranks under their caps ``memory_R``, keeping ``keep`` from
    forward to backward (None: what the system keeps; an exact system may keep x alone instead
    of x and the activations, recomputing them in the backward). ``by_row``: a training call
    keeps by the row, each rank as much as its cap allows (:mod:`lrmoe.planning.row_split`)."""

    spec: SystemSpec
    config: MoEConfig
    world: int
    memory_R: list[int]
    keep: str | None = None
    by_row: bool = False

    @property
    def bytes(self) -> ByteModel:
        return ByteModel.of(self.config, self.spec.selective)

    @property
    def chunks(self) -> bool:
        """The forward may be chunked: the call keeps no activations to the backward."""
        return not kept_to_backward(self.spec, self.keep, chunked=False).acts

    @property
    def rounds(self) -> bool:
        """Every exchange of the call runs in rounds (an exact call keeping nothing)."""
        return in_rounds(self.spec, self.keep)

    @property
    def backward_chunks(self) -> bool:
        """The backward may recompute in chunks: an exact backward that recomputes its activations
        (a compacting one's rows are its selection's, planned by its controller)."""
        return self.chunks and not self.spec.compacts

    def work(self, placement: Placement, r: int, rows: int, training: bool, chunk: int | None = None,
             bwd_chunk: int | None = None, split: RowSplit | None = None) -> RankWork:
        """What rank r's expert side handles computing ``rows`` rows under ``placement`` (the
        backward of these systems carries the forward's rows; by the row: x alone unless ``split``)."""
        sharded = self.spec.placement is PlacementKind.SHARDED
        E = self.config.num_experts
        owned = 0 if sharded else len(placement.owned(r))
        return RankWork(rows, rows if training else 0, len(placement.slots[r]), owned, chunk, self.world,
                        sharded or placement.num_copies > E, E if sharded else 0, training, self.keep, bwd_chunk,
                        RowSplit(0) if split is None and self.by_row and training else split)

    def peak(self, work: RankWork) -> int:
        return expert_side_peak(self.spec, self.config.dim, self.config.ffn_dim, self.bytes.dtype_bytes, work)

    def rank_fit(self, placement: Placement, r: int, rows: int, training: bool
                 ) -> tuple[int, int | None, int, RowSplit | None]:
        """(forward chunk rows, backward chunk rows or None, predicted peak) of rank r computing
        ``rows`` rows: in rounds (:attr:`rounds`), the largest round that fits both passes;
        otherwise all at once where that fits, else the largest forward chunk that does,
        else (a recomputing backward) the backward recomputed in the largest chunk that fits
        beside a one-row forward chunk, then the largest forward chunk beside it. The peak is
        over the cap where nothing fits. :attr:`by_row` (a training call): the richest
        :class:`RowSplit` within the cap, then its chunks (the last element; otherwise None)."""
        cap = self.memory_R[r]
        if self.rounds:
            return *self._round_fit(placement, r, rows, training), None
        if self.by_row and training:
            by_row = fit_by_row(lambda split, c, b: self.peak(self.work(placement, r, rows, True, c, b, split)),
                                rows, cap)
            return by_row.chunk, by_row.bwd_chunk, by_row.peak, by_row.split
        peak = self.peak(self.work(placement, r, rows, training))
        if peak <= cap or not self.chunks or rows <= 1:
            return max(rows, 1), None, peak, None
        chunk, peak = largest_fitting(lambda c: self.peak(self.work(placement, r, rows, training, c)), rows, cap)
        if peak <= cap or not (training and self.backward_chunks):
            return chunk, None, peak, None
        bwd, peak = largest_fitting(lambda c: self.peak(self.work(placement, r, rows, True, 1, c)), rows, cap)
        if peak > cap:
            return 1, 1, peak, None
        chunk, peak = largest_fitting(lambda c: self.peak(self.work(placement, r, rows, True, c, bwd)), rows, cap)
        return chunk, bwd, peak, None

    def _round_fit(self, placement: Placement, r: int, rows: int, training: bool) -> tuple[int, int | None, int]:
        """:meth:`rank_fit` in rounds: the most rows a round brings rank r (both passes alike)
        whose peak fits; one row, and its peak, where none does."""
        def peak_of(c: int) -> int:
            return self.peak(self.work(placement, r, rows, training, c, c if training else None))

        chunk, peak = largest_fitting(peak_of, rows + 1, self.memory_R[r]) if rows > 1 else (1, peak_of(1))
        return chunk, chunk if training else None, peak

    def rows_within(self, placement: Placement, r: int, training: bool) -> int:
        """Most rows rank r can compute within its cap under ``placement`` (chunked if need be)."""
        chunk = 1 if self.chunks else None
        bwd_chunk = 1 if training and self.backward_chunks else None

        def fits(n: int) -> bool:
            return self.peak(self.work(placement, r, n, training, chunk, bwd_chunk)) <= self.memory_R[r]

        if not fits(0):
            return 0
        lo, hi = 0, self.memory_R[r] // self.bytes.row + 1  # fits(lo), not fits(hi): a row is ≥ D·s bytes
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def measure(self, placement: Placement, assignment: PairAssignment, training: bool) -> Fit:
        """Every rank's chunks and peak under ``assignment``, and whether all fit. By the row, a
        call every rank can keep whole runs as uncapped (one replay a rank), the split searched
        only where it cannot."""
        if self.by_row and training:
            plain = replace(self, keep=None, by_row=False).measure(placement, assignment, training)
            if plain.ok:
                return plain
        recv_R = assignment.rows_R()
        chunk_R, bwd_R, peak_R, split_R = zip(*(self.rank_fit(placement, r, int(n), training)
                                                for r, n in enumerate(recv_R)))
        ok = all(p <= m for p, m in zip(peak_R, self.memory_R))
        bwd = None if all(b is None for b in bwd_R) else [int(n) if b is None else b for b, n in zip(bwd_R, recv_R)]
        split = None if split_R[0] is None else list(split_R)
        return Fit(placement, assignment, list(chunk_R), list(peak_R), ok, bwd, self.keep, split)


def kept_rows_bound(assignment: PairAssignment, quota_E: torch.Tensor) -> list[int]:
    """Most backward rows each rank computes where kept pairs stay where the forward computed
    them: Σ_e min(its forward rows of e, q_e)."""
    return torch.minimum(assignment.rows_ER(), quota_E.view(-1, 1)).sum(0).tolist()


def keep_mode(peaks: RankPeaks | None, placement: Placement, assignment: PairAssignment,
              chunk_rows_R: list[int] | None, quota_E: torch.Tensor, network_R: list[int] | None,
              local: bool, bwd_chunk: int = 0) -> str:
    """What a compacting backward's expert side keeps from forward to backward, identical on
    every rank (decided from the plan alone): without a cap (``peaks`` None) the fastest, x and
    activations (no re-sent x, no recompute); under a cap the richest mode whose predicted peak
    fits every rank and, with a network budget, whose backward bytes fit it too. Kept pairs are
    then computed where the forward computed them, so rank r's backward rows are at most
    Σ_e min(its forward rows of e, q_e); x and activations need an unchunked forward. ``local``:
    the selection is local (a kept row's position rides with dy; a global one sends a kept byte
    per forward row). ``bwd_chunk``: a mode that recomputes may do so this many rows at a time
    (``BackwardConfig.recompute_chunk``; 0: every kept row at once). Keeping gate/up fits where
    it does with its forward in :func:`~lrmoe.planning.chunks.gate_up_least_chunks`' chunks
    (:func:`~lrmoe.planning.chunks.gate_up_chunks` then finds the largest that fit)."""
    if peaks is None:
        return KEEP_X_ACTS
    world, bm = peaks.world, peaks.bytes
    fwd_R = assignment.rows_R()
    bwd_R = kept_rows_bound(assignment, quota_E)
    chunk_R = chunk_rows_R or [None] * world
    # kept rows' dy in and dx out, plus a local selection's kept positions or a global one's
    # kept byte per forward row
    position = position_bytes(bm.dtype_bytes) if local else 0
    mask = 0 if local else 1
    if network_R is not None and any((2 * bm.row + position) * int(bwd_R[r]) + mask * int(fwd_R[r]) > network_R[r]
                                     for r in range(world)):
        return KEEP_NOTHING  # only a re-spread of the kept pairs keeps every rank within its network
    for mode in KEEP_MODES[:-1]:
        if mode == KEEP_X_ACTS and any(c is not None and c < n for c, n in zip(chunk_R, fwd_R)):
            continue
        chunk = bwd_chunk if bwd_chunk and mode not in (KEEP_X_ACTS, KEEP_X_GATE_UP) else None
        fwd_chunk_R = gate_up_least_chunks(chunk_R, fwd_R) if mode == KEEP_X_GATE_UP else chunk_R
        if all(peaks.peak(replace(peaks.work(placement, r, int(fwd_R[r]), True, fwd_chunk_R[r]),
                                  bwd_rows=int(bwd_R[r]), keep=mode, bwd_chunk_rows=chunk)) <= peaks.memory_R[r]
               for r in range(world)):
            return mode
    return KEEP_NOTHING
