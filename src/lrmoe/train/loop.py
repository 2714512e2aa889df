"""The training loop of one rank: expert parallelism inside data parallelism.

Groups and gradient reduction: :mod:`lrmoe.train.groups`; the model: :mod:`lrmoe.train.build`;
what each step records (``metrics.jsonl``): :mod:`lrmoe.train.metrics`. ``routing.npz`` holds
``counts`` (steps × MoE layers × experts), the global routing counts of every step, as traces
for the simulator.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lrmoe.models import MoETransformer
from lrmoe.train import checkpoint
from lrmoe.train.build import build_model
from lrmoe.train.config import RunConfig, TrainConfig
from lrmoe.train.data import Batches, TokenData
from lrmoe.train.groups import Groups, all_reduce, reduce_gradients, train_device
from lrmoe.train.metrics import Progress, step_metrics

# Groups and reduce_gradients stay importable from here, where they lived before the split
__all__ = ["Groups", "evaluate", "reduce_gradients", "train"]


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


@torch.no_grad()
def evaluate(model: MoETransformer, batches: Batches, n: int, groups: Groups) -> float:
    """Validation cross entropy over ``n`` batches of every rank, token-weighted."""
    total = torch.zeros(2, dtype=torch.float64)
    device = next(model.parameters()).device
    for ids, tgt in batches.val_batches(n):
        _, ce = model.loss(ids.to(device), tgt.to(device))
        total += torch.tensor([ce.item() * tgt.numel(), tgt.numel()], dtype=torch.float64)
    all_reduce(total, groups.world_group)
    return float(total[0] / total[1])


def _end_moe_step(model: MoETransformer, groups: Groups, t: TrainConfig) -> float:
    """Every layer's ``step_end`` (re-planning, replica refresh) and router-bias update; returns
    the seconds spent in ``step_end``, which count as MoE time."""
    placement_s = 0.0
    for layer in model.moe_layers:
        t_place = time.perf_counter()
        layer.step_end()  # re-planning and replica refresh: MoE time too
        placement_s += time.perf_counter() - t_place
        if layer.router.e_score_correction_bias is not None and t.bias_update_rate > 0:
            counts = all_reduce(layer.last_stats["counts_E"].to(torch.float64), groups.dp_group)
            layer.update_router_bias(counts, t.bias_update_rate)
    return placement_s


def train(cfg: RunConfig, out: Path, world_group=None, resume: bool = False,
          max_steps: int | None = None, stop_at: float | None = None, eval_at: tuple[int, ...] = (),
          after_step: Callable[[int, int], None] | None = None) -> dict:
    """Run (or resume) training on this rank. ``max_steps`` overrides ``train.steps`` as the
    step budget; with ``stop_at`` the run ends at the first evaluation whose validation loss
    is at or below it. Evaluations run every ``eval_every`` steps, at every step of
    ``eval_at`` and at the end. ``after_step(step, rank)`` runs after each step's checkpoint
    (the worker's fault-injection hook). Returns rank 0's summary."""
    t = cfg.train
    out = Path(out)
    groups = Groups(world_group, t.ep_size)
    torch.set_num_threads(1)
    data = TokenData.load(t.data, t.vocab_size, t.val_fraction)
    batches = Batches(data, cfg.model.seq_len, t.batch, groups.dp_rank, groups.dp_size, t.seed)
    device = train_device(cfg)
    model = build_model(cfg, data.vocab_size, groups).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    total_steps = max_steps or t.steps
    lead = groups.rank == 0
    out.mkdir(parents=True, exist_ok=True)

    start, history = 0, {"moe_time_s": 0.0, "val": [], "routing": []}
    if resume:
        state = checkpoint.load_latest(out, groups.rank)
        if state is not None:
            start = checkpoint.restore(state, model, opt)
            history = state["history"]
    metrics_path = out / "metrics.jsonl"
    if lead:
        checkpoint.truncate_metrics(metrics_path, start)
    progress = Progress(total_steps, lead)
    eval_steps = set(eval_at)
    summary = {"stopped_at_target": False}
    for step in range(start, total_steps):
        for g in opt.param_groups:
            g["lr"] = _lr(step, t)
        t0 = time.time()
        ids, tgt = (b.to(device) for b in batches.train_batch(step))
        loss, ce = model.loss(ids, tgt)
        loss.backward()
        reduce_gradients(model, groups)
        finite = torch.tensor([float(torch.isfinite(loss).item()
                                     and all(torch.isfinite(p.grad).all() for p in model.parameters()))])
        all_reduce(finite, groups.world_group, dist.ReduceOp.MIN)
        skipped = not bool(finite.item())
        if skipped and t.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at step {step + 1}; stopping (on_nonfinite=stop)")
        if skipped and lead:
            print(f"\nstep {step + 1}: non-finite loss or gradient, step skipped (on_nonfinite=skip)",
                  file=sys.stderr, flush=True)
        if not skipped:
            opt.step()
        opt.zero_grad(set_to_none=True)
        m = step_metrics(model, groups)
        placement_s = _end_moe_step(model, groups, t)
        ce_mean = all_reduce(ce.detach().to(torch.float64).reshape(1), groups.world_group) / groups.world
        m["moe_placement_ms"] = float(all_reduce(torch.tensor([placement_s * 1e3], dtype=torch.float64),
                                                 groups.world_group, dist.ReduceOp.MAX))
        history["moe_time_s"] += (m["moe_fwd_ms"] + m["moe_bwd_ms"] + m["moe_placement_ms"]) / 1e3
        history["routing"].append(m.pop("_counts").numpy().tolist())
        record = {"step": step + 1, "loss": float(ce_mean), **m, "moe_time_s": history["moe_time_s"],
                  "tokens_per_s": groups.world * ids.numel() / max(time.time() - t0, 1e-9), "skipped": skipped}
        done = step + 1
        if done % t.eval_every == 0 or done in eval_steps or done == total_steps:
            model.eval()
            record["val_loss"] = evaluate(model, batches, t.eval_batches, groups)
            model.train()
            history["val"].append((done, record["val_loss"], history["moe_time_s"]))
        if lead:
            checkpoint.append_jsonl(metrics_path, record)
            progress.update(done, record["loss"], record["tokens_per_s"], start)
        reached = stop_at is not None and record.get("val_loss", math.inf) <= stop_at
        if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == total_steps or reached:
            checkpoint.save(out, groups.rank, done, model, opt, history, world_group)
        if reached:
            summary["stopped_at_target"] = True
            break
        if after_step is not None:
            after_step(done, groups.rank)
    if lead:
        np.savez_compressed(out / "routing.npz", counts=np.asarray(history["routing"], dtype=np.float32))
    summary.update(steps=len(history["routing"]), val=history["val"], moe_time_s=history["moe_time_s"],
                   unigram_loss=data.unigram_loss())
    if lead:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
