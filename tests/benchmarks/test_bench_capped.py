"""benchmarks/bench_capped.py: the expert order of the router offsets (a seeded random order by
default, sorted with ``--worst-case``), the hot rank's share of the routed rows it reports, and a
tiny run of the script on 2 gloo ranks."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from tests.helpers.benchmarks import BENCH, import_script


@pytest.fixture(scope="module")
def bench():
    return import_script("bench_capped")


def offsets(bench, order_seed, experts=16):
    torch.manual_seed(0)
    return bench.router_offsets(experts, order_seed)


def test_router_offsets_order(bench):
    worst = offsets(bench, None)
    assert torch.equal(worst, worst.sort(descending=True).values), "--worst-case: expert 0 the hottest, then 1, ..."
    rand = offsets(bench, 0)
    assert torch.equal(rand.sort(descending=True).values, worst), "the same offsets, in another order"
    assert not torch.equal(rand, worst)
    assert torch.equal(offsets(bench, 0), rand), "seeded: the same order again"
    assert not torch.equal(offsets(bench, 1), rand), "another --order-seed, another order"


def test_block_shares(bench):
    assert bench.block_shares(torch.tensor([5, 3, 1, 1]), 2) == [0.8, 0.2]
    assert bench.block_shares(torch.tensor([1, 1, 1, 2, 5]), 2) == [0.3, 0.7], "5 experts: rank 0 holds 3"
    assert bench.hot_share([30, 10]) == 0.75 and bench.hot_share([0, 0]) is None


def test_worst_case_puts_the_hot_experts_on_rank_0(bench):
    """The routing of the benchmark's default shape at --skew 1.2 (one process, the whole layer):
    sorted offsets send most rows to rank 0's block; seeded random orders spread them more."""
    cfg = MoEConfig(dim=256, ffn_dim=512, num_experts=16, top_k=4)

    def routed(worst_case: bool, order_seed: int = 0) -> torch.Tensor:
        args = argparse.Namespace(seed=0, skew=1.2, tokens=1024, order_seed=order_seed, worst_case=worst_case)
        full, x, _ = bench.skewed_problem(cfg, args, 0)
        layer = MoELayer(cfg)
        layer.load_full_state_dict(full)
        with torch.no_grad():
            layer(x)
        return layer.last_stats["counts_E"]

    worst = bench.block_shares(routed(True), 2)
    assert worst[0] > 0.85, worst
    spread = [max(bench.block_shares(routed(False, s), 2)) for s in range(4)]
    assert all(r < worst[0] for r in spread), (spread, worst)


def test_bench_capped_tiny_run(bench, tmp_path, monkeypatch):
    """Both orders through the script: its JSON names the order and the hot rank's share; static
    receives exactly its blocks' rows, so its share is the routing's; every share in [1/2, 1]."""
    monkeypatch.syspath_prepend(str(BENCH))  # the spawned ranks import the script's module
    small = ["--tokens", "64", "--dim", "32", "--ffn", "32", "--experts", "8", "--top-k", "2", "--repeats", "1",
             "--skew", "1.2"]
    for extra, order, seed in (([], "random", 0), (["--worst-case"], "worst-case", None)):
        out = tmp_path / f"{order}.json"
        rows = bench.main([*small, *extra, "--out", str(out)])
        doc = json.loads(out.read_text())
        meta = doc["meta"]
        assert (meta["order"], meta["order_seed"]) == (order, seed)
        assert rows["static"]["hot_rank_share"] == pytest.approx(meta["hot_rank_share"])
        for name, row in rows.items():
            assert "oom" in row or 0.5 <= row["hot_rank_share"] <= 1.0, (name, row)
        assert doc["static"] == json.loads(json.dumps(rows["static"]))
    with pytest.raises(SystemExit):
        bench.main([*small, "--worst-case", "--order-seed", "3"])  # one order or the other
