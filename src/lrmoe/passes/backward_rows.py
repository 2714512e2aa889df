"""What the backward's stages hand one another: the kept set a selection chose (:class:`Kept`),
the upstream gradient packed on demand (:class:`DyRows`) and where the backward's rows go
(:class:`BackwardRows`). Plain data below the call record, the selectors
(:mod:`lrmoe.passes.selectors`) and the row paths (:mod:`lrmoe.passes.row_paths`), which all
name them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.parallel.dispatch import Message, position_dtype
from lrmoe.parallel.rows import RowLayout
from lrmoe.selection.strata import Strata


@dataclass(frozen=True)
class Kept:
    """The backward's kept set of this rank's pairs."""

    keep_P: torch.Tensor | None  # bool over this rank's pairs (None: every pair)
    kept_SE: torch.Tensor | None  # int64 (W, E) kept pairs per source and expert (None: the forward's)
    quota_E: torch.Tensor  # pairs each expert was to keep
    kept_E: torch.Tensor  # pairs each expert kept
    scale_P: torch.Tensor | None = None  # 1/π of kept sampled pairs (None: every contribution × 1)
    nonfinite: bool | torch.Tensor | None = None  # non-finite scores alone exceeded a quota (selective)
    strata: Strata | None = None  # a local selection's strata
    keep_N: torch.Tensor | None = None  # and its kept mask over the forward's send order


@dataclass(frozen=True)
class DyRows:
    """The upstream gradient of the pairs, packed on demand: dy = factor · g_t of any pairs, in
    the order a row path sends them (every system packs its rows: not the selection's cost). A
    path that knows its final order before the exchange packs straight into it."""

    g_TD: torch.Tensor
    factor_P: torch.Tensor  # the routing weight, times 1/π for sampled pairs (0: masked)
    K: int

    def of(self, pairs_N: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """dy of ``pairs_N``, scaled into ``out`` if given (else over the gathered g rows)."""
        g_ND = torch.index_select(self.g_TD, 0, pairs_N // self.K)
        return torch.mul(g_ND, self.factor_P[pairs_N].unsqueeze(1), out=g_ND if out is None else out)

    def with_positions(self, pairs_N: torch.Tensor, pos_N: torch.Tensor) -> Message:
        """dy of ``pairs_N`` and each one's position in one message, dy scaled straight into it."""
        message = Message.empty(len(pairs_N), self.g_TD.shape[1], self.g_TD, position_dtype(self.g_TD))
        if message is None:  # a row's bytes would misalign the position: packed, then copied beside it
            return Message.of(self.of(pairs_N), pos_N.to(position_dtype(self.g_TD)))
        self.of(pairs_N, out=message.rows)
        message.extra.copy_(pos_N)
        return message


@dataclass(frozen=True)
class BackwardRows:
    """Where the backward's rows go: its layout, and what says which saved rows are kept."""

    layout: RowLayout
    kept_pos_N: torch.Tensor | None = None  # kept rows' positions in their strata, riding with dy
    kept_rows: torch.Tensor | None = None  # kept rows among the saved ones, slot-major (None: all)
    chunk: int | None = None  # rows recomputed at once where the plan chunks this rank's backward:
    # an exact backward's dy then stays in received order, each chunk's rows read through the
    # layout's regroup index and its dx written back in their place, so no slot-major copy of dy
    # or dx is ever held
    slot_major: bool = False  # dy arrives slot-major, chunked or not (a compacting backward's kept rows)

    @property
    def dy_slot_major(self) -> bool:
        return self.slot_major or self.chunk is None or self.layout.regroup_idx is None
