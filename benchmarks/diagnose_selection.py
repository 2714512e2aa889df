"""Why a trimmed backward trains worse: every step, on the same batch, the trimmed backward and
the full one side by side (world size 1, one process, the compare model).

    python benchmarks/diagnose_selection.py --config configs/compare.toml --steps 300 \
        --selections lrm,random,sampled,local-sampled --ratio 0.5 --out runs/diagnose

For each selection it trains the model with that selection's gradients and, at every step, also
computes the full backward of the same weights on the same batch, reporting:

- cosine similarity and norm ratio (trimmed / full) of the expert weight gradients (gate/up and
  down, per MoE layer), of dx at each MoE layer's input, of the router weights' gradients, and
  of everything upstream (attention, norms, embeddings);
- which pairs are dropped: kept share by k slot (1st, 2nd, … choice), by expert load (experts
  above / below the median load), mean routing weight of kept vs dropped pairs, and the share
  of tokens whose every pair was dropped.

``--apply`` splits the training signal to find where the loss gap opens: ``trimmed`` (the
selection's gradients for everything), ``experts`` (trimmed expert weight gradients, full
gradients everywhere else), ``upstream`` (full expert weight gradients, trimmed elsewhere — the
effect of the missing dx and of the changed upstream signal). Prints a table, writes
``diagnose.json`` and ``diagnose.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from common import selection_variant

from lrmoe.config import BackwardConfig
from lrmoe.layer import moe_layers
from lrmoe.train.build import build_model
from lrmoe.train.config import load
from lrmoe.train.data import Batches, TokenData
from lrmoe.train.groups import Groups

EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")


def _cos_ratio(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, ‖a‖ / ‖b‖) of two flattened gradients (b the full one)."""
    a, b = a.flatten().double(), b.flatten().double()
    nb = float(b.norm())
    if nb == 0:
        return float("nan"), float("nan")
    return float(a @ b / (a.norm() * nb).clamp(min=1e-300)), float(a.norm()) / nb


def _group_of(name: str, moe_names: list[str]) -> str:
    for i, prefix in enumerate(moe_names):
        if name.startswith(prefix + "."):
            rest = name[len(prefix) + 1 :]
            if rest in EXPERT_PARAMS:
                return f"L{i}.{rest.split('.')[1]}"
            if rest.startswith("router"):
                return f"L{i}.router"
            return f"L{i}.other"
    return "upstream"


def _grads(model, ids, tgt, moe_inputs: list) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Loss gradients by parameter name and dx at every MoE layer's input."""
    model.zero_grad(set_to_none=True)
    moe_inputs.clear()
    loss, _ = model.loss(ids, tgt)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, [x.grad.detach().clone() for x in moe_inputs]


def _hook_inputs(model, store: list) -> list:
    """Every MoE layer's input appended to ``store`` (its gradient retained); the hooks' handles."""
    def pre(_module, args):
        x = args[0]
        if torch.is_grad_enabled():
            x.retain_grad()
            store.append(x)
    return [layer.register_forward_pre_hook(pre) for _, layer in moe_layers(model)]


def _dropped(layer, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> dict:
    kept = layer.last_kept
    counts = torch.bincount(ids_TK.flatten(), minlength=layer.config.num_experts)
    heavy = counts[ids_TK] >= counts.float().median()
    out = {f"kept_k{k}": float(kept[:, k].float().mean()) for k in range(kept.shape[1])}
    out["kept_heavy"] = float(kept[heavy].float().mean()) if heavy.any() else float("nan")
    out["kept_light"] = float(kept[~heavy].float().mean()) if (~heavy).any() else float("nan")
    out["w_kept"] = float(weights_TK[kept].mean()) if kept.any() else float("nan")
    out["w_dropped"] = float(weights_TK[~kept].mean()) if (~kept).any() else float("nan")
    out["tokens_all_dropped"] = float((~kept).all(1).float().mean())
    return out


def run(cfg, selection: str, ratio: float, steps: int, apply: str, eval_every: int) -> dict:
    cfg = replace(cfg, backward=replace(cfg.backward, ratio=ratio, **selection_variant(selection)))
    t = cfg.train
    torch.set_num_threads(1)
    data = TokenData.load(t.data, t.vocab_size, t.val_fraction)
    batch = t.batch * t.nproc  # the global batch of the compare run, on one process
    batches = Batches(data, cfg.model.seq_len, batch, 0, 1, t.seed)
    groups = Groups(None, 0)
    trimmed = build_model(cfg.with_train(system="lrmoe", nproc=1), data.vocab_size, groups)
    full = build_model(cfg.with_train(system="static", nproc=1), data.vocab_size, groups)
    store_t, store_f = [], []
    _hook_inputs(trimmed, store_t)
    _hook_inputs(full, store_f)
    moe_names = [n for n, _ in moe_layers(trimmed)]
    opt = torch.optim.AdamW(trimmed.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    records, evals = [], []
    for step in range(steps):
        lr = t.lr * min(1.0, (step + 1) / max(t.warmup, 1))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, tgt = batches.train_batch(step)
        full.load_state_dict(copy.deepcopy(trimmed.state_dict()))
        g_trim, dx_trim = _grads(trimmed, ids, tgt, store_t)
        g_full, dx_full = _grads(full, ids, tgt, store_f)
        rec: dict = {"step": step + 1}
        by_group: dict[str, tuple[list, list]] = {}
        for name, gf in g_full.items():
            gt = g_trim.get(name, torch.zeros_like(gf))
            a, b = by_group.setdefault(_group_of(name, moe_names), ([], []))
            a.append(gt.flatten())
            b.append(gf.flatten())
        for grp, (a, b) in by_group.items():
            rec[f"cos.{grp}"], rec[f"norm.{grp}"] = _cos_ratio(torch.cat(a), torch.cat(b))
        for i, (a, b) in enumerate(zip(dx_trim, dx_full)):
            rec[f"cos.L{i}.dx"], rec[f"norm.L{i}.dx"] = _cos_ratio(a, b)
        for i, (_, layer) in enumerate(moe_layers(trimmed)):
            with torch.no_grad():
                x = store_t[i].detach().reshape(-1, layer.config.dim)
                routing = layer.router(x)
            for k, v in _dropped(layer, routing.ids_TK, routing.weights_TK).items():
                rec[f"L{i}.{k}"] = v
        # the training signal: where to take each parameter's gradient from
        for name, p in trimmed.named_parameters():
            expert = _group_of(name, moe_names).endswith(("gate_up_proj", "down_proj"))
            use_full = (apply == "experts" and not expert) or (apply == "upstream" and expert)
            src = g_full if use_full else g_trim
            p.grad = src[name].clone() if name in src else None
        opt.step()
        for _, layer in moe_layers(trimmed):
            layer.step_end()
        records.append(rec)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                losses = [float(trimmed.loss(i, tg)[1]) for i, tg in batches.val_batches(t.eval_batches)]
            evals.append({"step": step + 1, "val_loss": float(np.mean(losses))})
    return {"records": records, "evals": evals}


def summarise(records: list[dict], window: int) -> dict[str, float]:
    """Means over the last ``window`` steps (NaN-aware)."""
    tail = records[-window:]
    keys = sorted({k for r in tail for k in r if k != "step"})
    return {k: float(np.nanmean([r.get(k, np.nan) for r in tail])) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/compare.toml")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--selections", default="lrm,random,sampled,local-sampled",
                    help="selections; name^p sets score_power p (e.g. sampled^1)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--apply", default="trimmed", help="comma list of trimmed, experts, upstream")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="runs/diagnose")
    args = ap.parse_args()
    BackwardConfig(ratio=args.ratio)  # validates the ratio before any work
    cfg = load(args.config)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for selection in args.selections.split(","):
        for apply in args.apply.split(","):
            key = f"{selection}@{args.ratio:g}/{apply}"
            t0 = time.time()
            results[key] = run(cfg, selection, args.ratio, args.steps, apply, args.eval_every)
            results[key]["summary"] = summarise(results[key]["records"], max(args.steps // 3, 1))
            print(f"{key}: final val loss {results[key]['evals'][-1]['val_loss']:.4f} ({time.time() - t0:.0f} s)",
                  flush=True)
    (out / "diagnose.json").write_text(json.dumps(results, indent=1))
    _table(results)
    _plot(results, out / "diagnose.png")


def _table(results: dict) -> None:
    cols = ["cos.L0.down_proj", "norm.L0.down_proj", "cos.L0.gate_up_proj", "cos.L0.dx", "norm.L0.dx",
            "cos.L0.router", "cos.upstream", "norm.upstream", "L0.kept_k0", "L0.kept_k1", "L0.w_kept",
            "L0.w_dropped", "L0.tokens_all_dropped"]
    print("means over the last third of the steps (L0: the first MoE layer)")
    print(f"{'run':30s} {'val':>7s} " + " ".join(f"{c.replace('L0.', ''):>12.12s}" for c in cols))
    for key, r in results.items():
        s = r["summary"]
        cells = " ".join(f"{s.get(c, float('nan')):12.4f}" for c in cols)
        print(f"{key:30s} {r['evals'][-1]['val_loss']:7.4f} {cells}")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for key, r in results.items():
        steps = [x["step"] for x in r["records"]]
        axes[0].plot(steps, [x.get("cos.L0.down_proj") for x in r["records"]], label=key, lw=0.8)
        axes[1].plot(steps, [x.get("cos.L0.dx") for x in r["records"]], label=key, lw=0.8)
        axes[2].plot([e["step"] for e in r["evals"]], [e["val_loss"] for e in r["evals"]], label=key, marker=".")
    axes[0].set_title("cos(trimmed, full): layer-0 down_proj gradient")
    axes[1].set_title("cos(trimmed, full): dx at layer 0's input")
    axes[2].set_title("validation loss")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
