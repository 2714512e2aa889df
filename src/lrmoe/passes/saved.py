"""What the expert side keeps from a call's forward to its backward (:class:`Saved`, a control
variate's means among it: :class:`ControlMeans`), and the layout its kept rows take once
compacted in place (:class:`InPlace`, made by :mod:`lrmoe.passes.compaction`). Below both the
record that carries them and the compaction that rewrites them, so neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.memory.bytes import RowSplit


@dataclass(frozen=True)
class KeptParts:
    """What a call keeping by the row kept of its rows beyond x (:mod:`lrmoe.passes.by_row`)."""

    split: RowSplit
    acts: dict[str, torch.Tensor] | None  # the activations part's gate, up, silu(gate), h
    gate_up: tuple[torch.Tensor, torch.Tensor] | None  # the gate/up part's gate and up

    def tensors(self) -> list[torch.Tensor]:
        return [*(self.acts or {}).values(), *(self.gate_up or ())]


@dataclass(frozen=True)
class InPlace:
    """Kept rows compacted in place: slot l's in rows [starts_L[l], starts_L[l] + kept_L[l])."""

    starts_L: torch.Tensor  # int64, host: each slot's first row (where its window starts in its forward block)
    order_R: torch.Tensor  # the dy row (slot-major kept order) of each compacted row, slot after slot


@dataclass(frozen=True)
class ControlMeans:
    """A control variate's (:mod:`lrmoe.passes.control`): each local slot's mean x, h, silu(gate)
    and up ⊙ silu'(gate) over (a sample of) its forward rows."""

    x_LD: torch.Tensor
    h_LF: torch.Tensor
    silu_LF: torch.Tensor
    dsilu_up_LF: torch.Tensor


@dataclass
class Saved:
    """What the expert side keeps from a call's forward to its backward."""

    rows_RD: torch.Tensor | None = None  # the received x rows, slot-major
    acts: dict[str, torch.Tensor] | None = None  # gate, up, silu(gate), h of those rows
    slot_weights: tuple[torch.Tensor, torch.Tensor] | None = None  # concatenated or assembled slot weights
    in_place: InPlace | None = None  # the backward compacted its kept rows in place (lrmoe.passes.compaction)
    by_row: KeptParts | None = None  # a call keeping by the row: its parts beyond x
    control: ControlMeans | None = None  # a control variate's means (lrmoe.passes.control)

    def clear(self) -> None:
        self.rows_RD = self.acts = self.slot_weights = self.in_place = self.by_row = self.control = None
