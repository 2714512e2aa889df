"""The kept rows of a keep-x backward brought together, by gathering them or where they lie.

A backward that computes each kept pair where the forward kept its x (and activations) needs,
per local slot, its kept rows in one block for the grouped GEMMs. Two ways:

- **gather** (:func:`gather_kept_rows`): every kept row of x and of each activation copied into
  new slot-major tensors: ρ·R rows moved, a new allocation each;
- **in place** (:func:`compact_in_place`): slot l's K_l kept rows brought into the window of
  K_l rows of its own block that already holds the most of them, by moving only the kept rows
  outside it into the dropped rows within it. That moves at most min(K_l, R_l − K_l) rows a
  slot, about ρ(1 − ρ)·R in all where the kept rows lie at random: a tenth of the gather's rows
  at ρ = 0.9. They do not: the draw keeps pairs of high routing weight more often, and the
  forward lays a compacting backward's rows in order of that weight, so that two neighbouring
  sources' likely-kept rows meet in one stretch of each block
  (:func:`lrmoe.parallel.rows.row_layout`'s ``order_key_P``), and fewer move. The blocks keep
  their places, so each slot's rows start where its window does with gaps around them (the
  grouped GEMMs take per-slot starts, :func:`lrmoe.grouped_gemm.grouped_mm`), and the kept rows
  within a block are no longer in dy's order: dy is put in theirs (``order_R``) and dx back.

The saved activations make the gather expensive (4F + D values a row against dy's D), so a
call that kept them and keeps most of its rows compacts in place
(:func:`lrmoe.memory.bytes.in_place`); one that kept x alone gathers it (D values a row, and its
recomputed activations are back to back). Rows move through a staging buffer of at most
:data:`STAGING_ROWS` rows, bookkeeping like the row plans' indices.
"""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.memory.meter import MemoryMeter
from lrmoe.parallel.comm import to_device
from lrmoe.passes.saved import InPlace, Saved

STAGING_ROWS = 256  # rows moved at once when compacting in place


def gather_kept_rows(saved: Saved, kept_rows: torch.Tensor, meter: MemoryMeter) -> torch.Tensor:
    """The saved x rows (returned) and activations (in ``saved.acts``) of the kept rows, in
    ``kept_rows``' order; each full tensor let go right after its gather."""
    tensors = {"x": saved.rows_RD, **(saved.acts or {})}
    had_acts = saved.acts is not None
    saved.rows_RD = saved.acts = None
    for name in list(tensors):  # the dict holds the only reference: each full tensor goes after its gather
        full = tensors.pop(name)
        tensors[name] = torch.index_select(full, 0, kept_rows.to(full.device))
        meter.hold(tensors[name])
        meter.drop(full)
        del full
    rows_RD = tensors.pop("x")
    saved.acts = tensors if had_acts else None
    return rows_RD


def plan_in_place(kept_rows: np.ndarray, fwd_L: np.ndarray, kept_L: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, InPlace]:
    """Which rows move where to compact in place. ``kept_rows``: each kept row's slot-major index
    among the forward's rows, in dy's order (slot-major); ``fwd_L`` / ``kept_L``: forward and
    kept rows per slot. Slot l's kept rows end up in the window of K_l rows of its block that
    already holds the most of them (the first such window): only the kept rows outside it move,
    into its dropped rows. Returns (source rows, destination rows, the layout after the moves)."""
    R, K = int(fwd_L.sum()), len(kept_rows)
    starts_L = np.cumsum(fwd_L) - fwd_L
    slot_R = np.repeat(np.arange(len(fwd_L)), fwd_L)
    kept_R = np.zeros(R, dtype=bool)
    kept_R[kept_rows] = True
    window_L = starts_L + _best_window(kept_R, slot_R, starts_L, fwd_L, kept_L)
    offset_R = np.arange(R) - window_L[slot_R]
    in_window_R = (offset_R >= 0) & (offset_R < kept_L[slot_R])
    dy_of_R = np.zeros(R, dtype=np.int64)  # the dy row of each kept row
    dy_of_R[kept_rows] = np.arange(K)
    # the kept rows outside each window fill its dropped rows, both in ascending order: a slot
    # has as many of one as of the other, and slots follow one another in both
    src, dst = np.flatnonzero(kept_R & ~in_window_R), np.flatnonzero(in_window_R & ~kept_R)
    dy_of_R[dst] = dy_of_R[src]
    return src, dst, InPlace(torch.from_numpy(window_L), torch.from_numpy(dy_of_R[in_window_R]))


def _best_window(kept_R: np.ndarray, slot_R: np.ndarray, starts_L: np.ndarray, fwd_L: np.ndarray,
                 kept_L: np.ndarray) -> np.ndarray:
    """Per slot, the first offset a in [0, R_l − K_l] where rows [a, a + K_l) of its block hold the
    most kept rows (0 for an empty slot)."""
    R = len(kept_R)
    before = np.concatenate([[0], np.cumsum(kept_R)])  # kept rows before each row
    end_R = np.arange(R) + kept_L[slot_R]
    fits_R = end_R <= (starts_L + fwd_L)[slot_R]  # a window from this row stays in the block
    held_R = np.where(fits_R, before[np.minimum(end_R, R)] - before[:R], -1)
    most_L = np.full(len(fwd_L), -1)
    np.maximum.at(most_L, slot_R, held_R)
    first = np.flatnonzero(held_R == most_L[slot_R])
    offset_L = np.zeros(len(fwd_L), dtype=np.int64)
    slots, at = np.unique(slot_R[first], return_index=True)  # the first best row of each slot
    offset_L[slots] = first[at] - starts_L[slots]
    return offset_L


def move_rows(tensors: list[torch.Tensor], src: np.ndarray, dst: np.ndarray) -> None:
    """``t[dst] = t[src]`` for each tensor (disjoint rows), through a staging of at most
    :data:`STAGING_ROWS` rows; on the host through NumPy views (its row copies measured three
    times faster than ``index_copy_``)."""
    if not len(src):
        return
    spans = [(src[a : a + STAGING_ROWS], dst[a : a + STAGING_ROWS]) for a in range(0, len(src), STAGING_ROWS)]
    for t in tensors:
        if t.device.type == "cpu" and t.dtype != torch.bfloat16:  # (NumPy has no bfloat16)
            rows = t.numpy()
            for s, d in spans:
                rows[d] = rows[s]
            continue
        staging = t.new_empty(min(len(src), STAGING_ROWS), *t.shape[1:])
        for s, d in spans:
            s, d = to_device(torch.from_numpy(s), t.device), to_device(torch.from_numpy(d), t.device)
            torch.index_select(t, 0, s, out=staging[: len(s)])
            t.index_copy_(0, d, staging[: len(s)])


def compact_in_place(tensors: list[torch.Tensor], kept_rows: torch.Tensor, fwd_L: torch.Tensor,
                     kept_L: torch.Tensor) -> tuple[InPlace, int]:
    """Compact the kept rows of the saved ``tensors`` in place (see the module docstring);
    returns where each slot's rows now start and the order dy must take, and the rows moved.
    Planned on the host: on a device this reads the kept rows' indices back (one small read per
    call, beside the kept counts the split sizes need)."""
    src, dst, layout = plan_in_place(kept_rows.cpu().numpy(), fwd_L.numpy(), kept_L.numpy())
    move_rows(tensors, src, dst)
    return layout, len(src)

