"""The routed experts of a call keeping by the row (docs/design.md "Keep by the row"): a capped
exact call whose ranks keep, each as much as its cap allows, their first rows' activations, the
next rows' gate/up products and the rest's x alone (:class:`~lrmoe.memory.bytes.RowSplit`,
chosen by :mod:`lrmoe.planning.row_split`), so only what does not fit is recomputed.

Forward: each part over its rows, the activations part at once, the gate/up part's products at
once with silu, h and y a chunk at a time, the x-only part a chunk at a time. Backward: part by
part, a chunk at a time, dy read in its received order (no slot-major copy of dy or dx), from
the kept activations, from gate/up with silu and h recomputed, or from x with all four
recomputed; the weight gradients summed over chunks in place. The meter follows the holds of
:func:`lrmoe.memory.replay.expert_side_peak` for such a call.
"""

from __future__ import annotations

import torch

from lrmoe import experts
from lrmoe.memory.bytes import GATE_UP, KEEP_X_ACTS, RowSplit
from lrmoe.memory.meter import MemoryMeter
from lrmoe.passes.saved import KeptParts
from lrmoe.selection.scores import score_norms

# (row, F) activations a part computes a chunk at a time, forward and backward (x alone: all four)
RECOMPUTED = {KEEP_X_ACTS: 0, GATE_UP: 2}


def _ffn_bytes(down: experts.Slots, like: torch.Tensor) -> int:
    """Bytes of one row of one (row, F) activation."""
    return (down if isinstance(down, torch.Tensor) else down[0]).shape[2] * like.element_size()


def forward_by_row(rows_RD: torch.Tensor, gate_up: experts.Slots, down: experts.Slots, counts_L: torch.Tensor,
                   split: RowSplit, chunk: int, y_RD: torch.Tensor, h_sq_R: torch.Tensor | None,
                   meter: MemoryMeter, h_mean_LF: torch.Tensor | None = None) -> KeptParts:
    """y of every received row into ``y_RD`` (and the scores' ‖h‖², or ‖h − h̄‖² with a control
    variate's means ``h_mean_LF``, into ``h_sq_R`` where given); returns what the parts keep
    beyond x, held on the meter."""
    acts = gate_up_kept = None
    act = _ffn_bytes(down, rows_RD)
    for kind, lo, hi in split.spans(rows_RD.shape[0]):
        counts = experts.span_counts(counts_L, lo, hi)
        if kind == KEEP_X_ACTS:
            _, acts = experts.expert_forward(rows_RD[lo:hi], gate_up, down, counts, y_out=y_RD[lo:hi])
            meter.hold(*acts.values())
            if h_sq_R is not None:
                h_sq_R[lo:hi] = score_norms(acts["h"], counts, h_mean_LF)
            continue
        if kind == GATE_UP:
            gate_up_kept = experts.gate_up_forward(rows_RD[lo:hi], gate_up, counts)
            meter.hold(*gate_up_kept)
        meter.reach(min(chunk, hi - lo) * RECOMPUTED.get(kind, 4) * act)  # a chunk's silu and h, or all four
        for a, b, part in experts.chunk_spans(counts, chunk):
            y_out = y_RD[lo + a : lo + b]
            if kind == GATE_UP:
                h = experts.swiglu(gate_up_kept[0][a:b], gate_up_kept[1][a:b])[1]
                experts.down_forward(h, down, part, y_out)
            else:
                h = experts.expert_forward(rows_RD[lo + a : lo + b], gate_up, down, part, y_out=y_out)[1]["h"]
            if h_sq_R is not None:
                h_sq_R[lo + a : lo + b] = score_norms(h, part, h_mean_LF)
    return KeptParts(split, acts, gate_up_kept)


def backward_by_row(dy_RD: torch.Tensor, x_RD: torch.Tensor, gate_up: experts.Slots, down: experts.Slots,
                    counts_L: torch.Tensor, kept: KeptParts, chunk: int, order_R: torch.Tensor | None,
                    meter: MemoryMeter) -> tuple[torch.Tensor, experts.Slots, experts.Slots]:
    """(dx, in dy's buffer and order, the slots' weight gradients). ``order_R``: dy is in received
    order, slot-major row i being ``dy_RD[order_R[i]]`` (None: slot-major already)."""
    grads = experts.zero_grads(gate_up, down)
    act, gather = _ffn_bytes(down, x_RD), 0 if order_R is None else dy_RD.shape[1] * dy_RD.element_size()
    for kind, lo, hi in kept.split.spans(x_RD.shape[0]):
        meter.reach(min(chunk, hi - lo) * (RECOMPUTED.get(kind, 4) * act + gather))
        for a, b, part in experts.chunk_spans(experts.span_counts(counts_L, lo, hi), chunk):
            i, j = lo + a, lo + b
            saved = None
            if kind == KEEP_X_ACTS:
                saved = {name: t[i:j] for name, t in kept.acts.items()}
            elif kind == GATE_UP:
                gate, up = kept.gate_up[0][a:b], kept.gate_up[1][a:b]
                silu, h = experts.swiglu(gate, up)
                saved = {"gate": gate, "up": up, "silu": silu, "h": h}
            dy = dy_RD[i:j] if order_R is None else dy_RD[order_R[i:j]]
            dx = experts.expert_backward(dy, x_RD[i:j], gate_up, down, part, saved, grads=grads)[0]
            if order_R is not None:
                dy_RD[order_R[i:j]] = dx
    meter.drop(*kept.tensors())
    return dy_RD, *grads
