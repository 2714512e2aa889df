"""The simulator against measured runs: per system, the MoE ms a step ``lrmoe simulate``'s cost
model predicts from a run's own model, ranks, link, GEMM rate and routing, beside what the run
measured.

    python benchmarks/sim_check.py runs/emu-paper/seed-0/cap-0.65x [more folders] [--every 5] [--out FILE]

Each folder is a run (``config.toml``, ``metrics.jsonl``, ``routing.npz``) or holds runs. Per run
the simulator's pieces (``lrmoe.sim``: :class:`~lrmoe.sim.layer_calls.SystemPlanner` plans each
call with the library's own planner, :func:`~lrmoe.sim.cost.layer_seconds` costs it) are given:

- the model's shape (fp32) and the run's ranks;
- the CPU calibration (``sim/cpu_calibration.json``) with the grouped-GEMM rate the run measured
  before launch (``cluster.gemm_gflops``: ``gemm_eff`` scaled to it; ``--gemm-gflops`` for runs
  without one), and the link: a rank's share of its node's (``budget.inter_node_gbps``) across
  ``budget.ranks_per_node`` ranks a node; none (the calibration's loopback) on the loopback;
- the run's memory cap, capacity factor, network budget and selection, and for lrmoe the kept
  ratio its noise objective chose per layer and step (``trim_ratio``);
- the run's routing (``routing.npz``: global counts per step and layer, spread evenly over the
  source ranks).

Measured: the median over the steps of ``moe_fwd_ms + moe_bwd_ms + moe_placement_ms``; predicted:
the median of the same steps (every ``--every``-th after the first). Prints a table and the
predicted split by phase; JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from common import print_table, write_json

from lrmoe.memory.bytes import ByteModel
from lrmoe.sim.cost import PHASES, layer_seconds
from lrmoe.sim.hardware import CPU_CALIBRATION, Hardware
from lrmoe.sim.layer_calls import SystemPlanner
from lrmoe.sim.models import ModelSpec
from lrmoe.sim.trace import load_trace
from lrmoe.systems import spec_of
from lrmoe.train.config import RunConfig, load
from lrmoe.train.metrics import read_metrics

ELEM = 4  # fp32: the testbed trains in float32


def runs_in(folder: Path) -> list[Path]:
    if (folder / "metrics.jsonl").exists():
        return [folder]
    return sorted(p for p in folder.iterdir() if (p / "metrics.jsonl").exists() and (p / "routing.npz").exists())


def hardware(cfg: RunConfig, gemm_gflops: float | None) -> Hardware:
    """The CPU calibration at the run's GEMM rate and link (module docstring)."""
    hw = Hardware(**json.loads(CPU_CALIBRATION.read_text())["hardware"])
    gemm = cfg.cluster.gemm_gflops or gemm_gflops
    if gemm:
        hw = replace(hw, gemm_eff=gemm * 1e9 / hw.peak_flops)
    budget, world = cfg.budget, cfg.train.ep_size or cfg.train.nproc
    per_node = budget.ranks_per_node if budget is not None and budget.ranks_per_node else world
    hw = replace(hw, devices_per_node=per_node)
    if cfg.cluster.emulated and budget.inter_node_gbps:
        hw = hw.with_link_gbps(budget.inter_node_gbps)
    return hw


def predict(run: Path, every: int, gemm_gflops: float | None) -> dict:
    """One run's measured and predicted MoE ms a step (medians over the same steps)."""
    cfg = load(run / "config.toml")
    m, moe, t = cfg.model, cfg.model.moe, cfg.train
    world = t.ep_size or t.nproc
    spec = ModelSpec(run.name, m.dim, moe.ffn_dim, moe.num_experts, moe.top_k,
                     (moe.shared_ffn_dim or moe.ffn_dim) if moe.num_shared_experts else 0,
                     m.n_layers - m.first_dense_layers, moe.router)
    budget = cfg.budget
    pairs = t.batch * m.seq_len * moe.top_k * world
    network = None
    if budget is not None and budget.memory_bytes and spec_of(t.system).selective:
        if budget.network_bytes is not None:
            network = budget.network_bytes
        elif budget.network_fraction is not None:
            network = int(budget.network_fraction * math.ceil(pairs / world) * ByteModel.of(moe).bwd_wire)
    planners = [SystemPlanner(t.system, spec.moe_config("float32"), world,
                              memory_bytes=budget.memory_bytes if budget is not None else None,
                              capacity_factor=t.capacity_factor, selection=cfg.backward.selection,
                              network_bytes=network, backward=cfg.backward,
                              link_gbps=budget.inter_node_gbps if budget is not None else None)
                for _ in range(spec.moe_layers)]
    hw, counts = hardware(cfg, gemm_gflops), load_trace(run / "routing.npz")
    records = {r["step"]: r for r in read_metrics(run) if "moe_fwd_ms" in r}
    steps = [s for s in sorted(records) if s >= 2 and (s - 2) % every == 0 and s <= counts.shape[0]]
    predicted, measured, phases = [], [], {p: 0.0 for p in PHASES}
    for step in sorted(records):
        if step - 1 >= counts.shape[0]:
            break
        trim = records[step].get("trim_ratio")
        total = 0.0
        for layer, p in enumerate(planners):  # every step planned (replicas follow the load), costed where sampled
            if trim is not None and p.planner.noise is not None:
                p.planner.noise.ratio = trim[layer]
            call = p.call(counts[step - 1, layer], ELEM)
            if step in steps:
                seconds = layer_seconds(call, spec, hw, ELEM)
                total += seconds["total"]
                for ph in PHASES:
                    phases[ph] += seconds[ph] * 1e3 / len(steps)
        if step in steps:
            r = records[step]
            predicted.append(total * 1e3)
            measured.append(r["moe_fwd_ms"] + r["moe_bwd_ms"] + r.get("moe_placement_ms", 0.0))
    got, want = statistics.median(measured), statistics.median(predicted)
    link = budget.inter_node_gbps if cfg.cluster.emulated and budget is not None else None
    return {"system": run.name, "link_gbps_a_rank": link, "measured_ms": got, "predicted_ms": want,
            "error": want / got - 1, "steps": len(steps),
            **{f"{ph}_ms": phases[ph] for ph in PHASES if phases[ph]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--every", type=int, default=5, help="cost every this many steps (all are planned)")
    ap.add_argument("--gemm-gflops", type=float, help="the GEMM rate of runs whose config has none (loopback)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = {}
    for folder in a.folders:
        for run in runs_in(folder):
            row = predict(run, a.every, a.gemm_gflops)
            rows[f"{folder.name}/{run.name}" if len(a.folders) > 1 else run.name] = row
            print(f"{run}: measured {row['measured_ms']:.0f} ms, predicted {row['predicted_ms']:.0f} ms "
                  f"({row['error']:+.0%})", flush=True)
    print_table("MoE ms a step: measured against the simulator's prediction", rows,
                ["link_gbps_a_rank", "measured_ms", "predicted_ms", "error", "fwd_a2a_ms", "bwd_a2a_ms",
                 "fwd_compute_ms", "bwd_compute_ms", "replicas_ms"])
    write_json(a.out, rows)


if __name__ == "__main__":
    main()
