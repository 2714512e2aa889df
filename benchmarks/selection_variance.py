"""How noisy a trimmed backward's gradients are, per selection variant: the relative mean squared
error E‖ĝ − g‖² / ‖g‖² of each gradient against the full backward's, over repeated draws on one
batch and one model state (world size 1, one process).

    python benchmarks/selection_variance.py --config configs/paper.toml --warm-steps 60 \
        --ratios 0.5 --draws 12 --variants local-sampled^0.5,local-sampled^0,local-sampled^1,local-sampled^0.5/0.1

The model first trains ``--warm-steps`` steps with the full backward (so the gradients are a
trained model's, not an initialisation's); then, on the next batch, each variant's backward is
drawn ``--draws`` times (its selection stream moves on at every call) and compared with the full
backward of the same weights, with no memory budget (each variant keeps exactly the kept ratio asked
for). Figures per gradient group: each MoE layer's expert weights
(``L0.gate_up_proj``, ``L0.down_proj``, ...), its router, dx at its input, and everything
upstream; ``experts`` pools every expert weight. An unbiased selection's error is its variance,
the noise a trimmed step adds to the optimizer's signal: the variant with the least error at a
kept ratio is the one to train with (docs/convergence.md "Variance reduction").

Variant labels: ``name`` (a selection), ``name^p`` (its ``score_power`` p), ``name^p/f`` (and its
``p_min`` floor f). Prints a table and writes JSON (``--out``): {label@ratio: {"kept": the kept
ratio of the last draw, group: rel_mse}}.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from common import print_table, selection_variant, write_json
from diagnose_selection import _grads, _group_of, _hook_inputs

from lrmoe.config import BackwardConfig
from lrmoe.layer import moe_layers
from lrmoe.train.build import build_model
from lrmoe.train.config import RunConfig, load
from lrmoe.train.data import Batches, TokenData
from lrmoe.train.groups import Groups

DEFAULT_VARIANTS = ("local-sampled^0.5,local-sampled^0,local-sampled^0.25,local-sampled^1,"
                    "local-sampled^0.5/0.1,local-sampled^0.5/0.25")


def warmed_model(cfg: RunConfig, data: TokenData, batches: Batches, steps: int) -> torch.nn.Module:
    """The config's model trained ``steps`` steps with the full backward (static, one process)."""
    t = cfg.train
    model = build_model(cfg.with_train(system="static", nproc=1), data.vocab_size, Groups(None, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = t.lr * min(1.0, (step + 1) / max(t.warmup, 1))
        ids, tgt = batches.train_batch(step)
        opt.zero_grad(set_to_none=True)
        model.loss(ids, tgt)[0].backward()
        opt.step()
        for _, layer in moe_layers(model):
            layer.step_end()
    return model


def grouped_gradients(model: torch.nn.Module, ids: torch.Tensor, tgt: torch.Tensor) -> dict[str, torch.Tensor]:
    """One backward of ``model`` on the batch: per gradient group, its gradients flattened into one
    float64 vector (each MoE layer's weights, router and input dx, everything upstream; the expert
    weights also pooled as ``experts``)."""
    moe_names = [n for n, _ in moe_layers(model)]
    inputs: list[torch.Tensor] = []
    hooks = _hook_inputs(model, inputs)
    try:
        grads, dx = _grads(model, ids, tgt, inputs)
    finally:
        for h in hooks:
            h.remove()
    parts: dict[str, list[torch.Tensor]] = {}
    for name, g in grads.items():
        group = _group_of(name, moe_names)
        group = group if group.startswith("L") else "upstream"
        parts.setdefault(group, []).append(g.flatten())
        if group.endswith(("gate_up_proj", "down_proj")):
            parts.setdefault("experts", []).append(g.flatten())
    for i, x in enumerate(dx):
        parts[f"L{i}.dx"] = [x.flatten()]
    return {k: torch.cat(v).double() for k, v in parts.items()}


def relative_errors(cfg: RunConfig, full: torch.nn.Module, reference: dict[str, torch.Tensor], data: TokenData,
                    ids: torch.Tensor, tgt: torch.Tensor, label: str, ratio: float, draws: int) -> dict[str, float]:
    """E‖ĝ − g‖² / ‖g‖² per gradient group over ``draws`` backward calls of variant ``label`` on
    ``full``'s weights (``reference``: ``full``'s own :func:`grouped_gradients` on the batch)."""
    backward = replace(cfg.backward, ratio=ratio, objective="memory", trim_after=0, **selection_variant(label))
    # no memory or network budget: on one process the config's would force its own kept ratio
    model = build_model(replace(cfg, backward=backward, budget=None).with_train(system="lrmoe", nproc=1),
                        data.vocab_size, Groups(None, 0))
    model.load_state_dict(full.state_dict())
    error = dict.fromkeys(reference, 0.0)
    for _ in range(draws):
        drawn = grouped_gradients(model, ids, tgt)
        for k, g in reference.items():
            error[k] += float((drawn.get(k, torch.zeros_like(g)) - g).pow(2).sum()) / draws
    stats = [layer.last_stats for _, layer in moe_layers(model)]
    kept = sum(float(s["kept_E"].sum()) for s in stats) / sum(float(s["counts_E"].sum()) for s in stats)
    return {"kept": kept, **{k: error[k] / float(g.pow(2).sum()) for k, g in reference.items()
                             if float(g.pow(2).sum()) > 0}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/paper.toml")
    ap.add_argument("--warm-steps", type=int, default=60, help="full-backward steps before the draws")
    ap.add_argument("--ratios", default="0.5", help="comma-separated kept ratios")
    ap.add_argument("--draws", type=int, default=12, help="backward calls per variant and ratio")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated labels (see above)")
    ap.add_argument("--out", help="JSON file")
    args = ap.parse_args(argv)
    ratios = [float(r) for r in args.ratios.split(",")]
    labels = args.variants.split(",")
    for r in ratios:
        for label in labels:
            BackwardConfig(ratio=r, **selection_variant(label))  # every label and ratio checked before any work
    torch.set_num_threads(1)
    cfg = load(args.config)
    t = cfg.train
    data = TokenData.load(t.data, t.vocab_size, t.val_fraction)
    batches = Batches(data, cfg.model.seq_len, t.batch * t.nproc, 0, 1, t.seed)  # the run's global batch
    full = warmed_model(cfg, data, batches, args.warm_steps)
    ids, tgt = batches.train_batch(args.warm_steps)
    reference = grouped_gradients(full, ids, tgt)  # the full backward, once for every variant
    rows = {}
    for r in ratios:
        for label in labels:
            rows[f"{label}@{r:g}"] = relative_errors(cfg, full, reference, data, ids, tgt, label, r, args.draws)
            print(f"{label}@{r:g}: experts {rows[f'{label}@{r:g}']['experts']:.3f}", flush=True)
    print_table(f"relative MSE of each gradient against the full backward's, {args.draws} draws after "
                f"{args.warm_steps} full steps ({args.config})",
                rows, ["kept", "experts", *sorted(set(next(iter(rows.values()))) - {"kept", "experts"})])
    write_json(args.out, rows)
    return rows


if __name__ == "__main__":
    main()
