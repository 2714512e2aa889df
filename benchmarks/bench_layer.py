"""One MoE layer, one process, one thread: lrmoe `static` against transformers' Qwen3-MoE block
carrying the same weights (its `grouped_mm` and `eager` experts implementations), side by side.

    python benchmarks/bench_layer.py [--tokens 2048 --dim 256 --ffn 512 --experts 16 --top-k 4]
                                     [--repeats 9] [--out FILE]

Reports medians of forward, backward and forward+backward (ms). JSON: {row: {figure: value}}
with rows `static` and `hf` (the faster transformers implementation, named in `impl`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lrmoe.integrations.hf import from_hf_block  # noqa: E402


def time_rows(modules: dict[str, torch.nn.Module], x: torch.Tensor, g: torch.Tensor, repeats: int) -> dict:
    """Median forward, backward and their sum per module. Modules run interleaved, one
    iteration each per round, so slow drifts of a shared machine hit every row alike."""
    times = {name: {"fwd": [], "bwd": [], "total": []} for name in modules}
    for i in range(repeats + 1):  # round 0 warms up
        for name, module in modules.items():
            module.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_(True)
            t0 = time.perf_counter()
            y = module(xi)
            t1 = time.perf_counter()
            y.backward(g)
            t2 = time.perf_counter()
            if i:
                times[name]["fwd"].append(t1 - t0)
                times[name]["bwd"].append(t2 - t1)
                times[name]["total"].append(t2 - t0)
    figures = {"fwd_ms": "fwd", "bwd_ms": "bwd", "fwd_bwd_ms": "total"}
    return {
        name: {fig: statistics.median(t[key]) * 1e3 for fig, key in figures.items()}
        for name, t in times.items()
    }


def hf_block(args: argparse.Namespace, impl: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=args.dim, moe_intermediate_size=args.ffn, num_experts=args.experts,
                         num_experts_per_tok=args.top_k, norm_topk_prob=True)
    cfg._experts_implementation = impl
    torch.manual_seed(args.seed)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write JSON {row: {figure: value}} here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(1, args.tokens, args.dim, generator=gen)
    g = torch.randn(1, args.tokens, args.dim, generator=gen)

    modules = {"static": from_hf_block(hf_block(args, "grouped_mm"))}
    for impl in ("grouped_mm", "eager"):
        modules[f"hf-{impl}"] = hf_block(args, impl)
    timed = time_rows(modules, x, g, args.repeats)
    best = min(("grouped_mm", "eager"), key=lambda impl: timed[f"hf-{impl}"]["fwd_bwd_ms"])
    rows = {"static": timed["static"], "hf": {**timed[f"hf-{best}"], "impl": best}}
    rows.update({k: v for k, v in timed.items() if k.startswith("hf-")})

    print(f"MoE layer T={args.tokens} D={args.dim} F={args.ffn} E={args.experts} K={args.top_k} fp32, "
          f"1 thread, median of {args.repeats}")
    print(f"{'row':<16}{'fwd_ms':>10}{'bwd_ms':>10}{'fwd_bwd_ms':>12}{'vs hf':>8}")
    for name, r in rows.items():
        ratio = r["fwd_bwd_ms"] / rows["hf"]["fwd_bwd_ms"]
        print(f"{name:<16}{r['fwd_ms']:>10.1f}{r['bwd_ms']:>10.1f}{r['fwd_bwd_ms']:>12.1f}{ratio:>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
