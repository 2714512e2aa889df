"""LRM scores of the backward's pairs.

Score of pair (t, e): the squared Frobenius norm of its contribution to expert e's
down-projection weight gradient. That contribution is the outer product (w_te·g_t) ⊗ h_te, so

    score(t, e) = w_te² · ‖g_t‖² · ‖h_te‖²

and no gradient matrix is formed. Scores are float64: finite fp32/bf16 inputs cannot overflow.
"""

from __future__ import annotations

import torch

from lrmoe.selection.arrays import as_tensor, float64, on_host


def squared_norms(x_RD: torch.Tensor) -> torch.Tensor:
    """‖x_r‖² per row in float64, finite for finite inputs. On the CPU one fp32 pass, with the
    rows whose fp32 norm overflowed redone in float64; on CUDA that check would be a
    device→host read, so :func:`scaled_squared_norms` instead."""
    if x_RD.is_cuda:
        return scaled_squared_norms(x_RD)
    sq = torch.linalg.vector_norm(x_RD, dim=-1).to(torch.float64).square()
    bad = ~torch.isfinite(sq)
    if bad.any():
        sq[bad] = x_RD[bad].to(torch.float64).square().sum(-1)
    return sq


def scaled_squared_norms(x_RD: torch.Tensor) -> torch.Tensor:
    """‖x_r‖² per row in float64 with nothing read back: each row is first scaled by the power
    of two (exact) that brings its largest entry into [1, 2), so the fp32 pass cannot overflow."""
    peak = x_RD.abs().amax(-1, keepdim=True).float().clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.exp2(-torch.floor(torch.log2(peak)))
    low_range = x_RD.dtype not in (torch.bfloat16, torch.float32, torch.float64)  # fp16: 2^±126 overflows it
    work = x_RD.float() if low_range else x_RD
    norm = torch.linalg.vector_norm(work * scale.to(work.dtype), dim=-1, dtype=torch.float32)
    return (norm.to(torch.float64) / scale.squeeze(-1).to(torch.float64)).square()


def score_norms(h_RF: torch.Tensor, counts_L: torch.Tensor, h_mean_LF: torch.Tensor | None) -> torch.Tensor:
    """The h factor of the rows' scores: ‖h‖², or with a control variate's slot means
    ``h_mean_LF`` (:mod:`lrmoe.passes.control`) the residual ‖h − h̄_slot‖² it leaves to the draw
    (slot-major rows, ``counts_L`` a slot)."""
    if h_mean_LF is None:
        return squared_norms(h_RF)
    if h_RF.is_cuda:  # the means spread over every row at once: a few kernels, not a few a slot
        rows_RF = torch.repeat_interleave(h_mean_LF, counts_L.to(h_RF.device), dim=0, output_size=h_RF.shape[0])
        return squared_norms(h_RF - rows_RF)
    # on the host slot by slot: one slot's residuals at a time, not an (R, F) copy of the means
    # and another of the residuals (each a pass over memory as long as h's)
    out = torch.empty(h_RF.shape[0], dtype=torch.float64, device=h_RF.device)
    lo = 0
    for slot, n in enumerate(counts_L.tolist()):
        if n:
            out[lo : lo + n] = squared_norms(h_RF[lo : lo + n] - h_mean_LF[slot])
        lo += n
    return out


def lrm_scores(weights_P: torch.Tensor, g_sq_P: torch.Tensor, h_sq_P: torch.Tensor) -> torch.Tensor:
    """w² · ‖g‖² · ‖h‖² per pair, float64."""
    return weights_P.detach().to(torch.float64).square() * g_sq_P * h_sq_P


def pair_scores(weights_P: torch.Tensor, g_sq_T: torch.Tensor, h_sq_P: torch.Tensor, pairs_N: torch.Tensor
                ) -> torch.Tensor:
    """:func:`lrm_scores` of the pairs ``pairs_N`` (flattened t·K + k ids), in that order, from
    ‖g‖² per token: computed for those pairs only, with NumPy on the host
    (:mod:`lrmoe.selection.arrays`)."""
    K = weights_P.numel() // max(g_sq_T.numel(), 1)
    w_P, g_sq, h_sq, pairs = (on_host(t.detach()) for t in (weights_P, g_sq_T, h_sq_P, pairs_N))
    w_N = float64(w_P[pairs])
    return as_tensor(w_N * w_N * g_sq[pairs // K] * h_sq[pairs])
