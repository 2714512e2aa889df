"""Work counters against what actually crossed the wire and the GEMM seam; the grouped-GEMM
seam's two paths against each other."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lrmoe import MoEConfig, MoELayer, experts

CFG = dict(dim=16, ffn_dim=24, num_experts=6, top_k=2)


class Recorder:
    """Wraps ``dist.all_to_all_single`` and the two seam functions, logging what they carried."""

    def __init__(self, monkeypatch, rank: int) -> None:
        self.a2a: list[tuple[int, int]] = []  # (bytes sent to others, bytes received from others)
        self.gemm_rows: list[tuple[str, int]] = []
        real_a2a, real_mm, real_wgrad = dist.all_to_all_single, experts.grouped_mm, experts.grouped_mm_wgrad

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            shaped = input if input.shape[0] else output  # a rank may send nothing yet receive
            row = shaped[0:1].numel() * shaped.element_size() if shaped.shape[0] else 0
            sent = (sum(input_split_sizes) - input_split_sizes[rank]) * row
            recv = (sum(output_split_sizes) - output_split_sizes[rank]) * row
            self.a2a.append((sent, recv))
            return real_a2a(output, input, output_split_sizes, input_split_sizes, group=group,
                            async_op=async_op)

        def mm(a, b, counts, *args, **kwargs):
            self.gemm_rows.append(("mm", a.shape[0]))
            assert int(counts.sum()) == a.shape[0]
            return real_mm(a, b, counts, *args, **kwargs)

        def wgrad(a, b, counts, *args, **kwargs):
            self.gemm_rows.append(("wgrad", a.shape[0]))
            return real_wgrad(a, b, counts, *args, **kwargs)

        monkeypatch.setattr(dist, "all_to_all_single", a2a)
        monkeypatch.setattr(experts, "grouped_mm", mm)
        monkeypatch.setattr(experts, "grouped_mm_wgrad", wgrad)

    def take(self) -> tuple[list, list]:
        out = (self.a2a, self.gemm_rows)
        self.a2a, self.gemm_rows = [], []
        return out


def counter_case(group, system: str):
    from lrmoe.parallel import comm

    mp = pytest.MonkeyPatch()
    try:
        rank, world = comm.rank_of(group), comm.world_size(group)
        rec = Recorder(mp, rank)
        cfg = MoEConfig(**CFG)
        torch.manual_seed(0)
        sd = MoELayer(cfg).state_dict()
        layer = MoELayer(cfg, system=system, group=group)
        layer.load_full_state_dict(sd)
        torch.manual_seed(100 + rank)
        x = torch.randn(10 + 3 * rank, cfg.dim, requires_grad=True)
        out = layer(x)
        a2a, rows = rec.take()
        s = layer.last_stats
        assert s["fwd_a2a_bytes"] == sum(a for a, _ in a2a)
        assert s["fwd_a2a_recv_bytes"] == sum(r for _, r in a2a)
        # Independent count: E int64 counts to every peer, then every row sent away and back.
        my_pairs_E = torch.bincount(layer_ids(layer, x), minlength=cfg.num_experts)
        owned = set(layer.placement.owned(rank))
        local_pairs = sum(int(my_pairs_E[e]) for e in owned)
        remote_pairs = int(my_pairs_E.sum()) - local_pairs
        row = cfg.dim * 4
        # counts to every peer, my rows to remote experts, and the outputs my experts computed
        # for other ranks' rows going back
        expected = (world - 1) * cfg.num_experts * 8 + (remote_pairs + s["recv_rows"] - local_pairs) * row
        assert s["fwd_a2a_bytes"] == expected, (s["fwd_a2a_bytes"], expected)
        # Forward GEMMs (gate, up, down) each saw exactly the received rows.
        assert [r for kind, r in rows] == [s["recv_rows"]] * 3

        out.backward(torch.randn_like(out))
        a2a, rows = rec.take()
        s = layer.last_stats
        assert s["bwd_a2a_bytes"] == sum(a for a, _ in a2a)
        assert s["bwd_a2a_recv_bytes"] == sum(r for _, r in a2a)
        # Full backward: dy to the experts and dx back, the same rows as the forward.
        assert s["bwd_a2a_bytes"] == s["fwd_a2a_bytes"] - (world - 1) * cfg.num_experts * 8
        n_mm = 3 if system == "static" else 5  # dh, dx(gate), dx(up) (+ gate, up recomputed)
        assert sorted(kind for kind, _ in rows) == ["mm"] * n_mm + ["wgrad"] * 3
        assert all(r == s["recv_rows"] for _, r in rows)
        return s["recv_rows"]
    finally:
        mp.undo()


def layer_ids(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return layer.router(x).ids_TK.flatten()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("system", ["static", "static-recompute"])
def test_counters_match_wire_and_gemms(pool, world, system):
    recv = pool.run(world, counter_case, system)
    assert sum(recv) == sum(10 + 3 * r for r in range(world)) * CFG["top_k"]


# ------------------------------------------------------------------- grouped-GEMM seam


def _force(monkeypatch, fused: bool) -> None:
    monkeypatch.setattr(experts, "_use_grouped_mm", lambda a, b, wgrad, into: fused)


@pytest.mark.skipif(experts._GROUPED_MM is None, reason="torch without _grouped_mm")
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
    if experts._GROUPED_MM is not None:
        assert not experts._use_grouped_mm(a, w.transpose(-2, -1), wgrad=False, into=False)
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
    for fused in ((True, False) if experts._GROUPED_MM is not None else (False,)):
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
