"""One MoE layer, one process, one thread: lrmoe `static` against transformers' Qwen3-MoE block
carrying the same weights (its `grouped_mm` and `eager` experts implementations), side by side.

    python benchmarks/bench_layer.py [--tokens 2048 --dim 256 --ffn 512 --experts 16 --top-k 4]
                                     [--repeats 9] [--out FILE]

Reports medians of forward, backward and forward+backward (ms). JSON: {row: {figure: value}}
with rows `static` and `hf` (the faster transformers implementation, named in `impl`).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import print_table, time_rows, write_json  # noqa: E402

from lrmoe.integrations.hf import from_hf_block  # noqa: E402


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

    for r in rows.values():
        r["vs_hf"] = r["fwd_bwd_ms"] / rows["hf"]["fwd_bwd_ms"]
    print_table(
        f"MoE layer T={args.tokens} D={args.dim} F={args.ffn} E={args.experts} K={args.top_k} fp32, "
        f"1 thread, median of {args.repeats} interleaved rounds (hf = transformers {best})",
        rows, ["fwd_ms", "bwd_ms", "fwd_bwd_ms", "vs_hf"],
    )
    write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
