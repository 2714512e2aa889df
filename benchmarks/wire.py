"""Bytes on the wire a step, per system, from runs' ``metrics.jsonl``: what crosses the links.

    python benchmarks/wire.py runs/emu-paper/seed-0/cap-0.65x [more folders] [--out FILE]

Each folder is a run or holds runs (a compare's system folders). Per run, the median over its
steps after the first of the all-to-all bytes a rank sends (``a2a_bytes``, forward and backward, ÷
the ranks), the part that crossed nodes (``a2a_inter_bytes``, where the run has a topology), the
backward's part, and the expert parameters moved for replicas (``placement_bytes``), in MB a rank;
beside them the run's MoE ms a step (``moe_fwd_ms + moe_bwd_ms + moe_placement_ms``, median) and
the mean kept ratio. Exact counters: the same on every machine, unlike the times.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from common import print_table, write_json

from lrmoe.train.config import load
from lrmoe.train.metrics import read_metrics


def runs_in(folder: Path) -> list[Path]:
    if (folder / "metrics.jsonl").exists():
        return [folder]
    return sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").exists())


def wire(run: Path) -> dict:
    cfg = load(run / "config.toml")
    ranks = cfg.train.nproc
    steps = [r for r in read_metrics(run) if "a2a_bytes" in r and r["step"] > 1]

    def mb(key: str) -> float | None:
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) / ranks / 1e6 if values else None

    return {"a2a_mb": mb("a2a_bytes"), "inter_node_mb": mb("a2a_inter_bytes"), "bwd_mb": mb("bwd_a2a_bytes"),
            "placement_mb": mb("placement_bytes"), "kept": statistics.mean(r["kept_ratio"] for r in steps),
            "moe_ms": statistics.median(r["moe_fwd_ms"] + r["moe_bwd_ms"] + r.get("moe_placement_ms", 0.0)
                                        for r in steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = {}
    for folder in a.folders:
        for run in runs_in(folder):
            rows[f"{folder.name}/{run.name}" if len(a.folders) > 1 else run.name] = wire(run)
    print_table("MB a rank sends a step (medians), kept ratio and MoE ms a step", rows,
                ["a2a_mb", "inter_node_mb", "bwd_mb", "placement_mb", "kept", "moe_ms"])
    write_json(a.out, rows)


if __name__ == "__main__":
    main()
