"""The LRMoE backward against full backwards, side by side in one run.

    python benchmarks/bench_backward.py [--world 4] [--tokens 2048 --dim 256 --ffn 512
                                         --experts 16 --top-k 4] [--repeats 7] [--out FILE]

Rows: static, static-recompute; the default backward (``local-sampled``) at kept ratios ρ = 1, 0.9,
0.75, 0.5, 0.25 in each keep mode (``x+acts``: the expert side kept x and the activations;
``x+gate_up``: x and gate/up, silu and h recomputed; ``x``: x alone, gate/up/h recomputed;
``nothing``: home re-sends x of the kept pairs, re-spread min-peak); and the paper's top-q
(``lrm@0.25``) and the masked ablation at 0.25. Figures (medians over interleaved rounds, one thread
per process): fwd_ms, bwd_ms (wall time around forward and backward, selection included), select_ms
(scoring, selection, the kept rows' plan), bwd_gemm_rows, and ``floor``: the backward's GEMM work as
a share of static's — kept rows × GEMM passes (6 with saved activations; 8 recomputing gate and up)
over static's rows × 6 — the bwd / static a backward that costs only its GEMMs would reach. With
``--world N`` it runs N gloo ranks of ``--tokens`` tokens each and adds bwd_a2a_bytes (max over
ranks); times are then the max over ranks. JSON with ``--out``: {row: {figure: value}}.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import print_table, run_ranks, time_rows, write_json

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.memory import KEEP_MODES
from lrmoe.parallel import comm

RATIOS = (1.0, 0.9, 0.75, 0.5, 0.25)
KEEPS = KEEP_MODES
ROWS = {
    "static": ("static", None),
    "static-recompute": ("static-recompute", None),
    **{f"lrmoe@{r} {keep}": ("lrmoe", BackwardConfig(ratio=r, keep=keep)) for keep in KEEPS for r in RATIOS},
    "lrm@0.25 x+acts": ("lrmoe", BackwardConfig("lrm", ratio=0.25, keep="x+acts")),
    "masked@0.25": ("masked", BackwardConfig(ratio=0.25)),
}
GEMM_PASSES = {"static": 6, "static-recompute": 8, "x+acts": 6, "x+gate_up": 6, "x": 8, "nothing": 8, "masked@0.25": 8}
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
    for name, r in rows.items():
        r["bwd_vs_static"] = r["bwd_ms"] / static["bwd_ms"]
        passes = GEMM_PASSES.get(name) or GEMM_PASSES[name.split()[-1]]
        r["floor"] = r["bwd_gemm_rows"] * passes / (static["bwd_gemm_rows"] * 6)
        r["select_vs_static"] = r["select_ms"] / static["bwd_ms"]
        if args.world > 1:
            r["a2a_vs_static"] = r["bwd_a2a_bytes"] / static["bwd_a2a_bytes"]
    columns = ["fwd_ms", "bwd_ms", "select_ms", "bwd_gemm_rows", "floor", "bwd_vs_static", "select_vs_static"]
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
