"""One MoE layer at paper shapes on one GPU in bf16 (or a small shape on the CPU for CI).

    python benchmarks/gpu_layer.py [--tokens 8192] [--ep 1] [--repeats 10] [--out FILE]
    python benchmarks/gpu_layer.py --device cpu --small --ep 4   # runs in the test suite

Models: Qwen3-30B-A3B (D=2048, F=768, E=128, K=8, softmax) and GLM-4.5-Air (D=4096, F=1408,
E=128, K=8, sigmoid router, one shared expert).

``--ep 1`` (all experts): the whole layer on one device, ``--tokens`` tokens, every expert local.

``--ep N`` (N > 1) emulates one rank of an N-way expert-parallel job at world size 1: the rank
holds E/N experts and receives every pair routed to them. With ``--tokens`` T tokens per rank,
the N ranks route N·T·K pairs, so a rank receives T·K rows on average (T·K/N from each rank);
at the real shapes and N=64 that is 2 experts and 65,536 rows. The emulating layer is the
routed part only: E/N experts, top-1 routing over them (each received row is one pair, as
the expert side sees it after the all-to-all), fed T·K rows. The shared expert (GLM) is left
out: it runs on the rank's own T tokens, is data-parallel, and no backward here changes it.
Not emulated: the all-to-all itself and the router over all E experts at home.

For each model: correctness first (the ``--dtype`` layer's output and input gradient against
the fp32 layer with the same weights, relative error, routing fixed: the fp32 router's expert
ids are fed to both, the weights recomputed from each router's own logits, so a near-tie
that flips in bf16 does not count as an error; the fraction of pairs whose expert the bf16
router would have picked differently is reported as ``route_flips``); the check stops the
script above 0.05. Then rows static, hf (transformers' block with the same weights,
``grouped_mm`` experts; where the shape has one: both models at ``--ep 1``, Qwen3 at
``--ep N``), lrmoe@1, lrmoe@0.5, lrmoe@0.25, masked@0.25 (the library's default selection,
recorded in ``setup``): forward and backward time (CUDA
events on the GPU, wall clock on the CPU; medians of interleaved rounds after a warm-up round)
and peak memory (on the GPU the rise of ``torch.cuda.max_memory_allocated`` over what was
allocated before the call; on the CPU the layer's peak_expert_side_bytes, none for hf).
JSON: {"device", "dtype", "tokens", "ep", model: {"setup", "correctness", row: {figure}}}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from common import write_json  # noqa: E402

from lrmoe import BackwardConfig, MoEConfig, MoELayer  # noqa: E402
from lrmoe.router import Routing  # noqa: E402

MODELS = {
    "qwen3-30b-a3b": dict(dim=2048, ffn_dim=768, num_experts=128, top_k=8, router="softmax"),
    "glm45-air": dict(dim=4096, ffn_dim=1408, num_experts=128, top_k=8, router="sigmoid", num_shared_experts=1),
}
SMALL = {
    "qwen3-30b-a3b": dict(dim=64, ffn_dim=32, num_experts=16, top_k=4, router="softmax"),
    "glm45-air": dict(dim=64, ffn_dim=48, num_experts=16, top_k=4, router="sigmoid", num_shared_experts=1),
}
ROWS = {
    "static": ("static", None),
    "lrmoe@1": ("lrmoe", BackwardConfig(ratio=1.0)),
    "lrmoe@0.5": ("lrmoe", BackwardConfig(ratio=0.5)),
    "lrmoe@0.25": ("lrmoe", BackwardConfig(ratio=0.25)),
    "masked@0.25": ("masked", BackwardConfig(ratio=0.25)),
}
HF = "hf"
TOLERANCE = 0.05  # relative error of the --dtype layer against fp32, routing fixed


def ep_setup(shape: dict, tokens: int, ep: int) -> tuple[dict, int]:
    """(the emulating layer's config fields, its input rows) for one rank of ``ep``-way EP."""
    if ep == 1:
        return dict(shape), tokens
    E = shape["num_experts"]
    if ep < 1 or E % ep:
        raise ValueError(f"--ep {ep}: expected a divisor of num_experts={E}")
    local = {k: v for k, v in shape.items() if k != "num_shared_experts"}
    return {**local, "num_experts": E // ep, "top_k": 1}, tokens * shape["top_k"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fix_routing(layer: MoELayer, ids_TK: torch.Tensor) -> None:
    """Make ``layer``'s router pick ``ids_TK``; its weights still come from its own logits
    (differentiable, as the router computes them for its choice)."""
    router, cfg = layer.router, layer.config
    own = router.forward

    def forward(x_TD: torch.Tensor) -> Routing:
        logits_TE = own(x_TD).logits_TE
        probs_TE = logits_TE.softmax(-1) if cfg.router == "softmax" else logits_TE.sigmoid()
        weights_TK = probs_TE.gather(1, ids_TK)
        if cfg.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.routed_scaling_factor
        return Routing(weights_TK.to(x_TD.dtype), ids_TK, logits_TE)

    router.forward = forward


def correctness(shape: dict, tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    ref = MoELayer(MoEConfig(**shape))
    low = MoELayer(MoEConfig(**shape, dtype=dtype))
    low.load_full_state_dict({k: v.to(dtype) if v.is_floating_point() and "router" not in k else v
                              for k, v in ref.state_dict().items()})
    ref, low = ref.to(device), low.to(device)
    x = torch.randn(tokens, shape["dim"], device=device)
    g = torch.randn_like(x)
    xr, xl = x.clone().requires_grad_(True), x.to(dtype).requires_grad_(True)
    with torch.no_grad():
        ids = ref.router(xr).ids_TK
        own_ids = low.router(xl).ids_TK
    flips = (ids.sort(-1).values != own_ids.sort(-1).values).float().mean().item()
    _fix_routing(ref, ids)
    _fix_routing(low, ids)
    yr, yl = ref(xr), low(xl)
    yr.backward(g)
    yl.float().backward(g)

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).norm() / b.norm().clamp(min=1e-30))

    return {"out_rel_err": rel(yl, yr), "dx_rel_err": rel(xl.grad, xr.grad), "route_flips": flips}


def hf_block(shape: dict, state: dict, dtype: torch.dtype, device: torch.device) -> torch.nn.Module | None:
    """transformers' block of this shape carrying ``state`` (MoELayer's world-1 state dict), or
    None where transformers has no block of the shape or is absent."""
    try:
        if shape["router"] == "softmax":
            from transformers import Qwen3MoeConfig
            from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
            cfg = Qwen3MoeConfig(hidden_size=shape["dim"], moe_intermediate_size=shape["ffn_dim"],
                                 num_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
                                 norm_topk_prob=True)
            make = Qwen3MoeSparseMoeBlock
        elif shape.get("num_shared_experts") == 1:  # Glm4MoeMoE always has its shared expert
            from transformers import Glm4MoeConfig
            from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
            cfg = Glm4MoeConfig(hidden_size=shape["dim"], moe_intermediate_size=shape["ffn_dim"],
                                n_routed_experts=shape["num_experts"], num_experts_per_tok=shape["top_k"],
                                n_group=1, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.0,
                                norm_topk_prob=True)
            make = Glm4MoeMoE
        else:
            return None
    except ImportError:
        return None
    cfg._experts_implementation = "grouped_mm"
    block = make(cfg)
    names = {"router.weight": "gate.weight", "router.e_score_correction_bias": "gate.e_score_correction_bias"}
    mapped = {names.get(k, k): v for k, v in state.items()}
    with torch.no_grad():
        for name, t in block.state_dict().items():
            t.copy_(mapped[name])
    return block.to(device=device, dtype=dtype)


def time_rows(modules: dict, tokens: int, dim: int, device: torch.device, dtype: torch.dtype,
              repeats: int) -> dict:
    x = torch.randn(1, tokens, dim, device=device, dtype=dtype)
    g = torch.randn_like(x)
    samples = {name: {"fwd_ms": [], "bwd_ms": [], "peak_bytes": []} for name in modules}
    for i in range(repeats + 1):  # round 0 warms up
        for name, module in modules.items():
            module.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_(True)
            if device.type == "cuda":
                _sync(device)
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
                y = module(xi)
                ev[1].record()
                y.backward(g)
                ev[2].record()
                _sync(device)
                fwd, bwd = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
                peak = torch.cuda.max_memory_allocated(device) - before
            else:
                t0 = time.perf_counter()
                y = module(xi)
                t1 = time.perf_counter()
                y.backward(g)
                t2 = time.perf_counter()
                fwd, bwd = (t1 - t0) * 1e3, (t2 - t1) * 1e3
                peak = module.last_stats["peak_expert_side_bytes"] if isinstance(module, MoELayer) else None
            del y
            module.zero_grad(set_to_none=True)  # other rows' gradients stay out of this row's peak
            if i:
                samples[name]["fwd_ms"].append(fwd)
                samples[name]["bwd_ms"].append(bwd)
                samples[name]["peak_bytes"].append(peak)
    rows = {}
    for name, s in samples.items():
        r = {k: statistics.median(v) for k, v in s.items() if None not in v}
        r["peak_bytes"] = r.get("peak_bytes")
        r["fwd_bwd_ms"] = r["fwd_ms"] + r["bwd_ms"]
        rows[name] = r
    for r in rows.values():
        r["bwd_vs_static"] = r["bwd_ms"] / rows["static"]["bwd_ms"]
        r["fwd_bwd_vs_hf"] = r["fwd_bwd_ms"] / rows[HF]["fwd_bwd_ms"] if HF in rows else None
    return rows


def run_model(shape: dict, tokens: int, ep: int, device: torch.device, dtype: torch.dtype,
              repeats: int) -> dict:
    local, rows = ep_setup(shape, tokens, ep)
    check = correctness(local, min(rows, 1024), device, dtype)
    setup = {"ep": ep, "local_experts": local["num_experts"], "rows": rows, "top_k": local["top_k"],
             "dim": local["dim"], "ffn_dim": local["ffn_dim"],
             "shared_expert": bool(local.get("num_shared_experts")),
             "selection": ROWS["lrmoe@0.25"][1].selection}
    if max(check["out_rel_err"], check["dx_rel_err"]) > TOLERANCE:
        raise SystemExit(f"{setup}: layer disagrees with fp32 (routing fixed) above {TOLERANCE}: {check}")
    torch.manual_seed(0)
    cfg = MoEConfig(**local, dtype=dtype)
    base = MoELayer(cfg).state_dict()  # built on the CPU, then moved
    modules = {}
    for name, (system, backward) in ROWS.items():
        layer = MoELayer(cfg, system=system, backward=backward)
        layer.load_full_state_dict(base)
        modules[name] = layer.to(device)
        if name == "static":
            hf = hf_block(local, base, dtype, device)
            if hf is not None:
                modules[HF] = hf
    timed = time_rows(modules, rows, local["dim"], device, dtype, repeats)
    return {"setup": setup, "correctness": check, **timed}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes (CI on the CPU)")
    ap.add_argument("--tokens", type=int, help="tokens per GPU (default 8192; 256 with --small)")
    ap.add_argument("--ep", type=int, default=1,
                    help="emulate one rank of N-way expert parallelism: E/N experts, tokens·K rows (default 1)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available (use --device cpu --small)")
    shapes = SMALL if args.small else MODELS
    for model in args.models:
        E = shapes[model]["num_experts"]
        if args.ep < 1 or E % args.ep:
            ap.error(f"--ep {args.ep}: expected a divisor of {model}'s {E} experts")
    dtype = getattr(torch, args.dtype)
    tokens = args.tokens or (256 if args.small else 8192)
    if device.type == "cpu":
        torch.set_num_threads(1)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "tokens": tokens, "ep": args.ep}
    for model in args.models:
        r = run_model(shapes[model], tokens, args.ep, device, dtype, args.repeats)
        result[model] = r
        s, c = r["setup"], r["correctness"]
        print(f"\n{model} ep={args.ep}: {s['local_experts']} local experts, {s['rows']} rows, D={s['dim']} "
              f"F={s['ffn_dim']} top-{s['top_k']}, {args.dtype} on {result['device']}; vs fp32 (routing "
              f"fixed): out {c['out_rel_err']:.2e}, dx {c['dx_rel_err']:.2e}, route flips {c['route_flips']:.2e}")
        print(f"{'row':<14}{'fwd_ms':>10}{'bwd_ms':>10}{'bwd/static':>12}{'fb/hf':>8}{'peak_MiB':>12}")
        for name, row in r.items():
            if name in ("setup", "correctness"):
                continue
            vs_hf = "-" if row["fwd_bwd_vs_hf"] is None else f"{row['fwd_bwd_vs_hf']:.3f}"
            peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.1f}"
            print(f"{name:<14}{row['fwd_ms']:>10.2f}{row['bwd_ms']:>10.2f}{row['bwd_vs_static']:>12.3f}"
                  f"{vs_hf:>8}{peak:>12}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
