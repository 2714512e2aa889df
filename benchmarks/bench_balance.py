"""Time of the integer min-peak assignment at paper scale, and a check that it is optimal.

    python benchmarks/bench_balance.py [--experts 128 --ranks 64 --tokens 4096 --top-k 8]
                                       [--instances 20 --repeats 5] [--check 5] [--out FILE]

Each instance: per-rank routing counts (``--tokens`` tokens per rank, top-k, Zipf-skewed expert
popularity with exponent ``--zipf``), every expert held by 1–4 random ranks. Reports the median
and p90 time of ``assign_min_peak`` (one thread), and for the first ``--check`` instances the
peak against an independent exact optimum (binary search over the peak with networkx max-flow).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from common import print_table, write_json

from lrmoe.planning.balance import assign_min_peak


def instance(rng: np.random.Generator, args: argparse.Namespace):
    popularity = 1.0 / np.arange(1, args.experts + 1) ** args.zipf
    popularity = rng.permutation(popularity / popularity.sum())
    counts = rng.multinomial(args.tokens * args.top_k, popularity, size=args.ranks).T  # (E, S)
    holders = [sorted(rng.choice(args.ranks, size=rng.integers(1, 5), replace=False).tolist())
               for _ in range(args.experts)]
    return torch.from_numpy(counts.astype(np.int64)), holders


def exact_peak(counts: torch.Tensor, holders) -> int:
    import networkx as nx

    n = counts.sum(1).tolist()
    R = counts.shape[1]

    def feasible(P: int) -> bool:
        g = nx.DiGraph()
        for e, k in enumerate(n):
            if k:
                g.add_edge("s", ("e", e), capacity=k)
                for r in holders[e]:
                    g.add_edge(("e", e), ("r", r))
        for r in range(R):
            g.add_edge(("r", r), "t", capacity=P)
        return nx.maximum_flow_value(g, "s", "t") == sum(n)

    lo, hi = 0, sum(n)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if feasible(mid) else (mid + 1, hi)
    return lo


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--check", type=int, default=5, help="instances checked against the exact optimum")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)

    times, checked, optimal = [], 0, 0
    for i in range(args.instances):
        counts, holders = instance(rng, args)
        assign_min_peak(counts, holders)  # warm-up
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            assign = assign_min_peak(counts, holders)
            times.append((time.perf_counter() - t0) * 1e3)
        if i < args.check:
            checked += 1
            optimal += int(assign.sum((0, 1)).max()) == exact_peak(counts, holders)
    times.sort()
    row = {
        "median_ms": statistics.median(times),
        "p90_ms": times[int(0.9 * (len(times) - 1))],
        "max_ms": times[-1],
        "checked": checked,
        "optimal": optimal,
    }
    rows = {f"{args.experts}x{args.ranks}": row}
    print_table(f"assign_min_peak, {args.experts} experts x {args.ranks} ranks, 1-4 holders, "
                f"{args.instances} instances x {args.repeats} repeats, 1 thread", rows, list(row))
    write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
