"""The LRMoE backward against full backwards, side by side in one run.

    python benchmarks/bench_backward.py [--world 4] [--tokens 2048 --dim 256 --ffn 512
                                         --experts 16 --top-k 4] [--repeats 7] [--out FILE]

Rows: static, static-recompute, lrmoe@1, lrmoe@0.5, lrmoe@0.25, masked@0.25, random@0.25,
sampled@0.25, local-sampled@0.25 and @0.9 (the number is the quota ratio; ``lrmoe@`` is the
paper's top-q by LRM score). Figures (medians over interleaved rounds, one thread per process):
fwd_ms, bwd_ms (wall time around forward and backward, selection included), select_ms
(scoring + selection exchange + packing), bwd_gemm_rows. With ``--world N`` it runs N gloo
ranks of ``--tokens`` tokens each and adds bwd_a2a_bytes (max over ranks); times are then the
max over ranks. JSON with ``--out``: {row: {figure: value}}.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import print_table, run_ranks, time_rows, write_json

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.parallel import comm

ROWS = {
    "static": ("static", None),
    "static-recompute": ("static-recompute", None),
    "lrmoe@1": ("lrmoe", BackwardConfig("lrm", ratio=1.0)),
    "lrmoe@0.5": ("lrmoe", BackwardConfig("lrm", ratio=0.5)),
    "lrmoe@0.25": ("lrmoe", BackwardConfig("lrm", ratio=0.25)),
    "masked@0.25": ("masked", BackwardConfig("lrm", ratio=0.25)),
    "random@0.25": ("lrmoe", BackwardConfig(selection="random", ratio=0.25)),
    "sampled@0.25": ("lrmoe", BackwardConfig(selection="sampled", ratio=0.25)),
    "local-sampled@0.25": ("lrmoe", BackwardConfig(selection="local-sampled", ratio=0.25)),
    "local-sampled@0.9": ("lrmoe", BackwardConfig(selection="local-sampled", ratio=0.9)),
}
STAT_FIGURES = ("select_ms", "bwd_gemm_rows", "bwd_a2a_bytes")


def measure(group, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """This rank's medians for every row (the same weights and tokens in every row)."""
    torch.set_num_threads(1)
    cfg = MoEConfig(dim=args.dim, ffn_dim=args.ffn, num_experts=args.experts, top_k=args.top_k)
    torch.manual_seed(args.seed)
    full = MoELayer(cfg).state_dict()
    rank = comm.rank_of(group)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, args.dim, generator=gen)
    g = torch.randn(args.tokens, args.dim, generator=gen)
    layers = {}
    for name, (system, backward) in ROWS.items():
        layers[name] = MoELayer(cfg, system=system, group=group, backward=backward)
        layers[name].load_full_state_dict(full)
    return time_rows(layers, x, g, args.repeats,
                     lambda name, layer: {k: layer.last_stats[k] for k in STAT_FIGURES})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=1, help="gloo ranks (1: this process, no group)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write JSON {row: {figure: value}} here")
    args = ap.parse_args(argv)
    if args.world < 1:
        ap.error(f"--world={args.world} is invalid: expected an integer >= 1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    per_rank = [measure(None, args)] if args.world == 1 else run_ranks(measure, args.world, args)
    rows = {}
    for name in ROWS:
        timed = ("fwd_ms", "bwd_ms", "fwd_bwd_ms", "select_ms")
        r = {k: max(rank[name][k] for rank in per_rank) for k in timed}
        r["bwd_gemm_rows"] = int(max(rank[name]["bwd_gemm_rows"] for rank in per_rank))
        if args.world > 1:
            r["bwd_a2a_bytes"] = int(max(rank[name]["bwd_a2a_bytes"] for rank in per_rank))
        rows[name] = r
    static = rows["static"]
    for r in rows.values():
        r["bwd_vs_static"] = r["bwd_ms"] / static["bwd_ms"]
        if args.world > 1:
            r["a2a_vs_static"] = r["bwd_a2a_bytes"] / static["bwd_a2a_bytes"]
    columns = ["fwd_ms", "bwd_ms", "select_ms", "bwd_gemm_rows", "bwd_vs_static"]
    if args.world > 1:
        columns[4:4] = ["fwd_bwd_ms", "bwd_a2a_bytes"]
        columns.append("a2a_vs_static")
    print_table(
        f"MoE backward, world {args.world}, T={args.tokens}/rank D={args.dim} F={args.ffn} E={args.experts} "
        f"K={args.top_k} fp32, 1 thread per rank, median of {args.repeats} interleaved rounds"
        + (" (times: max over ranks)" if args.world > 1 else ""),
        rows, columns,
    )
    write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
