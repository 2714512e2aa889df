"""MoE time per training step under one memory cap, every system side by side in one run.

    python benchmarks/bench_capped.py [--world 2] [--tokens 1024 --dim 256 --ffn 512 --experts 16
                                       --top-k 4] [--skew 2.0] [--cap 0.87] [--repeats 9]
                                       [--order-seed 0 | --worst-case] [--out FILE]

The per-step half of ``lrmoe compare``'s MoE time to target (steps to target × MoE time per
step), measured without a training run's noise: one MoE layer per system on ``--world`` gloo
ranks, the same weights and tokens, routing skewed towards a few experts (``--skew``: the
spread of per-expert router offsets; the load's coefficient of variation is printed), rounds
interleaved, the ranks meeting at a barrier before each system's step. Which expert gets which
offset is a seeded random order (``--order-seed``), so the hot experts land on ranks as chance
has it; ``--worst-case`` gives the largest offsets to the
lowest expert ids instead, which static's block placement puts all on rank 0 (the worst case for
static). The hot rank's share of the forward's received rows (the largest rank's share) is
reported for the routing under static's block placement (``hot_rank_share`` in ``meta``) and
per system (its ranks' ``recv_rows``). A step is forward, backward and ``step_end`` (the replica re-plan and refresh of
the replicated systems). ``static`` runs without a cap; every other system under ``--cap`` ×
static's peak expert-side bytes (the largest over ranks), as in the paper's regime; a system
that does not fit is reported as ``oom``. Figures: medians over rounds of the slowest rank's
fwd_ms, bwd_ms, step_end_ms and their sum step_ms; kept ratio, replica slots, peak bytes and,
for lrmoe, the keep mode of the last round, and ``hot_rank_share``. JSON with ``--out``:
{"meta": {"cap", "static_peak", "load_cv", "hot_rank_share", "order", "order_seed"},
row: {figure: value}}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from common import print_table, run_ranks, write_json

from lrmoe import BackwardConfig, ClusterBudget, MemoryBudgetExceeded, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.planning.placement import Placement

SYSTEMS = {
    "static": ("static", None),
    "capacity": ("capacity", None),
    "symi": ("symi", None),
    "ultraep": ("ultraep", None),
    "lrmoe": ("lrmoe", BackwardConfig(selection="local-sampled", ratio=1.0)),
    "lrmoe@0.75": ("lrmoe", BackwardConfig(selection="local-sampled", ratio=0.75)),
    "llep": ("llep", None),
    "lrmoe-time": ("lrmoe", BackwardConfig(selection="local-sampled", objective="time")),  # paper.toml's earlier
}
TIMES = ("fwd_ms", "bwd_ms", "step_end_ms", "step_ms")


def router_offsets(num_experts: int, order_seed: int | None) -> torch.Tensor:
    """Expert e's router offset z_e: standard normal draws (from the global generator), sorted
    from the largest down and handed to the experts in a random order seeded by ``order_seed``;
    ``None`` (``--worst-case``) keeps them sorted, so expert 0 is the hottest, then expert 1, ..."""
    z = torch.randn(num_experts).sort(descending=True).values
    if order_seed is None:
        return z
    return z[torch.randperm(num_experts, generator=torch.Generator().manual_seed(order_seed))]


def block_shares(counts_E: torch.Tensor, world: int) -> list[float]:
    """Each rank's share of the routed pairs under static's block placement (experts in
    contiguous blocks, :meth:`lrmoe.planning.placement.Placement.static`)."""
    owner_E = Placement.static(len(counts_E), world).owner_E
    per_rank = torch.zeros(world, dtype=torch.float64).index_add_(0, owner_E, counts_E.double())
    return (per_rank / per_rank.sum()).tolist()


def hot_share(rows_R: list[int]) -> float | None:
    """The largest rank's share of the rows the ranks received (None: no rows)."""
    total = sum(rows_R)
    return max(rows_R) / total if total else None


def order_label(meta: dict) -> str:
    return "worst case (sorted)" if meta["order"] == "worst-case" else f"random (--order-seed {meta['order_seed']})"


def skewed_problem(cfg: MoEConfig, args: argparse.Namespace, rank: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Weights, tokens and output gradients with routing skewed towards a few experts: every
    token carries a shared direction u, and expert e's router row an offset z_e·u
    (:func:`router_offsets`)."""
    torch.manual_seed(args.seed)
    full = MoELayer(cfg).state_dict()
    u = torch.randn(cfg.dim)
    u /= u.norm()
    z = router_offsets(cfg.num_experts, None if args.worst_case else args.order_seed)
    full["router.weight"] = full["router.weight"] + args.skew * z[:, None] * u[None, :]
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)
    x = torch.randn(args.tokens, cfg.dim, generator=gen) + 2.0 * u
    return full, x, torch.randn(args.tokens, cfg.dim, generator=gen)


def measure(group, args: argparse.Namespace) -> dict[str, dict]:
    torch.set_num_threads(1)
    cfg = MoEConfig(dim=args.dim, ffn_dim=args.ffn, num_experts=args.experts, top_k=args.top_k)
    full, x, g = skewed_problem(cfg, args, comm.rank_of(group))
    static = MoELayer(cfg, group=group)
    static.load_full_state_dict(full)
    static(x.detach().requires_grad_(True)).backward(g)
    peak = comm.all_gather(torch.tensor([[static.last_stats["peak_expert_side_bytes"]]]),
                           [1] * comm.world_size(group), group).max()
    counts = static.last_stats["counts_E"].double()
    cap = int(args.cap * int(peak))
    layers, out = {}, {}
    for name, (system, backward) in SYSTEMS.items():
        budget = None if name == "static" else ClusterBudget(memory_bytes=cap)
        layers[name] = MoELayer(cfg, system=system, group=group, backward=backward, budget=budget)
        layers[name].load_full_state_dict(full)
        out[name] = {"samples": {k: [] for k in TIMES}}
    for i in range(args.repeats + 1):  # round 0 warms up (and gives replicated systems their load)
        for name, layer in layers.items():
            if "oom" in out[name]:
                continue
            layer.zero_grad(set_to_none=True)
            # Ranks aligned: otherwise one rank's lead out of the previous system's step (its
            # step_end's share, say) is waited for in this one's first collective and counted here.
            dist.barrier(group)
            t0 = time.perf_counter()
            try:
                y = layer(x.detach().requires_grad_(True))
                t1 = time.perf_counter()
                y.backward(g)
            except MemoryBudgetExceeded as e:  # every rank raises alike
                out[name]["oom"] = str(e).split(";")[0]
                continue
            t2 = time.perf_counter()
            layer.step_end()
            t3 = time.perf_counter()
            if i:
                for k, v in zip(TIMES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    out[name]["samples"][k].append(1e3 * v)
            s = layer.last_stats
            kept_E = s.get("kept_E")
            kept = (s["counts_E"] if kept_E is None else kept_E).sum() / s["counts_E"].sum()
            out[name].update(kept_ratio=float(kept), replica_slots=s.get("replica_slots", cfg.num_experts // 2),
                             peak_bytes=int(s["peak_expert_side_bytes"]), keep_mode=s.get("keep_mode", "-"),
                             recv_rows=int(s.get("recv_rows", 0)))
    for r in out.values():
        r.update({k: statistics.median(v) for k, v in r.pop("samples").items() if v})
    out["_"] = {"cap": cap, "static_peak": int(peak), "load_cv": float(counts.std() / counts.mean()),
                "hot_rank_share": max(block_shares(counts, comm.world_size(group))),
                "order": "worst-case" if args.worst_case else "random", "order_seed": None if args.worst_case
                else args.order_seed}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2, help="gloo ranks (>= 2)")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--skew", type=float, default=2.0, help="spread of the per-expert router offsets")
    ap.add_argument("--cap", type=float, default=0.87, help="memory cap as a fraction of static's peak")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    order = ap.add_mutually_exclusive_group()
    order.add_argument("--order-seed", type=int, default=0,
                       help="seed of the random order in which experts get the router offsets (default 0)")
    order.add_argument("--worst-case", action="store_true",
                       help="the largest offsets to experts 0, 1, ...: static's block placement puts every hot "
                            "expert on rank 0")
    ap.add_argument("--out", help="write JSON {row: {figure: value}} here")
    args = ap.parse_args(argv)
    if args.world < 2:
        ap.error(f"--world={args.world} is invalid: expected an integer >= 2")
    if not args.cap > 0:
        ap.error(f"--cap={args.cap} is invalid: expected a fraction > 0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    per_rank = run_ranks(measure, args.world, args)
    meta = per_rank[0].pop("_")
    for r in per_rank[1:]:
        r.pop("_")
    rows = {}
    for name in SYSTEMS:
        r0 = per_rank[0][name]
        if "oom" in r0:
            rows[name] = {"oom": r0["oom"]}
            continue
        rows[name] = {k: max(rank[name][k] for rank in per_rank) for k in TIMES}
        rows[name].update(kept_ratio=r0["kept_ratio"], replica_slots=r0["replica_slots"],
                          peak_bytes=max(rank[name]["peak_bytes"] for rank in per_rank), keep_mode=r0["keep_mode"],
                          hot_rank_share=hot_share([rank[name]["recv_rows"] for rank in per_rank]))
    base = rows.get("symi", {}).get("step_ms")
    for r in rows.values():
        if base and "step_ms" in r:
            r["step_vs_symi"] = r["step_ms"] / base
    print_table(
        f"MoE step under a cap of {meta['cap']:,} B/rank ({args.cap:.2f}x static's peak {meta['static_peak']:,}), "
        f"world {args.world}, T={args.tokens}/rank D={args.dim} F={args.ffn} E={args.experts} K={args.top_k}, "
        f"load CV {meta['load_cv']:.2f}, expert order {order_label(meta)}: the hot rank's share of the routed "
        f"rows under block placement {meta['hot_rank_share']:.3f} (even: {1 / args.world:.3f}), median of "
        f"{args.repeats} interleaved rounds, slowest rank",
        rows, [*TIMES, "step_vs_symi", "kept_ratio", "replica_slots", "peak_bytes", "keep_mode", "hot_rank_share",
               "oom"])
    write_json(args.out, {"meta": meta, **rows})
    return rows


if __name__ == "__main__":
    main()
