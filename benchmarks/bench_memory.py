"""Expert-side memory, rows and bytes of every system under Zipf-skewed routing, 4 gloo ranks.

    python benchmarks/bench_memory.py [--world 4 --zipf 1.2 --budget-fraction 0.4 --steps 4]
                                      [--tokens 2048 --dim 256 --ffn 512 --experts 16 --top-k 4]
                                      [--out FILE]

Every rank routes ``--tokens`` tokens whose router logits carry a per-expert offset
log(p_e), p_e ∝ 1/rank(e)^zipf, so expert popularity follows a Zipf law. Rows: static,
static-recompute, symi, capacity (factor 1.25), lrmoe with a per-rank budget of
``--budget-fraction`` × static's peak expert-side bytes (max over ranks), and the replication
family (fastermoe, flexmoe, smartmoe with its pool built from static's recorded counts, laer,
ultraep, topoep on two nodes). Each system runs ``--steps`` forward+backward steps with
``step_end()`` between them (replicas re-planned every 2 steps for lrmoe, every step for symi,
flexmoe, smartmoe and topoep, every call for fastermoe, laer and ultraep). Figures:
peak_expert_side_bytes (max over ranks and steps), max_rank_rows (most forward rows one rank
computed), fwd/bwd_a2a_bytes (max over ranks, last step), placement_bytes (parameter bytes moved,
all ranks and steps), forward_pairs_computed (all ranks, last step), kept_fraction (backward
pairs kept / routed, last step).
"""

from __future__ import annotations

import argparse
import math

import torch
from common import print_table, run_ranks, write_json

from lrmoe import ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.systems import REPLICATION_FAMILY

SYSTEMS = ("static", "static-recompute", "symi", "capacity", "lrmoe", *REPLICATION_FAMILY)


def skewed_problem(cfg: MoEConfig, args: argparse.Namespace, rank: int):
    torch.manual_seed(args.seed)
    sd = MoELayer(cfg).state_dict()
    gen = torch.Generator().manual_seed(args.seed)
    popularity = 1.0 / torch.arange(1, cfg.num_experts + 1, dtype=torch.float64) ** args.zipf
    u = torch.randn(cfg.dim, generator=gen)
    u /= u.norm()
    # logits_e = w_e·x + log p_e for x with a unit component along u
    log_p = torch.log(popularity / popularity.sum()).float()
    sd["router.weight"] = 0.5 * sd["router.weight"] + log_p[:, None] * u
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, cfg.dim, generator=gen)
    x = x - (x @ u)[:, None] * u + u  # component along u fixed at 1
    g = torch.randn(args.tokens, cfg.dim, generator=gen)
    return sd, x, g


def run_system(group, cfg, sd, x, g, system: str, args, budget: int | None, trace=None) -> dict:
    kwargs = {}
    if system == "smartmoe":  # its offline pool from static's recorded routing
        kwargs = dict(routing_trace=trace)
    elif system == "lrmoe":
        kwargs = dict(budget=ClusterBudget(budget), replan_interval=2)
    elif system == "topoep":  # two nodes
        kwargs = dict(budget=ClusterBudget(ranks_per_node=max(1, comm.world_size(group) // 2)))
    layer = MoELayer(cfg, system=system, group=group, **kwargs)
    layer.load_full_state_dict(sd)
    peak, placement, trace = 0, 0, []
    for _ in range(args.steps):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(g)
        s = layer.last_stats
        peak = max(peak, s["peak_expert_side_bytes"])
        placement += s.get("placement_bytes", 0)
        trace.append(s["counts_E"])
        layer.step_end()
    layer(x.clone().requires_grad_(True)).sum().mul(0).backward()  # collects the last refresh
    placement += layer.last_stats.get("placement_bytes", 0)
    return {
        "peak_expert_side_bytes": peak,
        "rows": s["recv_rows"],
        "fwd_a2a_bytes": s["fwd_a2a_bytes"],
        "bwd_a2a_bytes": s["bwd_a2a_bytes"],
        "placement_bytes": placement,
        "kept": int(s["kept_E"].sum()),
        "routed": int(s["counts_E"].sum()),
        "optimizer_bytes": s["optimizer_bytes"],
        "trace": torch.stack(trace),
    }


def measure(group, args) -> dict:
    torch.set_num_threads(1)
    cfg = MoEConfig(dim=args.dim, ffn_dim=args.ffn, num_experts=args.experts, top_k=args.top_k)
    rank = comm.rank_of(group)
    sd, x, g = skewed_problem(cfg, args, rank)
    out = {}
    budget = None
    for system in SYSTEMS:
        if system == "lrmoe":
            static_peak = comm.all_gather(torch.tensor([[out["static"]["peak_expert_side_bytes"]]]),
                                          [1] * comm.world_size(group), group).max()
            budget = int(args.budget_fraction * int(static_peak))
        out[system] = run_system(group, cfg, sd, x, g, system, args, budget, out.get("static", {}).get("trace"))
    for figures in out.values():
        del figures["trace"]  # tensors do not leave the rank processes
    out["budget"] = budget
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--budget-fraction", type=float, default=0.4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world={args.world} is invalid: expected >= 2 (it measures expert parallelism)")
    if not args.budget_fraction > 0:
        ap.error(f"--budget-fraction={args.budget_fraction} is invalid: expected a number > 0")

    ranks = run_ranks(measure, args.world, args)

    rows = {}
    for system in SYSTEMS:
        rs = [r[system] for r in ranks]
        rows[system] = {
            "peak_expert_side_bytes": max(r["peak_expert_side_bytes"] for r in rs),
            "max_rank_rows": max(r["rows"] for r in rs),
            "fwd_a2a_bytes": max(r["fwd_a2a_bytes"] for r in rs),
            "bwd_a2a_bytes": max(r["bwd_a2a_bytes"] for r in rs),
            "placement_bytes": sum(r["placement_bytes"] for r in rs),
            "forward_pairs_computed": sum(r["rows"] for r in rs),
            "kept_fraction": rs[0]["kept"] / rs[0]["routed"],
            "optimizer_bytes": max(r["optimizer_bytes"] for r in rs),
        }
    static_peak = rows["static"]["peak_expert_side_bytes"]
    for r in rows.values():
        r["peak_vs_static"] = r["peak_expert_side_bytes"] / static_peak
    budget = ranks[0]["budget"]
    print_table(
        f"Expert-side memory, {args.world} gloo ranks, T={args.tokens}/rank D={args.dim} F={args.ffn} "
        f"E={args.experts} K={args.top_k}, Zipf {args.zipf}, lrmoe budget {budget} B/rank "
        f"({args.budget_fraction} x static peak), {args.steps} steps",
        rows, ["peak_expert_side_bytes", "peak_vs_static", "max_rank_rows", "fwd_a2a_bytes", "bwd_a2a_bytes",
               "placement_bytes", "forward_pairs_computed", "kept_fraction"],
    )
    rows["lrmoe"]["budget_bytes"] = budget
    write_json(args.out, rows)
    assert math.isfinite(rows["lrmoe"]["peak_vs_static"])
    return rows


if __name__ == "__main__":
    main()
