"""benchmarks/wire.py and benchmarks/sim_check.py on made-up runs: the bytes a rank sends a step
from the counters, and the simulator costing a run at the run's own link and GEMM rate."""

from __future__ import annotations

import json

import numpy as np

from lrmoe.train.config import from_dict
from lrmoe.train.toml_dump import dump_toml
from tests.helpers.benchmarks import import_script
from tests.helpers.train import TINY


def write_run(folder, cluster: dict | None, budget: dict | None = None, system: str = "static") -> None:
    raw = {**TINY, "train": {**TINY["train"], "system": system}}
    if cluster:
        raw["cluster"] = cluster
    if budget:
        raw["budget"] = budget
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(dump_toml(from_dict(raw).to_dict()))
    records = [{"step": s, "loss": 1.0, "moe_fwd_ms": 10.0 * s, "moe_bwd_ms": 20.0, "moe_placement_ms": 0.0,
                "a2a_bytes": 4_000_000 * s, "bwd_a2a_bytes": 2_000_000, "a2a_inter_bytes": 1_000_000,
                "placement_bytes": 0, "kept_ratio": 1.0} for s in range(1, 8)]
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)) + "\n")
    counts = np.tile(np.array([40.0, 20.0, 10.0, 10.0]), (7, 2, 1))  # 2 ranks × 4 tokens × 32 positions × top-2
    counts *= (2 * 4 * 32 * 2) / counts[0, 0].sum()
    np.savez(folder / "routing.npz", counts=counts)


def test_wire_reads_a_ranks_bytes_a_step(tmp_path):
    wire = import_script("wire")
    write_run(tmp_path / "static", None, {"ranks_per_node": 1})
    row = wire.wire(tmp_path / "static")
    # steps 2..7: a2a_bytes 8e6..28e6, median 18e6, over 2 ranks
    assert row["a2a_mb"] == 9.0 and row["inter_node_mb"] == 0.5 and row["bwd_mb"] == 1.0
    assert row["moe_ms"] == 65.0 and row["kept"] == 1.0


def test_sim_check_costs_a_run_at_its_own_link(tmp_path):
    sim_check = import_script("sim_check")
    write_run(tmp_path / "fast", {"emulate_nodes": 2, "link_gbps": 1.0, "gemm_gflops": 40.0},
              {"ranks_per_node": 1, "inter_node_gbps": 1.0})
    write_run(tmp_path / "slow", {"emulate_nodes": 2, "link_gbps": 0.01, "gemm_gflops": 40.0},
              {"ranks_per_node": 1, "inter_node_gbps": 0.01})
    fast, slow = (sim_check.predict(tmp_path / name, every=1, gemm_gflops=None) for name in ("fast", "slow"))
    assert fast["measured_ms"] == slow["measured_ms"] == 65.0 and fast["steps"] == 6
    assert fast["link_gbps_a_rank"] == 1.0 and slow["link_gbps_a_rank"] == 0.01
    # the rows' time on the link grows a hundredfold, the messages' fixed cost stays
    assert slow["fwd_a2a_ms"] > 5 * fast["fwd_a2a_ms"] and slow["bwd_a2a_ms"] > 5 * fast["bwd_a2a_ms"]
    assert slow["fwd_compute_ms"] == fast["fwd_compute_ms"] > 0
    assert slow["error"] == slow["predicted_ms"] / 65.0 - 1
