"""Work counters against what actually crossed the wire and the GEMM seam: forward and backward
all-to-all bytes (sent and received) and the rows every expert GEMM saw, for static and
static-recompute at world sizes 2 and 4."""

from __future__ import annotations

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from tests.helpers.layer import Recorder

CFG = dict(dim=16, ffn_dim=24, num_experts=6, top_k=2)


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
