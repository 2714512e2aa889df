"""One MoE layer at paper shapes on one GPU in bf16 (or a small shape on the CPU for CI).

    python benchmarks/gpu_layer.py [--tokens 8192] [--repeats 10] [--out FILE]
    python benchmarks/gpu_layer.py --device cpu --small          # runs in make test

Models: Qwen3-30B-A3B (D=2048, F=768, E=128, K=8, softmax) and GLM-4.5-Air (D=4096, F=1408,
E=128, K=8, sigmoid router, one shared expert). For each: correctness first (bf16 output and
input gradient against the fp32 layer with the same weights, relative error), then rows
static, lrmoe@1, lrmoe@0.5, lrmoe@0.25, masked@0.25 — forward and backward time (CUDA events on
the GPU, wall clock on the CPU; medians of interleaved rounds) and peak memory
(``torch.cuda.max_memory_allocated`` per row on the GPU; the layer's peak_expert_side_bytes on
the CPU). JSON: {model: {row: {figure: value}}}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import write_json

from lrmoe import BackwardConfig, MoEConfig, MoELayer

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def correctness(shape: dict, tokens: int, device: torch.device, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    ref = MoELayer(MoEConfig(**shape)).to(device)
    low = MoELayer(MoEConfig(**shape, dtype=dtype)).to(device)
    low.load_full_state_dict({k: v.to(dtype) if v.is_floating_point() and "router" not in k else v
                              for k, v in ref.state_dict().items()})
    x = torch.randn(tokens, shape["dim"], device=device)
    g = torch.randn_like(x)
    xr, xl = x.clone().requires_grad_(True), x.to(dtype).requires_grad_(True)
    yr, yl = ref(xr), low(xl)
    yr.backward(g)
    yl.float().backward(g)

    def rel(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).norm() / b.norm().clamp(min=1e-30))

    return {"out_rel_err": rel(yl, yr), "dx_rel_err": rel(xl.grad, xr.grad)}


def time_rows(shape: dict, tokens: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    torch.manual_seed(0)
    base = MoELayer(MoEConfig(**shape, dtype=dtype)).state_dict()
    layers = {}
    for name, (system, backward) in ROWS.items():
        layers[name] = MoELayer(MoEConfig(**shape, dtype=dtype), system=system, backward=backward).to(device)
        layers[name].load_state_dict(base)
    x = torch.randn(tokens, shape["dim"], device=device, dtype=dtype)
    g = torch.randn_like(x)
    samples = {name: {"fwd_ms": [], "bwd_ms": [], "peak_bytes": []} for name in ROWS}
    for i in range(repeats + 1):
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_(True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
                ev[0].record()
                y = layer(xi)
                ev[1].record()
                y.backward(g)
                ev[2].record()
                _sync(device)
                fwd, bwd = ev[0].elapsed_time(ev[1]), ev[1].elapsed_time(ev[2])
                peak = torch.cuda.max_memory_allocated(device)
            else:
                t0 = time.perf_counter()
                y = layer(xi)
                t1 = time.perf_counter()
                y.backward(g)
                t2 = time.perf_counter()
                fwd, bwd = (t1 - t0) * 1e3, (t2 - t1) * 1e3
                peak = layer.last_stats["peak_expert_side_bytes"]
            if i:
                samples[name]["fwd_ms"].append(fwd)
                samples[name]["bwd_ms"].append(bwd)
                samples[name]["peak_bytes"].append(peak)
    return {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="small shapes (CI on the CPU)")
    ap.add_argument("--tokens", type=int, help="tokens per GPU (default 8192; 256 with --small)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available (use --device cpu --small)")
    dtype = getattr(torch, args.dtype)
    tokens = args.tokens or (256 if args.small else 8192)
    if device.type == "cpu":
        torch.set_num_threads(1)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "tokens": tokens}
    for model, shape in (SMALL if args.small else MODELS).items():
        check = correctness(shape, min(tokens, 1024), device, dtype)
        if max(check.values()) > 0.05:
            raise SystemExit(f"{model}: {args.dtype} layer disagrees with fp32: {check}")
        rows = time_rows(shape, tokens, device, dtype, args.repeats)
        result[model] = {"correctness": check, **rows}
        print(f"\n{model} D={shape['dim']} F={shape['ffn_dim']} E={shape['num_experts']} K={shape['top_k']} "
              f"{args.dtype} on {result['device']}, {tokens} tokens; vs fp32: out {check['out_rel_err']:.2e}, "
              f"dx {check['dx_rel_err']:.2e}")
        print(f"{'row':<14}{'fwd_ms':>10}{'bwd_ms':>10}{'bwd/static':>12}{'peak_MiB':>12}")
        for name, r in rows.items():
            print(f"{name:<14}{r['fwd_ms']:>10.2f}{r['bwd_ms']:>10.2f}{r['bwd_ms'] / rows['static']['bwd_ms']:>12.3f}"
                  f"{r['peak_bytes'] / 2**20:>12.1f}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
