"""The training loop of one rank: expert parallelism inside data parallelism.

Groups and gradient reduction: :mod:`lrmoe.train.groups`; the model: :mod:`lrmoe.train.build`;
what each step records (``metrics.jsonl``, ``summary.json``): :mod:`lrmoe.train.metrics`.
``routing.npz`` holds ``counts`` (steps × MoE layers × experts), the global routing counts of
every step, as traces for the simulator. Rank 0 writes the resolved config to ``config.toml``
once every rank has started (or resumed) the run: a resume that fails leaves ``out`` as it was.
Checkpoints (:mod:`lrmoe.train.checkpoint`, :mod:`lrmoe.train.state`) load at any world size
and expert-parallel size; the step count, the data position (windows drawn) and the learning
rate schedule continue from them.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.models import MoETransformer
from lrmoe.train import checkpoint
from lrmoe.train.build import build_model
from lrmoe.train.config import RunConfig, TrainConfig, dump_toml
from lrmoe.train.data import Batches, TokenData
from lrmoe.train.files import atomic_write
from lrmoe.train.groups import Groups, all_reduce, reduce_gradients, train_device
from lrmoe.train.metrics import Progress, TensorBoardLog, grad_norm, step_metrics, val_entry
from lrmoe.train.state import TrainState

# Groups and reduce_gradients stay importable from here, where they lived before the split
__all__ = ["Groups", "PeerRankError", "TrainStream", "evaluate", "reduce_gradients", "train"]


class PeerRankError(RuntimeError):
    """Another rank could not start or resume the run; that rank reports why."""


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


class TrainStream(Batches):
    """:class:`Batches` whose training windows go on from a position: ``origin`` windows of the
    permutation were drawn before step ``origin_step``. A run resumed at another data-parallel
    size (so another global batch) thus continues where its checkpoint stopped; with the same
    size the windows are those of :class:`Batches`."""

    origin_step = 0
    origin = 0

    def position(self, step: int) -> int:
        """Windows drawn before ``step`` (not wrapped around the permutation)."""
        return self.origin + (step - self.origin_step) * self.batch * self.dp_size

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        per_step = self.batch * self.dp_size
        picks = self.order[(self.position(step) + np.arange(per_step)) % len(self.order)]
        mine = picks[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch]
        return self._windows(self.data.train, mine * self.seq_len)


def _targets(state: TrainState, out: Path) -> checkpoint.TargetsFn:
    """What a rank reads from a checkpoint (its state's keys and the run's routing history),
    after checking that the checkpoint's model is this one."""

    def targets(index: Metadata, meta: dict) -> dict[str, torch.Tensor]:
        problem = state.misfit(index)
        if problem:
            raise checkpoint.CheckpointError(
                f"--resume: the checkpoint of step {meta.get('step')} in {out} does not fit this run ({problem}); "
                f"resume with the model config it was written with")
        return {**state.targets(index), **checkpoint.empty_like_saved(index, "history/")}

    return targets


def _save(out: Path, step: int, state: TrainState, stream: TrainStream, history: dict, groups: Groups,
          keep: int) -> None:
    tensors = state.capture()
    if history["routing"]:
        tensors["history/routing"] = torch.tensor(history["routing"], dtype=torch.float64)
    meta = {"windows": stream.position(step), "world": groups.world, "ep_size": groups.ep_size,
            "history": {k: v for k, v in history.items() if k != "routing"}}
    checkpoint.save(out, step, tensors, meta, groups.world_group, groups.rank, keep)


def _start(cfg: RunConfig, out: Path, resume: bool, state: TrainState, stream: TrainStream,
           groups: Groups) -> tuple[int, dict]:
    """(the step to start from, the run history): from the last good checkpoint with ``resume``,
    at whatever world size and expert-parallel size it was written. Every rank agrees that it
    could start before rank 0 writes ``config.toml`` and trims ``metrics.jsonl`` to the
    checkpoint; a checkpoint that exists but does not fit this run is a CheckpointError."""
    start, history = 0, {"moe_time_s": 0.0, "wall_s": 0.0, "val": [], "routing": []}
    error = None
    if resume:
        try:
            found = checkpoint.load_latest(out, _targets(state, out), groups.world_group, groups.rank)
            if found is not None:
                meta, flat = found
                state.restore(flat)
                start = int(meta["step"])
                stream.origin_step, stream.origin = start, int(meta["windows"])
                routing = flat.get("history/routing")
                history = {**history, **meta["history"], "routing": [] if routing is None else routing.tolist()}
        except checkpoint.CheckpointError as e:
            error = e
    ok = all_reduce(torch.tensor([0.0 if error else 1.0]), groups.world_group, dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise PeerRankError("another rank could not resume")
    history["val"] = [val_entry(v) for v in history["val"]]
    if groups.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "config.toml", lambda f: f.write(dump_toml(cfg.to_dict()).encode()))
        checkpoint.truncate_metrics(out / "metrics.jsonl", start)
    return start, history


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
    batches = TrainStream(data, cfg.model.seq_len, t.batch, groups.dp_rank, groups.dp_size, t.seed)
    device = train_device(cfg)
    model = build_model(cfg, data.vocab_size, groups).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    total_steps = max_steps or t.steps
    lead = groups.rank == 0
    state = TrainState(model, opt, groups)
    start, history = _start(cfg, out, resume, state, batches, groups)
    metrics_path = out / "metrics.jsonl"
    progress = Progress(total_steps, start, lead)
    board = TensorBoardLog(out) if lead and t.tensorboard else None
    eval_steps = set(eval_at)
    summary = {"stopped_at_target": False, "status": "done"}
    t_run, wall_before = time.time(), history["wall_s"]
    for step in range(start, total_steps):
        lr = _lr(step, t)
        for g in opt.param_groups:
            g["lr"] = lr
        t0 = time.time()
        ids, tgt = (b.to(device) for b in batches.train_batch(step))
        try:
            loss, ce = model.loss(ids, tgt)
        except MemoryBudgetExceeded as e:  # raised alike on every rank, before any row moved
            summary.update(status="oom", oom_step=step + 1, oom=str(e))
            if lead:
                checkpoint.append_jsonl(metrics_path, {"step": step + 1, "oom": str(e)})
                progress.write(f"step {step + 1}: out of the memory cap, run stopped: {e}")
            break
        loss.backward()
        reduce_gradients(model, groups)
        finite = torch.tensor([float(torch.isfinite(loss).item()
                                     and all(torch.isfinite(p.grad).all() for p in model.parameters()))])
        all_reduce(finite, groups.world_group, dist.ReduceOp.MIN)
        skipped = not bool(finite.item())
        if skipped and t.on_nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss or gradient at step {step + 1}; stopping (on_nonfinite=stop)")
        if skipped and lead:
            progress.write(f"step {step + 1}: non-finite loss or gradient, step skipped (on_nonfinite=skip)")
        norm = grad_norm(model, groups)
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
                  "tokens_per_s": groups.world * ids.numel() / max(time.time() - t0, 1e-9), "lr": lr,
                  "grad_norm": norm, "skipped": skipped}
        done = step + 1
        if done % t.eval_every == 0 or done in eval_steps or done == total_steps:
            model.eval()
            record["val_loss"] = evaluate(model, batches, t.eval_batches, groups)
            model.train()
            history["val"].append({"step": done, "loss": record["val_loss"], "moe_time_s": history["moe_time_s"]})
        record["wall_s"] = history["wall_s"] = wall_before + time.time() - t_run
        if lead:
            checkpoint.append_jsonl(metrics_path, record)
            progress.update(done, record["loss"], record["tokens_per_s"], lr, record.get("val_loss"))
            if board is not None:
                board.log(record)
        reached = stop_at is not None and record.get("val_loss", math.inf) <= stop_at
        if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == total_steps or reached:
            _save(out, done, state, batches, history, groups, t.keep_checkpoints)
        if reached:
            summary.update(stopped_at_target=True, status="reached")
            break
        if after_step is not None:
            after_step(done, groups.rank)
    progress.close()
    if board is not None:
        board.close()
    if lead:
        np.savez_compressed(out / "routing.npz", counts=np.asarray(history["routing"], dtype=np.float32))
    summary.update(steps=len(history["routing"]), val=history["val"], moe_time_s=history["moe_time_s"],
                   wall_s=history["wall_s"], unigram_loss=data.unigram_loss())
    if lead:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
