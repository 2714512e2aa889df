"""Host time of every planner of the library, per call, from a small shape to paper scale.

    python benchmarks/bench_planning.py [--shapes 16x4,128x16,128x64,256x256] [--instances 4]
                                        [--repeats 5] [--cap 0.5] [--quick] [--out FILE]

Shapes are experts x ranks (E x W). Each instance: ``--tokens`` tokens per rank routed top-k
over a Zipf(``--zipf``) expert popularity (randomly permuted), static ownership plus 0-2
replicas of each expert on other random ranks (each expert on 1-3 ranks), and a binding
capacity of ``--cap`` x the mean pairs per rank (tokens x top-k) for the backward quotas.
Planners, as the layer calls them (``lrmoe.planning.planner``):

- ``max_min_quotas``: lrmoe's backward quotas (global counts, holders, the capacity);
- ``assign_min_peak``: the forward assignment of every pair to the holders, no capacity
  (``balance.min_peak_assignment`` on the placement's holder index, as the layer calls it);
- ``assign_min_peak_cap``: the backward assignment of the kept pairs (the quotas split over
  source ranks by largest remainder) under the capacity;
- ``assign_min_peak_dense``: ``balance.assign_min_peak``, the public dense form: the same
  assignment from plain holder lists, returned as an (E, S, R) tensor;
- ``holder_index``: a placement's holder index, built once per new placement and shared by
  every planner call on it (lrmoe's and symi's placements change once a step);
- ``plan_replicas``: replicas from the call's load, the layer's default slots (owned + half);
- ``localize``: topoep's re-matching of the forward assignment, 8 ranks per node;
- ``shadow_experts``: fastermoe's per-call decision (Qwen3-30B-A3B's D, F, bf16);
- ``laer_layout``: laer's per-call layout;
- ``flexmoe_replan``: flexmoe's greedy re-placement (between steps; ``--no-flexmoe`` skips it);
- ``strata``: a local selection's kept counts at one rank (``lrmoe.selection.strata.plan_strata``: the
  quotas' largest-remainder shares over sources, split over the forward's holders, in send
  order), once per lrmoe training call with the default selection (in its backward's plan).

One thread. Calls run interleaved (one call of every planner and instance per round, after a
warm-up round) and each row reports the median and p90 of the wall time over instances x
repeats, and the median of the thread's CPU time (less disturbed by other processes on a shared
machine), in ms: compare rows of one run rather than runs. JSON: {shape: {planner: figures}}.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch
from common import print_table, write_json

from lrmoe.planning.balance import assign_min_peak, min_peak_assignment
from lrmoe.planning.controller import max_min_quotas
from lrmoe.planning.holders import HolderIndex
from lrmoe.planning.placement import Placement, plan_replicas
from lrmoe.planning.strategies import CostModel, flexmoe_replan, laer_layout, localize, shadow_experts
from lrmoe.selection import largest_remainder
from lrmoe.selection.strata import plan_strata

PLANNERS = ["max_min_quotas", "assign_min_peak", "assign_min_peak_cap", "assign_min_peak_dense", "holder_index",
            "plan_replicas", "localize", "shadow_experts", "laer_layout", "flexmoe_replan", "strata"]
COST = CostModel(dim=2048, ffn_dim=768, elem_bytes=2)  # Qwen3-30B-A3B's routed experts, bf16
FLEXMOE_HORIZON = 10


def instance(E: int, W: int, seed: int, args: argparse.Namespace) -> dict:
    """One call's inputs for every planner (see the module docstring)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1) ** args.zipf
    popularity = rng.permutation(popularity / popularity.sum())
    counts_SE = torch.from_numpy(rng.multinomial(args.tokens * args.top_k, popularity, size=W).astype(np.int64))
    base = Placement.static(E, W)
    replicas: list[list[int]] = [[] for _ in range(W)]
    for e in range(E):
        owner = int(base.owner_E[e])
        others = [r for r in rng.permutation(W).tolist() if r != owner]
        for r in others[: int(rng.integers(0, 3))]:
            replicas[r].append(e)
    placement = base.with_replicas(replicas)
    holders = placement.holder_lists
    counts_E = counts_SE.sum(0)
    cap_R = [int(args.cap * args.tokens * args.top_k)] * W
    quota_E = max_min_quotas(counts_E, holders, cap_R)
    owned = [len(base.owned(r)) for r in range(W)]
    per_node = min(8, max(W // 2, 1))
    return dict(
        counts_SE=counts_SE, counts_E=counts_E, holders=holders, cap_R=cap_R, base=base, placement=placement,
        quota_E=quota_E,
        kept_ES=largest_remainder(quota_E, counts_SE).t().contiguous(),
        assignment=min_peak_assignment(counts_SE.t(), placement.holder_index),
        slots_R=[o + max(1, math.ceil(o / 2)) for o in owned],
        node_of=[r // per_node for r in range(W)],
    )


def calls(inst: dict) -> dict:
    """Planner name → a call on this instance."""
    return {
        "max_min_quotas": lambda: max_min_quotas(inst["counts_E"], inst["holders"], inst["cap_R"]),
        "assign_min_peak": lambda: min_peak_assignment(inst["counts_SE"].t(), inst["placement"].holder_index),
        "assign_min_peak_cap": lambda: min_peak_assignment(inst["kept_ES"], inst["placement"].holder_index,
                                                           inst["cap_R"]),
        "assign_min_peak_dense": lambda: assign_min_peak(inst["counts_SE"].t(), inst["holders"]),
        "holder_index": lambda: HolderIndex.build(inst["holders"], inst["placement"].world),
        "plan_replicas": lambda: plan_replicas(inst["base"], inst["counts_E"].to(torch.float64), inst["slots_R"]),
        "localize": lambda: localize(inst["assignment"], inst["node_of"]),
        "shadow_experts": lambda: shadow_experts(inst["counts_SE"], inst["base"], COST),
        "laer_layout": lambda: laer_layout(inst["counts_E"], inst["base"], inst["slots_R"]),
        "flexmoe_replan": lambda: flexmoe_replan(inst["placement"], inst["counts_E"].to(torch.float64),
                                                 inst["slots_R"], COST, FLEXMOE_HORIZON),
        "strata": lambda: plan_strata(inst["assignment"], inst["placement"], inst["counts_SE"], inst["quota_E"], 0),
    }


def bench_shape(E: int, W: int, args: argparse.Namespace, planners: list[str]) -> dict:
    fns = [calls(instance(E, W, args.seed + i, args)) for i in range(args.instances)]
    wall: dict[str, list[float]] = {p: [] for p in planners}
    cpu: dict[str, list[float]] = {p: [] for p in planners}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for fn in fns:
            for p in planners:
                c0, t0 = time.thread_time(), time.perf_counter()
                fn[p]()
                t1, c1 = time.perf_counter(), time.thread_time()
                if round_:
                    wall[p].append((t1 - t0) * 1e3)
                    cpu[p].append((c1 - c0) * 1e3)
    out = {}
    for p, ts in wall.items():
        ts.sort()
        out[p] = {"median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))],
                  "cpu_median_ms": statistics.median(cpu[p]), "calls": len(ts)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x4,128x16,128x64,256x256", help="ExW, comma-separated")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--cap", type=float, default=1.0, help="backward capacity per rank / (tokens x top-k)")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--no-flexmoe", action="store_true", help="leave flexmoe_replan out (slow at 256x256)")
    ap.add_argument("--quick", action="store_true", help="2 instances x 2 repeats, no flexmoe: seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write JSON {shape: {planner: {median_ms, p90_ms, cpu_median_ms, calls}}} here")
    args = ap.parse_args(argv)
    if args.quick:
        args.instances, args.repeats, args.no_flexmoe = 2, 2, True
    torch.set_num_threads(1)
    planners = [p for p in args.planners.split(",") if p and not (args.no_flexmoe and p == "flexmoe_replan")]
    unknown = sorted(set(planners) - set(PLANNERS))
    if unknown:
        raise SystemExit(f"unknown planners {unknown}; known: {PLANNERS}")

    rows: dict[str, dict] = {}
    for shape in args.shapes.split(","):
        E, W = (int(x) for x in shape.lower().split("x"))
        rows[f"{E}x{W}"] = bench_shape(E, W, args, planners)
    print(f"planner host time per call, ms (E x W; {args.tokens} tokens x top-{args.top_k} per rank, Zipf {args.zipf}, "
          f"1-3 holders, capacity {args.cap} x mean pairs; {args.instances} instances x {args.repeats} repeats, "
          f"1 thread)")
    for figure in ("median_ms", "p90_ms", "cpu_median_ms"):
        table = {p: {shape: r[p][figure] for shape, r in rows.items()} for p in planners}
        print_table(figure, table, list(rows))
    write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
