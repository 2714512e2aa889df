"""SwiGLU experts with 3-D weights; every expert product goes through the grouped-GEMM seam
(:mod:`lrmoe.grouped_gemm`).

Weights keep HF transformers' layout so conversion is a pure re-layout:
``gate_up_proj`` (L, 2F, D) with the gate rows first, ``down_proj`` (L, D, F).

Rows are always grouped by expert (``counts_L`` rows for local slot l, in slot order) and the
math is written out explicitly, forward and backward (MegaBlocks-style): the layer's autograd
function decides what is saved, recomputed, or compacted; this module only does arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lrmoe.grouped_gemm import Slots, grouped_mm, grouped_mm_wgrad


def span_counts(counts_L: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows of each slot among the slot-major rows [a, b)."""
    ends = counts_L.cumsum(0)
    return (ends.clamp(max=b) - (ends - counts_L).clamp(min=a)).clamp(min=0)


def chunk_spans(counts_L: torch.Tensor, chunk: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Slot-major rows in chunks of ``chunk``: (first row, end row, rows of each slot in it)."""
    total = int(counts_L.sum())
    for a in range(0, total, chunk):
        b = min(a + chunk, total)
        yield a, b, span_counts(counts_L, a, b)


# --------------------------------------------------------------------------------------------
# SwiGLU expert math: h = silu(x W_gᵀ) ⊙ (x W_uᵀ), y = h W_dᵀ.
# Gate and up are computed as two products into contiguous (R, F) blocks rather than one (R, 2F)
# product: elementwise kernels on the strided halves of an (R, 2F) tensor measured 1.6x slower
# (silu) up to 9x slower (mul with a strided out=) on CPU, while the split GEMMs cost the same.
# --------------------------------------------------------------------------------------------


def _each(fn, w: Slots) -> Slots:
    """``fn`` of a weight tensor, or of each of several sets."""
    return fn(w) if isinstance(w, torch.Tensor) else tuple(fn(x) for x in w)


def _halves(gate_up_L2FD: Slots) -> tuple[Slots, Slots]:
    """(gate, up) rows of the fused weights (of each set)."""
    F_ = (gate_up_L2FD if isinstance(gate_up_L2FD, torch.Tensor) else gate_up_L2FD[0]).shape[1] // 2
    return _each(lambda w: w[:, :F_], gate_up_L2FD), _each(lambda w: w[:, F_:], gate_up_L2FD)


def _transposed(w: Slots) -> Slots:
    return _each(lambda x: x.transpose(-2, -1), w)


def gate_up_forward(
    x_RD: torch.Tensor, gate_up_L2FD: Slots, counts_L: torch.Tensor, x_starts_L: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_RF, up_RF): the two input projections of each row's expert (``x_starts_L``: where
    each slot's x rows start, :func:`grouped_mm`)."""
    w_gate, w_up = _halves(gate_up_L2FD)
    gate_RF = grouped_mm(x_RD, _transposed(w_gate), counts_L, a_starts_L=x_starts_L)
    up_RF = grouped_mm(x_RD, _transposed(w_up), counts_L, a_starts_L=x_starts_L)
    return gate_RF, up_RF


def expert_forward(
    x_RD: torch.Tensor, gate_up_L2FD: Slots, down_LDF: Slots, counts_L: torch.Tensor, y_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns y_RD (written into ``y_out`` if given) and the activations a backward may reuse:
    gate, up, silu(gate), h. The weights may be several sets (:func:`grouped_mm`)."""
    gate_RF, up_RF = gate_up_forward(x_RD, gate_up_L2FD, counts_L)
    silu_RF, h_RF = swiglu(gate_RF, up_RF)
    return down_forward(h_RF, down_LDF, counts_L, y_out), {"gate": gate_RF, "up": up_RF, "silu": silu_RF, "h": h_RF}


def swiglu(gate_RF: torch.Tensor, up_RF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate), h = silu(gate) ⊙ up)."""
    silu_RF = F.silu(gate_RF)
    return silu_RF, silu_RF * up_RF


def down_forward(h_RF: torch.Tensor, down_LDF: Slots, counts_L: torch.Tensor, y_out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """y = h W_dᵀ of each row's expert (written into ``y_out`` if given)."""
    return grouped_mm(h_RF, _transposed(down_LDF), counts_L, out=y_out)


def expert_backward(
    dy_RD: torch.Tensor,
    x_RD: torch.Tensor,
    gate_up_L2FD: Slots,
    down_LDF: Slots,
    counts_L: torch.Tensor,
    acts: dict[str, torch.Tensor] | None = None,
    grads: tuple[Slots, Slots] | None = None,
    saved_starts_L: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Slots, Slots]:
    """Backward of :func:`expert_forward` given dy (already multiplied by the routing weight).

    ``acts`` are the forward's saved activations (gate and up alone: silu and h recomputed from
    them); without them gate/up, silu and h are recomputed from x (recompute systems, LRMoE).
    ``acts`` and ``dy_RD`` are consumed: their buffers are overwritten (dx is returned in dy's).
    ``grads`` (dgate_up, ddown): the weight gradients are added into these (a chunk of a chunked
    backward) instead of new tensors.
    ``saved_starts_L``: slot l's rows of x (and of the saved activations) start there, a gap
    after each slot (kept rows compacted in place, :mod:`lrmoe.passes.compaction`); dy's rows,
    and those of recomputed activations, are back to back.
    Returns (dx_RD, dgate_up_L2FD, ddown_LDF).
    """
    x_at = saved_starts_L
    if acts is None:
        gate_RF, up_RF = gate_up_forward(x_RD, gate_up_L2FD, counts_L, x_at)
        silu_RF, h_RF = swiglu(gate_RF, up_RF)
        acts_at = None
    else:
        acts_at = x_at
        gate_RF, up_RF = acts.pop("gate"), acts.pop("up")
        silu_RF, h_RF = (acts.pop("silu"), acts.pop("h")) if "silu" in acts else swiglu(gate_RF, up_RF)
    add = grads is not None
    sets = not isinstance(down_LDF, torch.Tensor)  # several sets: their gradients apart too
    dgate_up_L2FD, ddown_LDF = grads if add else (_each(torch.empty_like, gate_up_L2FD),
                                                  _each(torch.empty_like, down_LDF) if sets else None)
    # Every intermediate is written over a buffer that is no longer needed: on CPU a fresh
    # large tensor costs page faults comparable to the elementwise op itself.
    ddown_LDF = grouped_mm_wgrad(dy_RD, h_RF, counts_L, out=ddown_LDF, accumulate=add, b_starts_L=acts_at)
    dh_RF = grouped_mm(dy_RD, down_LDF, counts_L, out=h_RF, out_starts_L=acts_at)
    for a, b in _row_spans(counts_L, acts_at, h_RF.shape[0]):
        silu_RF[a:b].mul_(dh_RF[a:b])  # d up
        # d gate = silu'(g) · (dh ⊙ up), with ATen's fused silu_backward written over the gate.
        dh_RF[a:b].mul_(up_RF[a:b])
        torch.ops.aten.silu_backward.grad_input(dh_RF[a:b], gate_RF[a:b], grad_input=gate_RF[a:b])
    dup_RF, dgate_RF = silu_RF, gate_RF
    del h_RF, dh_RF, up_RF
    w_gate, w_up = _halves(gate_up_L2FD)
    dw_gate, dw_up = _halves(dgate_up_L2FD)
    grouped_mm_wgrad(dgate_RF, x_RD, counts_L, out=dw_gate, accumulate=add, a_starts_L=acts_at, b_starts_L=x_at)
    grouped_mm_wgrad(dup_RF, x_RD, counts_L, out=dw_up, accumulate=add, a_starts_L=acts_at, b_starts_L=x_at)
    dx_RD = grouped_mm(dgate_RF, w_gate, counts_L, out=dy_RD, a_starts_L=acts_at)
    grouped_mm(dup_RF, w_up, counts_L, out=dx_RD, accumulate=True, a_starts_L=acts_at)
    return dx_RD, dgate_up_L2FD, ddown_LDF


def _row_spans(counts_L: torch.Tensor, starts_L: torch.Tensor | None, rows: int) -> list[tuple[int, int]]:
    """The row ranges an elementwise pass covers: every row, or each slot's where there are gaps."""
    if starts_L is None:
        return [(0, rows)]
    return [(a, a + n) for a, n in zip(starts_L.tolist(), counts_L.tolist()) if n]


def zero_grads(gate_up_L2FD: Slots, down_LDF: Slots) -> tuple[Slots, Slots]:
    """Zeroed weight gradients of every slot set, for a backward that adds into them chunk by chunk."""
    return _each(torch.zeros_like, gate_up_L2FD), _each(torch.zeros_like, down_LDF)


def expert_backward_chunked(
    dy_RD: torch.Tensor, x_RD: torch.Tensor, gate_up_L2FD: Slots, down_LDF: Slots,
    counts_L: torch.Tensor, chunk: int, order_R: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Slots, Slots]:
    """:func:`expert_backward` recomputing ``chunk`` rows at a time: one chunk's activations live
    at once (MemFine-style), the weight gradients summed over chunks in place. ``order_R``: dy
    is in another order, slot-major row i being ``dy_RD[order_R[i]]``; each chunk's dy rows are
    gathered through it and its dx written back in their place. dx is returned in dy's buffer
    and order, as unchunked."""
    dgate_up_L2FD, ddown_LDF = zero_grads(gate_up_L2FD, down_LDF)
    for a, b, part_L in chunk_spans(counts_L, chunk):
        dy = dy_RD[a:b] if order_R is None else dy_RD[order_R[a:b]]
        dx = expert_backward(dy, x_RD[a:b], gate_up_L2FD, down_LDF, part_L, grads=(dgate_up_L2FD, ddown_LDF))[0]
        if order_R is not None:
            dy_RD[order_R[a:b]] = dx
    return dy_RD, dgate_up_L2FD, ddown_LDF


class GroupedExperts(nn.Module):
    """The routed experts one rank holds: ``num_local`` SwiGLU experts as 3-D weights."""

    def __init__(self, num_local: int, dim: int, ffn_dim: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * ffn_dim, dim, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_local, dim, ffn_dim, dtype=dtype))
        nn.init.normal_(self.gate_up_proj, std=dim**-0.5)
        nn.init.normal_(self.down_proj, std=ffn_dim**-0.5)


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP (the shared expert), HF naming: gate_proj, up_proj, down_proj."""

    def __init__(self, dim: int, hidden: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(hidden, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
