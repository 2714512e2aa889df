"""The grouped-GEMM seam (lrmoe.grouped_gemm): its fused and looped paths against each other and a
plain per-expert reference, the fallback on misaligned shapes, and the whole expert backward
(saved vs recomputed activations) on both paths against autograd."""

from __future__ import annotations

import pytest
import torch

from lrmoe import experts, grouped_gemm


def _force(monkeypatch, fused: bool) -> None:
    monkeypatch.setattr(grouped_gemm, "_use_grouped_mm", lambda a, b, wgrad, into: fused)


@pytest.mark.skipif(grouped_gemm._GROUPED_MM is None, reason="torch without _grouped_mm")
@pytest.mark.parametrize("counts", [[5, 0, 7, 4], [0, 0, 16, 0], [3, 3, 3, 3]])
def test_grouped_mm_paths_agree(monkeypatch, counts):
    torch.manual_seed(0)
    counts_L = torch.tensor(counts)
    R, K, N = int(counts_L.sum()), 32, 48
    a = torch.randn(R, K)
    w = torch.randn(len(counts), N, K)  # weight layout (L, N, K); product uses its transpose
    g = torch.randn(R, N)
    results = {}
    for fused in (True, False):
        _force(monkeypatch, fused)
        results[fused] = (
            experts.grouped_mm(a, w.transpose(-2, -1), counts_L),
            experts.grouped_mm_wgrad(g, a, counts_L),
        )
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want)
    # and both equal a plain per-expert reference
    ref = torch.cat([a[s : s + n] @ w[l].t() for l, (s, n) in enumerate(zip(
        torch.tensor(counts).cumsum(0) - counts_L, counts))])
    torch.testing.assert_close(results[False][0], ref)
    assert torch.all(results[True][1][counts_L == 0] == 0), "empty experts get zero weight gradients"


def test_misaligned_shapes_fall_back(monkeypatch):
    """D = 30 fp32 rows are not 16-byte aligned: the auto path must pick the loop and agree."""
    torch.manual_seed(1)
    counts_L = torch.tensor([4, 0, 6])
    a, w = torch.randn(10, 30), torch.randn(3, 30, 30)
    if grouped_gemm._GROUPED_MM is not None:
        assert not grouped_gemm._use_grouped_mm(a, w.transpose(-2, -1), wgrad=False, into=False)
    auto = experts.grouped_mm(a, w.transpose(-2, -1), counts_L)
    _force(monkeypatch, False)
    torch.testing.assert_close(auto, experts.grouped_mm(a, w.transpose(-2, -1), counts_L))


def test_expert_backward_paths_agree(monkeypatch):
    """The whole expert backward (saved vs recomputed activations) on both GEMM paths."""
    torch.manual_seed(2)
    counts_L = torch.tensor([6, 0, 9, 1])
    R, D, F = 16, 16, 8
    x = torch.randn(R, D)
    gate_up, down = torch.randn(4, 2 * F, D) * 0.3, torch.randn(4, D, F) * 0.3
    dy = torch.randn(R, D)
    outs = []
    for fused in ((True, False) if grouped_gemm._GROUPED_MM is not None else (False,)):
        _force(monkeypatch, fused)
        y, acts = experts.expert_forward(x, gate_up, down, counts_L)
        outs.append(experts.expert_backward(dy.clone(), x, gate_up, down, counts_L, acts))
        outs.append(experts.expert_backward(dy.clone(), x, gate_up, down, counts_L, None))
    for other in outs[1:]:
        for got, want in zip(other, outs[0]):
            torch.testing.assert_close(got, want)
    # autograd reference
    xr, gu, dn = (t.clone().requires_grad_(True) for t in (x, gate_up, down))
    ys, start = [], 0
    for l, n in enumerate(counts_L.tolist()):
        xe = xr[start : start + n]
        h = torch.nn.functional.silu(xe @ gu[l, :F].t()) * (xe @ gu[l, F:].t())
        ys.append(h @ dn[l].t())
        start += n
    torch.cat(ys).backward(dy)
    for got, want in zip(outs[0], (xr.grad, gu.grad, dn.grad)):
        torch.testing.assert_close(got, want)
