"""SwiGLU experts with 3-D weights and the one grouped-GEMM seam every expert product uses.

Weights keep HF transformers' layout so conversion is a pure re-layout:
``gate_up_proj`` (L, 2F, D) with the gate rows first, ``down_proj`` (L, D, F).

Rows are always grouped by expert (``counts_L`` rows for local slot l, in slot order) and the
math is written out explicitly, forward and backward (MegaBlocks-style): the layer's autograd
function decides what is saved, recomputed, or compacted; this module only does arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# The grouped-GEMM seam. Two products cover every expert GEMM:
#   grouped_mm(a_RK, b_LKN, counts_L)       rows of group l times b[l]        -> (R, N)
#   grouped_mm_wgrad(a_RM, b_RN, counts_L)  a_lᵀ · b_l, reduction over rows   -> (L, M, N)
# Tests intercept these two names to count the rows each call processed.
# --------------------------------------------------------------------------------------------

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def _aligned(t: torch.Tensor) -> bool:
    """``_grouped_mm`` needs 16-byte aligned strides for the two matrix dimensions."""
    step = 16 // t.element_size()
    return all(s % step == 0 or n == 1 for s, n in zip(t.stride()[-2:], t.shape[-2:]))


def _use_grouped_mm(a: torch.Tensor, b: torch.Tensor, wgrad: bool) -> bool:
    """Pick the kernel per call: fused grouped GEMM where it is supported and at least as fast.

    On CUDA the fused kernel avoids one launch per expert and any host read of the counts. On
    CPU it is a loop of GEMMs inside ATen: measured equal to our loop for row-grouped products
    and ~15% slower for the weight gradient (bench_layer shape, one thread), so the CPU takes
    the loop for weight gradients.
    """
    if _GROUPED_MM is None or a.dtype != b.dtype or not (_aligned(a) and _aligned(b)):
        return False
    if a.device.type == "cuda":
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (9, 0)
    return not wgrad


def _offsets(counts_L: torch.Tensor, device: torch.device) -> torch.Tensor:
    return counts_L.cumsum(0).to(device=device, dtype=torch.int32)


def grouped_mm(a_RK: torch.Tensor, b_LKN: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """Row-grouped product: rows of group l (``counts_L[l]`` consecutive rows) times ``b_LKN[l]``."""
    R, N = a_RK.shape[0], b_LKN.shape[-1]
    if R == 0:
        return a_RK.new_empty(0, N)
    if _use_grouped_mm(a_RK, b_LKN, wgrad=False):
        out = _GROUPED_MM(a_RK, b_LKN, offs=_offsets(counts_L, a_RK.device))
        return out
    out = a_RK.new_empty(R, N)
    start = 0
    for l, n in enumerate(counts_L.tolist()):
        if n:
            torch.mm(a_RK[start : start + n], b_LKN[l], out=out[start : start + n])
            start += n
    return out


def grouped_mm_wgrad(a_RM: torch.Tensor, b_RN: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """Per-group reduction over rows: out[l] = a_lᵀ · b_l (a weight gradient), zeros if empty."""
    L, M, N = counts_L.numel(), a_RM.shape[1], b_RN.shape[1]
    if a_RM.shape[0] and _use_grouped_mm(a_RM.t(), b_RN, wgrad=True):
        return _GROUPED_MM(a_RM.t(), b_RN, offs=_offsets(counts_L, a_RM.device))
    out = a_RM.new_empty(L, M, N)
    start = 0
    for l, n in enumerate(counts_L.tolist()):
        if n:
            torch.mm(a_RM[start : start + n].t(), b_RN[start : start + n], out=out[l])
        else:
            out[l].zero_()
        start += n
    return out


# --------------------------------------------------------------------------------------------
# SwiGLU expert math: h = silu(x W_gᵀ) ⊙ (x W_uᵀ), y = h W_dᵀ.
# --------------------------------------------------------------------------------------------


def swiglu_hidden(gate_up_R2F: torch.Tensor) -> torch.Tensor:
    """h = silu(gate) * up from the fused gate/up projection."""
    gate_RF, up_RF = gate_up_R2F.chunk(2, dim=-1)
    return F.silu(gate_RF) * up_RF


def expert_forward(
    x_RD: torch.Tensor, gate_up_L2FD: torch.Tensor, down_LDF: torch.Tensor, counts_L: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y_RD, gate_up_R2F, h_RF) for rows grouped by expert."""
    gate_up_R2F = grouped_mm(x_RD, gate_up_L2FD.transpose(-2, -1), counts_L)
    h_RF = swiglu_hidden(gate_up_R2F)
    y_RD = grouped_mm(h_RF, down_LDF.transpose(-2, -1), counts_L)
    return y_RD, gate_up_R2F, h_RF


def expert_backward(
    dy_RD: torch.Tensor,
    x_RD: torch.Tensor,
    gate_up_L2FD: torch.Tensor,
    down_LDF: torch.Tensor,
    counts_L: torch.Tensor,
    gate_up_R2F: torch.Tensor | None = None,
    h_RF: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`expert_forward` given dy (already multiplied by the routing weight).

    Recomputes the gate/up projection and h when they were not saved. Returns
    (dx_RD, dgate_up_L2FD, ddown_LDF).
    """
    if gate_up_R2F is None:
        gate_up_R2F = grouped_mm(x_RD, gate_up_L2FD.transpose(-2, -1), counts_L)
    gate_RF, up_RF = gate_up_R2F.chunk(2, dim=-1)
    sig_RF = torch.sigmoid(gate_RF)
    silu_RF = gate_RF * sig_RF
    if h_RF is None:
        h_RF = silu_RF * up_RF
    ddown_LDF = grouped_mm_wgrad(dy_RD, h_RF, counts_L)
    dh_RF = grouped_mm(dy_RD, down_LDF, counts_L)
    del h_RF
    # d silu(g)/dg = s·(1 + g·(1 − s)); written in place into one (R, 2F) buffer.
    dgate_up_R2F = torch.empty_like(gate_up_R2F)
    dgate_RF, dup_RF = dgate_up_R2F.chunk(2, dim=-1)
    torch.mul(dh_RF, silu_RF, out=dup_RF)
    torch.mul(dh_RF, up_RF, out=dgate_RF)
    del dh_RF, silu_RF
    dgate_RF.mul_(sig_RF.mul_(1.0 + gate_RF * (1.0 - sig_RF)))
    del sig_RF
    dgate_up_L2FD = grouped_mm_wgrad(dgate_up_R2F, x_RD, counts_L)
    dx_RD = grouped_mm(dgate_up_R2F, gate_up_L2FD, counts_L)
    return dx_RD, dgate_up_L2FD, ddown_LDF


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
