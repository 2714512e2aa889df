"""The training loop of one rank: expert parallelism inside data parallelism.

Groups and gradient reduction: :mod:`lrmoe.train.groups`; the model: :mod:`lrmoe.train.build`;
what each step records (``metrics.jsonl``, ``summary.json``): :mod:`lrmoe.train.metrics`.
``routing.npz`` holds ``counts`` (steps × MoE layers × experts), the global routing counts of
every step, as traces for the simulator. Rank 0 writes the resolved config to ``config.toml``
once every rank has started (or resumed) the run: a resume that fails leaves ``out`` as it was. A
call that does not fit the memory cap anywhere, building the model included, is the run's
``oom`` stop, not a failure (:mod:`lrmoe.train.oom`, :func:`_stop_oom`).
Checkpoints (:mod:`lrmoe.train.checkpoint`, :mod:`lrmoe.train.state`; where a run starts:
:mod:`lrmoe.train.resume`) load at any world size and expert-parallel size; the step count, the
data position (windows drawn) and the learning rate schedule continue from them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.models import MoETransformer
from lrmoe.train import checkpoint
from lrmoe.train.build import build_model, for_training, wait_for_replicas
from lrmoe.train.config import RunConfig, TrainConfig
from lrmoe.train.data import TokenData
from lrmoe.train.groups import Groups, all_reduce, reduce_gradients, train_device
from lrmoe.train.hf_model import save_pretrained
from lrmoe.train.metrics import Progress, TensorBoardLog, grad_norm, nonfinite, step_metrics
from lrmoe.train.oom import OutOfMemory, agree, during, evaluate, fitting
from lrmoe.train.resume import PeerRankError, TrainStream, fresh_history, save, unbuilt_start
from lrmoe.train.resume import start as resume_from
from lrmoe.train.state import TrainState

# names that lived here before the splits (lrmoe.train.groups, lrmoe.train.resume) stay importable
__all__ = ["Groups", "PeerRankError", "TrainStream", "evaluate", "reduce_gradients", "train"]


def _lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


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


@dataclass
class _Run:
    """One rank's run from its setup to its summary: what every phase of a step reads (the model,
    optimizer and state once built: :func:`_build`)."""

    cfg: RunConfig
    out: Path
    groups: Groups
    data: TokenData
    batches: TrainStream
    device: torch.device
    total_steps: int
    model: MoETransformer | None = None
    opt: torch.optim.Optimizer | None = None
    state: TrainState | None = None
    start: int = 0
    history: dict = field(default_factory=fresh_history)
    progress: Progress | None = None
    board: TensorBoardLog | None = None
    t_run: float = 0.0  # this session's start (time.time()); wall_s goes on from the checkpoint's
    wall_before: float = 0.0

    @property
    def lead(self) -> bool:
        return self.groups.rank == 0

    @property
    def metrics_path(self) -> Path:
        return self.out / "metrics.jsonl"


def _prepare(cfg: RunConfig, out: Path, world_group, max_steps: int | None) -> _Run:
    """Groups and data of the run."""
    t = cfg.train
    groups = Groups(world_group, t.ep_size)
    torch.set_num_threads(1)
    data = TokenData.load(t.data, t.vocab_size, t.val_fraction, t.hf_model)
    batches = TrainStream(data, cfg.model.seq_len, t.batch, groups.dp_rank, groups.dp_size, t.seed)
    return _Run(cfg, out, groups, data, batches, train_device(cfg), max_steps or t.steps)


def _build(run: _Run, resume: bool) -> None:
    """Model, optimizer, the step to start from (:func:`lrmoe.train.resume.start`) and the
    loggers. Where a rank's model cannot be built within the memory cap, every rank raises
    :class:`OutOfMemory` at the step the run would have started from (its loggers set up)."""
    cfg, t, groups = run.cfg, run.cfg.train, run.groups
    error = None
    try:
        run.model = for_training(build_model(cfg, run.data.vocab_size, groups)).to(run.device)
    except MemoryBudgetExceeded as e:
        error = e
    try:
        agree(groups, error, "setup")
    except OutOfMemory:
        run.start, run.history = unbuilt_start(cfg, run.out, resume, groups.rank)
        _loggers(run)
        raise
    run.opt = torch.optim.AdamW(run.model.parameters(), lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    run.state = TrainState(run.model, run.opt, groups)
    run.start, run.history = resume_from(cfg, run.out, resume, run.state, run.batches, groups)
    _loggers(run)


def _loggers(run: _Run) -> None:
    """Progress, TensorBoard and the session's clock, from the step the run starts at."""
    run.progress = Progress(run.total_steps, run.start, run.lead)
    run.board = TensorBoardLog(run.out) if run.lead and run.cfg.train.tensorboard else None
    run.t_run, run.wall_before = time.time(), run.history["wall_s"]


def _stop_oom(run: _Run, step: int, oom: OutOfMemory, summary: dict) -> None:
    """The run ends at step ``step + 1``, where a call did not fit the memory cap ``during`` a
    phase (every rank stops there): the metrics' last line ``{"step", "oom", "during"}``."""
    summary.update(status="oom", oom_step=step + 1, oom=str(oom), oom_during=oom.during)
    if run.lead:
        checkpoint.append_jsonl(run.metrics_path, {"step": step + 1, "oom": str(oom), "during": oom.during})
        run.progress.write(f"step {step + 1}: out of the memory cap ({oom.during}), run stopped: {oom}")


def _update(run: _Run, loss: torch.Tensor, step: int) -> tuple[bool, float]:
    """Backward, gradient reduction and the optimizer step, skipped (or the run stopped, by
    ``on_nonfinite``) where any rank's loss or gradient is not finite. Returns (skipped, norm)."""
    model, groups, t = run.model, run.groups, run.cfg.train
    loss.backward()
    reduce_gradients(model, groups)
    norm = grad_norm(model, groups)
    finite = torch.tensor([float(not nonfinite(loss, norm, model))])
    all_reduce(finite, groups.world_group, dist.ReduceOp.MIN)
    skipped = not bool(finite.item())
    if skipped and t.on_nonfinite == "stop":
        raise FloatingPointError(f"non-finite loss or gradient at step {step + 1}; stopping (on_nonfinite=stop)")
    if skipped and run.lead:
        run.progress.write(f"step {step + 1}: non-finite loss or gradient, step skipped (on_nonfinite=skip)")
    if not skipped:
        run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    return skipped, norm


def _record(run: _Run, step: int, ce: torch.Tensor, tokens: int, t0: float, lr: float, skipped: bool,
            norm: float) -> dict:
    """The step's ``metrics.jsonl`` record (before evaluation), after the layers' ``step_end``;
    adds the step's MoE time and routing counts to the run's history."""
    groups, history = run.groups, run.history
    m = step_metrics(run.model, groups)
    placement_s = _end_moe_step(run.model, groups, run.cfg.train)
    ce_mean = all_reduce(ce.detach().to(torch.float64).reshape(1), groups.world_group) / groups.world
    m["moe_placement_ms"] = float(all_reduce(torch.tensor([placement_s * 1e3], dtype=torch.float64),
                                             groups.world_group, dist.ReduceOp.MAX))
    history["moe_time_s"] += (m["moe_fwd_ms"] + m["moe_bwd_ms"] + m["moe_placement_ms"]) / 1e3
    history["routing"].append(m.pop("_counts").numpy().tolist())
    step_s = max(time.time() - t0, 1e-9)  # the training step alone: no evaluation, no checkpoint
    history["train_wall_s"] += step_s
    return {"step": step + 1, "loss": float(ce_mean), **m, "moe_time_s": history["moe_time_s"],
            "step_ms": 1e3 * step_s, "train_wall_s": history["train_wall_s"],
            "tokens_per_s": groups.world * tokens / step_s, "lr": lr, "grad_norm": norm, "skipped": skipped}


def _validate(run: _Run, record: dict) -> None:
    """The validation loss into ``record`` and the run's history."""
    run.model.eval()
    record["val_loss"] = evaluate(run.model, run.batches, run.cfg.train.eval_batches, run.groups)
    run.model.train()
    run.history["val"].append({"step": record["step"], "loss": record["val_loss"],
                               "moe_time_s": run.history["moe_time_s"]})


def _log(run: _Run, record: dict) -> None:
    """Rank 0 appends the record to ``metrics.jsonl``, the progress bar and TensorBoard."""
    if not run.lead:
        return
    checkpoint.append_jsonl(run.metrics_path, record)
    run.progress.update(record["step"], record["loss"], record["tokens_per_s"], record["lr"],
                        record.get("val_loss"))
    if run.board is not None:
        run.board.log(record)


def _finish(run: _Run, summary: dict) -> dict:
    """Close the loggers; rank 0 writes ``routing.npz`` and ``summary.json``. Returns the summary."""
    wait_for_replicas(run.model)
    run.progress.close()
    if run.board is not None:
        run.board.close()
    history = run.history
    summary.update(steps=len(history["routing"]), val=history["val"], moe_time_s=history["moe_time_s"],
                   wall_s=history["wall_s"], train_wall_s=history["train_wall_s"], unigram_loss=run.data.unigram_loss())
    if run.lead:
        np.savez_compressed(run.out / "routing.npz", counts=np.asarray(history["routing"], dtype=np.float32))
        (run.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _step(run: _Run, step: int, eval_steps: set[int], stop_at: float | None, summary: dict) -> bool:
    """One optimizer step: forward, backward and update, its record, an evaluation when due and a
    checkpoint when due. Returns whether the run stops (the target reached); raises
    :class:`OutOfMemory` where a call does not fit the memory cap (an evaluation's after the
    step's record is written)."""
    t = run.cfg.train
    lr = _lr(step, t)
    for g in run.opt.param_groups:
        g["lr"] = lr
    t0 = time.time()
    ids, tgt = (b.to(run.device) for b in run.batches.train_batch(step))
    loss, ce = fitting(run.groups, "training step", run.model.loss, ids, tgt)  # before any row moved
    skipped, norm = _update(run, loss, step)
    with during("training step"):  # step_end's re-plan
        record = _record(run, step, ce, ids.numel(), t0, lr, skipped, norm)
    done = step + 1
    if done % t.eval_every == 0 or done in eval_steps or done == run.total_steps:
        try:
            _validate(run, record)
        except OutOfMemory:
            _log(run, _clock(run, record))
            raise
    _log(run, _clock(run, record))
    reached = stop_at is not None and record.get("val_loss", math.inf) <= stop_at
    if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == run.total_steps or reached:
        with during("checkpoint"):
            wait_for_replicas(run.model)
            save(run.out, done, run.state, run.batches, run.history, run.groups, t.keep_checkpoints)
            if t.hf_model:
                _export(run, done, final=done == run.total_steps or reached)
    if reached:
        summary.update(stopped_at_target=True, status="reached")
    return reached


def _export(run: _Run, done: int, final: bool) -> None:
    """Collective: the transformers folder of the checkpoint of step ``done`` (``ckpt/step_N/hf``);
    at the run's end (``final``: its last step, or the target reached) rank 0 copies it to
    ``out/hf``, through a temporary name."""
    folder = checkpoint.step_folder(run.out, done) / "hf"
    save_pretrained(run.model, folder, run.groups, run.cfg.train.hf_model)
    if final and run.lead:
        tmp = run.out / f"hf.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp)
        shutil.rmtree(run.out / "hf", ignore_errors=True)
        os.replace(tmp, run.out / "hf")


def _clock(run: _Run, record: dict) -> dict:
    """``record`` with the run's wall-clock seconds so far (also the history's)."""
    record["wall_s"] = run.history["wall_s"] = run.wall_before + time.time() - run.t_run
    return record


def train(cfg: RunConfig, out: Path, world_group=None, resume: bool = False,
          max_steps: int | None = None, stop_at: float | None = None, eval_at: tuple[int, ...] = (),
          after_step: Callable[[int, int], None] | None = None) -> dict:
    """Run (or resume) training on this rank. ``max_steps`` overrides ``train.steps`` as the
    step budget; with ``stop_at`` the run ends at the first evaluation whose validation loss
    is at or below it. Evaluations run every ``eval_every`` steps, at every step of
    ``eval_at`` and at the end. ``after_step(step, rank)`` runs after each step's checkpoint
    (the worker's fault-injection hook). A call that does not fit the memory cap anywhere
    (building the model, a step, an evaluation, a checkpoint) stops the run as ``oom`` at that
    step (:func:`_stop_oom`). Returns rank 0's summary."""
    run = _prepare(cfg, Path(out), world_group, max_steps)
    summary = {"stopped_at_target": False, "status": "done"}
    step, eval_steps = None, set(eval_at)
    try:
        _build(run, resume)
        for step in range(run.start, run.total_steps):
            if _step(run, step, eval_steps, stop_at, summary):
                break
            if after_step is not None:
                after_step(step + 1, run.groups.rank)
    except OutOfMemory as oom:  # every rank stops at the same point
        _stop_oom(run, run.start if step is None else step, oom, summary)
    return _finish(run, summary)
