"""Calibrate the simulator's cost model on CPU and report its error on held-back shapes.

    python benchmarks/calibrate_sim.py [--repeats 7] [--out calib.json] [--store]

Runs real ``MoELayer`` forward+backward on CPU (one thread per rank, gloo on localhost for
world sizes 2 and 4, medians over interleaved iterations of the slowest rank) on a FIT set of
shapes, fits the cost model's rates by non-negative least squares, then predicts a different
HELD-BACK set (other shapes, systems and world sizes) with :func:`lrmoe.sim.cost.layer_seconds`
and prints predicted vs measured. The model gets the rows each rank really received (from the
layer's own routing), so only the rates are fitted, never the work.

Fitted terms (lrmoe.sim.cost): GEMM FLOPs / (peak·gemm_eff); elementwise and copy bytes /
(bw·mem_eff); per-expert GEMM call cost (CPU runs a grouped GEMM as one GEMM per expert);
gloo all-to-all α per message and 1/β per byte; a fixed cost per layer call (Python, autograd,
router). ``peak`` and ``bw`` are this machine's measured single-thread fp32 matmul rate and copy
bandwidth, so the efficiencies read as shares of what one core can do. ``--store`` writes the
fitted profile to src/lrmoe/sim/cpu_calibration.json with the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from common import run_ranks, write_json
from scipy.optimize import least_squares

from lrmoe.config import BackwardConfig, MoEConfig
from lrmoe.layer import MoELayer
from lrmoe.sim.cost import layer_seconds
from lrmoe.sim.hardware import CPU_CALIBRATION, Hardware
from lrmoe.sim.layer_calls import SystemPlanner
from lrmoe.sim.models import ModelSpec

# (name, world, system, ratio, tokens per rank, D, F, E, K)
FIT = [
    ("f1", 1, "static", 1.0, 1024, 128, 256, 8, 2),
    ("f2", 1, "static", 1.0, 2048, 256, 512, 16, 4),
    ("f3", 1, "lrmoe", 0.5, 2048, 256, 256, 16, 4),
    ("f4", 1, "static-recompute", 1.0, 1024, 256, 512, 8, 2),
    ("f5", 1, "lrmoe", 0.25, 512, 512, 256, 32, 4),
    ("f6", 2, "static", 1.0, 1024, 256, 512, 16, 4),
    ("f7", 2, "lrmoe", 0.5, 2048, 128, 256, 16, 4),
    ("f8", 2, "static", 1.0, 512, 128, 128, 8, 2),
    ("f9", 2, "static-recompute", 1.0, 2048, 192, 256, 16, 2),
]
HELD_BACK = [
    ("h1", 1, "static", 1.0, 1536, 192, 384, 12, 3),
    ("h2", 1, "lrmoe", 0.5, 1024, 384, 768, 8, 2),
    ("h3", 2, "static-recompute", 1.0, 1536, 256, 384, 16, 4),
    ("h4", 2, "lrmoe", 0.25, 1024, 256, 512, 32, 4),
    ("h5", 4, "static", 1.0, 1024, 256, 512, 16, 4),
    ("h6", 4, "lrmoe", 0.5, 512, 128, 256, 16, 4),
]


def _measure(group, args) -> dict:
    """One rank: repeats of forward+backward (barrier-aligned); local routing counts and stats."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    world, system, ratio, T, D, F, E, K, repeats = args
    cfg = MoEConfig(dim=D, ffn_dim=F, num_experts=E, top_k=K)
    torch.manual_seed(0)
    layer = MoELayer(cfg, system=system, group=group, backward=BackwardConfig("lrm", ratio=ratio))
    rank = layer.rank
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, D, generator=gen)
    g = torch.randn(T, D, generator=gen)
    times = []
    for i in range(repeats + 1):
        layer.zero_grad(set_to_none=True)
        if group is not None:
            dist.barrier(group)
        t0 = time.perf_counter()
        y = layer(x.requires_grad_(True))
        y.backward(g)
        if i:
            times.append(time.perf_counter() - t0)
    with torch.no_grad():
        ids = layer.router(x).ids_TK
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    return {"times": times, "counts_E": counts.tolist(), "recv": layer.last_stats["recv_rows"],
            "bwd": layer.last_stats["bwd_gemm_rows"]}


def measure(row: tuple, repeats: int) -> dict:
    name, world, system, ratio, T, D, F, E, K = row
    args = (world, system, ratio, T, D, F, E, K, repeats)
    ranks = [_measure(None, args)] if world == 1 else run_ranks(_measure, world, args)
    slowest = [max(r["times"][i] for r in ranks) for i in range(repeats)]  # ranks wait for each other
    return {"measured_s": statistics.median(slowest), "counts_SE": [r["counts_E"] for r in ranks]}


def layer_call(row: tuple, counts_SE: list[list[int]]):
    name, world, system, ratio, T, D, F, E, K = row
    spec = ModelSpec(name, D, F, E, K, 0, 1, "softmax")
    c_SE = np.asarray(counts_SE, dtype=np.int64)
    planner = SystemPlanner(system, spec.moe_config("float32"), world, ratio=ratio)
    return spec, planner.call(c_SE.sum(0), 4, counts_SE=c_SE)


PARAMS = ("gemm_rate", "mem_rate", "launch_s", "bw", "alpha", "call_s", "select_pair_s")


def hardware(x: np.ndarray, peak: float, bw: float, cores: int) -> Hardware:
    """The CPU profile for fitted parameters ``x`` (natural logs, so every rate stays positive)."""
    v = dict(zip(PARAMS, np.exp(x)))
    return Hardware(
        name="CPU, 1 thread per rank, gloo on localhost (fitted)", peak_flops=peak, mem_bw=bw,
        intra_bw=v["bw"], inter_bw=v["bw"], alpha_intra=v["alpha"], alpha_inter=v["alpha"], devices_per_node=64,
        gemm_eff=v["gemm_rate"] / peak, mem_eff=v["mem_rate"] / bw, launch_s=v["launch_s"], call_s=v["call_s"],
        select_pair_s=v["select_pair_s"], per_expert_gemm=True, cores=cores, host_overlaps=False,
    )


def predict_ms(row: dict, hw: Hardware) -> float:
    # host planning runs inside the measured layer time: it is part of call_s / select_pair_s here
    return layer_seconds(replace(row["_call"], host_s=0.0, deferred_host_s=0.0), row["_spec"], hw, 4)["total"] * 1e3


def microbench() -> tuple[float, float]:
    """This machine's single-thread fp32 matmul FLOP/s and copy bytes/s (medians)."""
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    flops = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        flops.append(2 * 1024**3 / (time.perf_counter() - t0))
    src = torch.randn(16 << 20)
    dst = torch.empty_like(src)
    bws = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        bws.append(2 * src.numel() * 4 / (time.perf_counter() - t0))
    return statistics.median(flops), statistics.median(bws)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cores", type=int, default=None, help="cores the ranks share (default: os.cpu_count())")
    ap.add_argument("--out", help="write JSON {fit, held_back, hardware} here")
    ap.add_argument("--measured", help="refit on the measurements of an earlier --out JSON (no timing runs)")
    ap.add_argument("--store", action="store_true", help=f"write the fitted profile to {CPU_CALIBRATION}")
    args = ap.parse_args(argv)
    import os

    cores = args.cores or os.cpu_count() or 1
    peak, bw = microbench()
    rows = {}
    before = json.loads(Path(args.measured).read_text())["rows"] if args.measured else None
    for group, shapes in (("fit", FIT), ("held_back", HELD_BACK)):
        for row in shapes:
            if before is not None:  # refit on earlier measurements
                m = {"measured_s": before[row[0]]["measured_ms"] / 1e3, "counts_SE": before[row[0]]["counts_SE"]}
            else:
                m = measure(row, args.repeats)
            spec, call = layer_call(row, m["counts_SE"])
            rows[row[0]] = {"set": group, "world": row[1], "system": row[2], "ratio": row[3], "tokens": row[4],
                            "D": row[5], "F": row[6], "E": row[7], "K": row[8], "measured_ms": m["measured_s"] * 1e3,
                            "counts_SE": m["counts_SE"], "_spec": spec, "_call": call}
            print(f"measured {row[0]}: {m['measured_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    fit = [r for r in rows.values() if r["set"] == "fit"]

    def residuals(x: np.ndarray) -> np.ndarray:  # relative: every shape counts alike, whatever its size
        hw = hardware(x, peak, bw, cores)
        return np.array([predict_ms(r, hw) / r["measured_ms"] - 1 for r in fit])

    # start: the microbenchmarks' rates, 10 us per GEMM call, 1 GB/s and 50 us for gloo, 1 ms per call
    x0 = np.log([peak, bw, 1e-5, 1e9, 5e-5, 1e-3, 1e-7])
    lo = np.log([peak / 100, bw / 100, 1e-9, 1e6, 1e-9, 1e-9, 1e-12])
    hi = np.log([peak * 10, bw * 10, 1e-2, 1e12, 1e-1, 1.0, 1e-3])
    x = least_squares(residuals, x0, bounds=(lo, hi)).x
    hw = hardware(x, peak, bw, cores)
    for r in rows.values():
        pred = predict_ms(r, hw)
        r["predicted_ms"] = pred
        r["error_pct"] = 100 * (pred - r["measured_ms"]) / r["measured_ms"]
    print(f"CPU cost model fitted on {len(fit)} shapes; matmul peak {peak / 1e9:.1f} GFLOP/s, copy "
          f"{bw / 1e9:.1f} GB/s (one thread); gemm_eff {hw.gemm_eff:.3f} mem_eff {hw.mem_eff:.3f} "
          f"per-expert GEMM {hw.launch_s * 1e6:.1f} us, gloo alpha {hw.alpha_intra * 1e6:.1f} us "
          f"beta {hw.intra_bw / 1e9:.2f} GB/s, per call {hw.call_s * 1e3:.2f} ms, selection "
          f"{hw.select_pair_s * 1e6:.2f} us/pair; {cores} cores")
    head = f"{'row':<4}{'set':<10}{'W':>3} {'system':<17}{'ratio':>6}{'T':>6}{'D':>5}{'F':>5}{'E':>4}{'K':>3}" \
           f"{'measured ms':>13}{'predicted ms':>14}{'error %':>9}"
    print(head)
    for name, r in rows.items():
        print(f"{name:<4}{r['set']:<10}{r['world']:>3} {r['system']:<17}{r['ratio']:>6.2f}{r['tokens']:>6}{r['D']:>5}"
              f"{r['F']:>5}{r['E']:>4}{r['K']:>3}{r['measured_ms']:>13.1f}{r['predicted_ms']:>14.1f}"
              f"{r['error_pct']:>+9.1f}")
    held = [abs(r["error_pct"]) for r in rows.values() if r["set"] == "held_back"]
    print(f"held-back: max |error| {max(held):.1f} %, all within ±25 %: {max(held) <= 25}")
    public = {n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in rows.items()}
    doc = {"date": datetime.date.today().isoformat(), "hardware": hw.to_dict(), "rows": public,
           "held_back_max_abs_error_pct": max(held), "repeats": args.repeats,
           "command": "python benchmarks/calibrate_sim.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    write_json(args.out, doc)
    if args.store:
        Path(CPU_CALIBRATION).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"stored {CPU_CALIBRATION}")
    return doc


if __name__ == "__main__":
    main()
