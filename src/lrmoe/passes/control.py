"""A control variate for the dropped pairs (``BackwardConfig(control_variate=True)``).

Expert e's weight gradients are sums of per-pair contributions, each linear in the pair's
dy_i = w_i·g_t: dW_down = Σ dy_i h_iᵀ, dW_gate = Σ (dh_i ⊙ m_i) x_iᵀ and dW_up = Σ (dh_i ⊙ s_i) x_iᵀ,
with dh_i = W_downᵀ dy_i, s = silu(gate) and m = up ⊙ silu'(gate). With the means h̄, x̄, m̄, s̄
of a slot's forward rows in place of each pair's own, a contribution becomes a linear map A of
dy_i alone, the same for every pair of the slot, so

    Ĝ = Σ_kept c_i / π_i + A(Σ_all dy_i − Σ_kept dy_i / π_i)

is unbiased for any A fixed before the draw (the bracket has mean zero), and its variance is
that of the residuals c_i − A(dy_i) alone. On configs/paper.toml's model early in training a
slot's h and x are dominated by their means and the residuals carry a small share of the
contributions (docs/convergence.md "A control variate").

What it costs: the means from a few rows a slot (:data:`SAMPLE_ROWS`, recomputed in the
forward), the home side's bracket a (destination, slot) — coefficients a (destination slot,
token) times g, one GEMM — sent to the slot's holder as one row of D (one small
all-to-all), and a rank-1 update a slot of each weight gradient. By default the scores become
the residuals' (w²‖g‖²‖h − h̄‖²), so the sampler draws by what the variate leaves and the noise
objective prices it; ``BackwardConfig(variate_scores="contributions")`` keeps the pairs' own
scores, and with them the plain draw (dx, which the variate does not correct, no noisier).
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch

from lrmoe import experts
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Channel
from lrmoe.passes.backward_rows import Kept
from lrmoe.passes.record import CallRecord
from lrmoe.passes.saved import ControlMeans

SAMPLE_ROWS = 16  # rows a slot whose activations give its means (evenly spaced; all where fewer)


def control_means(rows_RD: torch.Tensor, gate_up: experts.Slots, counts_L: torch.Tensor) -> ControlMeans:
    """The slots' means from up to :data:`SAMPLE_ROWS` evenly spaced rows of each (slot-major
    ``rows_RD``, ``counts_L`` rows a slot), their gate and up recomputed; zeros for a slot with
    no row. Fixed by the forward's rows, before any draw: the variate stays unbiased. Every
    slot's sample at once, a slot short of rows padded with zero rows (whose gate and up, and so
    every activation below, are zero): one batched product per weight set, not two a slot."""
    counts = counts_L.numpy()
    take = np.minimum(counts, SAMPLE_ROWS)
    j = np.arange(SAMPLE_ROWS)
    real_LS = j < take[:, None]
    idx_LS = (np.cumsum(counts) - counts)[:, None] + j * counts[:, None] // np.maximum(take, 1)[:, None]
    (R, D), device = rows_RD.shape, rows_RD.device
    padded = rows_RD.new_zeros(1, D) if R == 0 else rows_RD  # (a rank that received no row: zeros)
    x_LSD = padded[comm.to_device(torch.from_numpy(np.where(real_LS, idx_LS, 0).reshape(-1)), device)]
    x_LSD = x_LSD.view(len(counts), SAMPLE_ROWS, D) * comm.to_device(torch.from_numpy(real_LS), device).unsqueeze(2)
    gate_up_LS2F = _per_set(x_LSD, gate_up)
    gate_LSF, up_LSF = gate_up_LS2F.chunk(2, dim=2)  # (the fused weights' gate rows first)
    sig = torch.sigmoid(gate_LSF)
    silu_LSF = gate_LSF * sig
    dsilu_up_LSF = up_LSF * sig * (1 + gate_LSF * (1 - sig))
    denom = comm.to_device(torch.from_numpy(np.maximum(take, 1)), device).to(x_LSD.dtype).unsqueeze(1)

    def mean(v_LSX: torch.Tensor) -> torch.Tensor:
        return v_LSX.sum(1) / denom

    return ControlMeans(mean(x_LSD), mean(silu_LSF * up_LSF), mean(silu_LSF), mean(dsilu_up_LSF))


def _per_set(x_LSD: torch.Tensor, w_LXD: experts.Slots) -> torch.Tensor:
    """x w_lᵀ for each slot l's rows, the slots' weights in one tensor or in several sets, slot
    after slot."""
    sets = (w_LXD,) if isinstance(w_LXD, torch.Tensor) else w_LXD
    out, lo = [], 0
    for w in sets:
        out.append(torch.bmm(x_LSD[lo : lo + w.shape[0]], w.transpose(1, 2)))
        lo += w.shape[0]
    return out[0] if len(out) == 1 else torch.cat(out)


def dropped_mass(call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, kept: Kept,
                 channel: Channel) -> torch.Tensor:
    """Σ_all dy_i − Σ_kept dy_i / π_i over the pairs each local slot computed in the forward,
    from every source rank: (L, D) (collective). Each home sums its own pairs a (destination,
    slot), in the forward's send order, and sends a row per slot of each destination."""
    rows, placement = call.rows, call.plan.placement
    K = call.ids_TK.shape[1]
    kept_f = weights_TK.reshape(-1).to(torch.float64)
    if kept.scale_P is not None:
        kept_f = kept_f * kept.scale_P
    if kept.keep_P is not None:
        kept_f = kept_f * kept.keep_P
    left_P = (weights_TK.reshape(-1).to(torch.float64) - kept_f).to(g_TD.dtype)  # w_i − w_i·1[kept]/π_i
    pairs_N = rows.pair_idx
    device = g_TD.device
    slots_W = [len(s) for s in placement.slots]
    offset_W = torch.tensor([0, *accumulate(slots_W)][:-1], device=device)
    dest_N = torch.repeat_interleave(torch.arange(len(slots_W), device=device),
                                     torch.tensor(rows.send_splits, device=device), output_size=len(pairs_N))
    slot_N = comm.to_device(placement.slot_index, device)[dest_N, call.ids_TK.reshape(-1)[pairs_N]]
    # as (the group's slots × tokens) coefficients, K a token, times g: one GEMM of slots·T·D
    # multiply-adds (a token's experts do ~9·K·F·D), where a pair-by-pair sum copied a row of g a pair
    coef_XT = g_TD.new_zeros(sum(slots_W), g_TD.shape[0])
    coef_XT.index_put_((offset_W[dest_N] + slot_N, pairs_N // K), left_P[pairs_N], accumulate=True)
    send_XD = coef_XT @ g_TD
    mine = slots_W[call.layer.rank]
    recv_XD = channel.all_to_all(send_XD, slots_W, [mine] * len(slots_W))
    return recv_XD.view(len(slots_W), mine, -1).sum(0)


def add_control(dgate_up: experts.Slots, ddown: experts.Slots, down: experts.Slots, means: ControlMeans,
                c_LD: torch.Tensor) -> None:
    """Add A(c) to each slot's weight gradients in place: c ⊗ h̄ to the down projection's, and
    (dh ⊙ m̄) ⊗ x̄, (dh ⊙ s̄) ⊗ x̄ to the gate's and up's, dh = W_downᵀ c (rank-1 a slot)."""
    sets = [(dgate_up, ddown, down)] if isinstance(ddown, torch.Tensor) else list(zip(dgate_up, ddown, down))
    lo = 0
    for dgu, dd, w_down in sets:
        hi = lo + dd.shape[0]
        c = c_LD[lo:hi].to(dd.dtype)
        dh_LF = torch.bmm(c.unsqueeze(1), w_down).squeeze(1)  # W_downᵀ c, W_down (L, D, F)
        dd.baddbmm_(c.unsqueeze(2), means.h_LF[lo:hi].unsqueeze(1))
        F_ = dh_LF.shape[1]
        x = means.x_LD[lo:hi].unsqueeze(1)
        dgu[:, :F_].baddbmm_((dh_LF * means.dsilu_up_LF[lo:hi]).unsqueeze(2), x)
        dgu[:, F_:].baddbmm_((dh_LF * means.silu_LF[lo:hi]).unsqueeze(2), x)
        lo = hi
