"""What ``[cluster]`` changes before launch: its checks, the paper link's arithmetic, the link's
tc commands, and the budgets that follow the link (an explicit setting winning)."""

from __future__ import annotations

import os

import pytest

from lrmoe.emulation.budgets import resolve_cluster
from lrmoe.emulation.config import PAPER, parse_link_gbps
from lrmoe.emulation.namespaces import Link
from lrmoe.emulation.paper_link import PAPER_RATIO, paper_link_gbps
from lrmoe.train.config import ConfigError, from_dict
from tests.helpers.train import TINY, config_file, one_line_error, run_main

root = pytest.mark.skipif(os.geteuid() != 0, reason="resolving checks the namespaces, which need root")


def cfg_with(cluster: dict, budget: dict | None = None, **train):
    raw = {**TINY, "train": {**TINY["train"], **train}, "cluster": cluster}
    if budget:
        raw["budget"] = budget
    return from_dict(raw)


@pytest.mark.parametrize(("cluster", "message"), [
    ({"emulate_nodes": -1}, "cluster.emulate_nodes=-1"),
    ({"emulate_nodes": 101}, "at most 100"),
    ({"emulate_nodes": 2, "link_gbps": 0}, "cluster.link_gbps=0"),
    ({"emulate_nodes": 2, "link_gbps": "fast"}, "cluster.link_gbps='fast'"),
    ({"emulate_nodes": 2, "link_gbps": float("inf")}, "cluster.link_gbps=inf"),
    ({"emulate_nodes": 2, "link_latency_us": -5}, "cluster.link_latency_us=-5"),
    ({"emulate_nodes": 2, "gemm_gflops": 0}, "cluster.gemm_gflops=0"),
    ({"link_gbps": 1.0}, "need cluster.emulate_nodes"),
    ({"emulate_nodes": 2, "hops": 3}, "unknown keys ['hops']"),
])
def test_cluster_table_checks(cluster, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cfg_with(cluster)


def test_link_flag():
    assert parse_link_gbps("paper") == PAPER and parse_link_gbps("0.25") == 0.25
    with pytest.raises(ConfigError, match="--link-gbps='1gbit' is invalid"):
        parse_link_gbps("1gbit")


def test_paper_ratio_arithmetic():
    """Qwen3-30B-A3B: 2,304 FLOP a dispatched bf16 byte; 300 TFLOP/s behind 400 Gbit/s sends a byte
    per 6,000 FLOP; so the dispatch takes 6000/2304 of the forward GEMMs. On the testbed (fp32,
    F = 512) at 52 GFLOP/s the rank's link sending a row in that ratio of its GEMM time:"""
    assert pytest.approx(6000 / 2304) == PAPER_RATIO
    gbps = paper_link_gbps(256, 512, 4, 52.0)
    row_s, gemm_s = 256 * 4 * 8 / (gbps * 1e9), 6 * 256 * 512 / 52e9
    assert row_s / gemm_s == pytest.approx(PAPER_RATIO)
    assert gbps == pytest.approx(0.208, abs=1e-3)
    assert paper_link_gbps(256, 512, 4, 52.0, ranks_per_node=2) == pytest.approx(2 * gbps)


def test_link_qdiscs():
    assert Link().qdisc_commands("eth0") == []
    (tbf,) = Link(0.2).qdisc_commands("eth0")
    assert tbf[:6] == ["tc", "qdisc", "add", "dev", "eth0", "root"] and tbf[6:9] == ["tbf", "rate", "200000000bit"]
    assert int(tbf[tbf.index("burst") + 1]) == 64 * 1024  # 1 ms at 0.2 Gbit/s is less than the least burst
    netem, tbf = Link(2.0, 100).qdisc_commands("n0")
    assert netem[netem.index("delay") + 1] == "50.000us", "half the one-way latency at each end of a link"
    assert tbf[5:9] == ["parent", "1:1", "handle", "10:"] and int(tbf[tbf.index("burst") + 1]) == 250_000


@root
def test_budgets_follow_the_link():
    """Under a cap: the topology, each rank's share of its node's link, and lrmoe's network budget
    (≥ 1: a balanced rank's backward never trimmed for the link) from the link; what [budget]
    sets wins; a topology that contradicts the nodes is refused."""
    capped = {"memory_bytes": 10_000_000}
    cfg = resolve_cluster(cfg_with({"emulate_nodes": 2, "link_gbps": 0.01, "gemm_gflops": 50.0}, capped, nproc=4))
    b = cfg.budget
    assert (b.ranks_per_node, b.inter_node_gbps, b.memory_bytes) == (2, 0.005, 10_000_000)
    # backward GEMMs of a pair 16·32·32 FLOP at 50 GFLOP/s against its 3·32·4 bytes at 5 Mbit/s
    assert b.network_fraction == 1.0  # the link is far slower: never below a balanced rank's bytes
    fast = resolve_cluster(cfg_with({"emulate_nodes": 2, "link_gbps": 100.0, "gemm_gflops": 1.0}, capped))
    expected = (16 * 32 * 32 / 1e9) / (3 * 32 * 4 * 8 / 100e9)
    assert fast.budget.network_fraction == pytest.approx(expected, rel=1e-3) and expected > 1
    assert resolve_cluster(fast) == fast, "resolving twice changes nothing"
    mine = resolve_cluster(cfg_with({"emulate_nodes": 2, "link_gbps": 1.0, "gemm_gflops": 50.0},
                                    {**capped, "inter_node_gbps": 7.0, "network_bytes": 1_000_000}))
    assert (mine.budget.inter_node_gbps, mine.budget.network_bytes, mine.budget.network_fraction) == (7.0, 1_000_000,
                                                                                                      None)
    unshaped = resolve_cluster(cfg_with({"emulate_nodes": 2}))
    assert (unshaped.budget.ranks_per_node, unshaped.budget.inter_node_gbps) == (1, None)
    paper = resolve_cluster(cfg_with({"emulate_nodes": 1, "link_gbps": PAPER, "gemm_gflops": 52.0}))
    assert paper.cluster.link_gbps == float(f"{paper_link_gbps(32, 32, 4, 52.0, 2):.2g}")
    assert paper.budget.ranks_per_node == 2
    with pytest.raises(ConfigError, match="budget.ranks_per_node=2 contradicts --emulate-nodes=2"):
        resolve_cluster(cfg_with({"emulate_nodes": 2}, {"ranks_per_node": 2}))
    with pytest.raises(ConfigError, match="--emulate-nodes=3 is invalid: it must divide --nproc=2"):
        resolve_cluster(cfg_with({"emulate_nodes": 3}))


@root
def test_topology_systems_take_the_emulated_nodes(tmp_path, monkeypatch):
    """topoep needs a topology: emulated nodes give it, before its layers are checked (without
    them, one line)."""
    assert "needs the topology" in one_line_error(run_main("train", "--config", config_file(tmp_path), "--system",
                                                           "topoep", "--out", tmp_path / "a"))
    launched = []

    def fake_launch(cfg, out, **kw):
        launched.append(cfg)
        return {"val": [], "steps": 0, "unigram_loss": 0.0, "moe_time_s": 0.0}

    monkeypatch.setattr("lrmoe.cli.launch", fake_launch)
    r = run_main("train", "--config", config_file(tmp_path), "--system", "topoep", "--emulate-nodes", "2",
                 "--out", tmp_path / "b")
    assert r.returncode == 0, r.stderr
    assert launched[0].budget.ranks_per_node == 1 and launched[0].cluster.emulate_nodes == 2


def test_emulation_and_a_real_rendezvous_exclude_each_other(tmp_path):
    r = run_main("train", "--config", config_file(tmp_path), "--emulate-nodes", "2", "--nnodes", "2", "--node-rank",
                 "0", "--rdzv-endpoint", "h:1")
    assert "--emulate-nodes and the rendezvous flags exclude each other" in one_line_error(r)


def test_a_resumed_run_reads_the_rate_it_measured(tmp_path):
    """``--resume`` takes ``cluster.gemm_gflops`` from the run's resolved config (so its link and
    budgets, and compare's check of a finished run's config, are those of the first launch)."""
    from lrmoe.emulation.budgets import measured_gemm_gflops
    from lrmoe.train.toml_dump import dump_toml

    assert measured_gemm_gflops(tmp_path) is None
    run = tmp_path / "seed-0" / "cap-0.65x" / "static"
    run.mkdir(parents=True)
    (run / "config.toml").write_text(dump_toml(cfg_with({"emulate_nodes": 2, "gemm_gflops": 37.0}).to_dict()))
    assert measured_gemm_gflops(tmp_path) == 37.0
