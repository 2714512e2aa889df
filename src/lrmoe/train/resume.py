"""Where a rank's run starts and what it leaves to continue from: the step and history of the last
good checkpoint (at any world size and expert-parallel size), the data position it had reached
(:class:`TrainStream`), and the checkpoint written at a step (:mod:`lrmoe.train.checkpoint`,
:mod:`lrmoe.train.state`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from lrmoe.train import checkpoint
from lrmoe.train.config import RunConfig
from lrmoe.train.data import Batches
from lrmoe.train.files import atomic_write
from lrmoe.train.groups import Groups, all_reduce
from lrmoe.train.metrics import val_entry
from lrmoe.train.state import TrainState
from lrmoe.train.toml_dump import dump_toml


class PeerRankError(RuntimeError):
    """Another rank could not start or resume the run; that rank reports why."""


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


def save(out: Path, step: int, state: TrainState, stream: TrainStream, history: dict, groups: Groups,
          keep: int) -> None:
    """The checkpoint of ``step``: every rank's state, the routing history, and the data position
    and sizes a resume at another world size needs (the newest ``keep`` checkpoints stay)."""
    tensors = state.capture()
    if history["routing"]:
        tensors["history/routing"] = torch.tensor(history["routing"], dtype=torch.float64)
    meta = {"windows": stream.position(step), "world": groups.world, "ep_size": groups.ep_size,
            "history": {k: v for k, v in history.items() if k != "routing"}}
    checkpoint.save(out, step, tensors, meta, groups.world_group, groups.rank, keep)


def fresh_history() -> dict:
    """The history of a run that starts at step 0."""
    return {"moe_time_s": 0.0, "wall_s": 0.0, "train_wall_s": 0.0, "val": [], "routing": []}


def start(cfg: RunConfig, out: Path, resume: bool, state: TrainState, stream: TrainStream,
          groups: Groups) -> tuple[int, dict]:
    """(the step to start from, the run history): from the last good checkpoint with ``resume``,
    at whatever world size and expert-parallel size it was written. Every rank agrees that it
    could start before rank 0 writes ``config.toml`` and trims ``metrics.jsonl`` to the
    checkpoint (:func:`begin`); a checkpoint that exists but does not fit this run is a
    CheckpointError."""
    start, history = 0, fresh_history()
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
    return begin(cfg, out, start, history, groups.rank)


def begin(cfg: RunConfig, out: Path, start: int, history: dict, rank: int) -> tuple[int, dict]:
    """The run begins at ``start``: rank 0 writes ``config.toml`` and trims ``metrics.jsonl`` to
    that step. Returns (``start``, ``history`` with its evaluations in today's form)."""
    history["val"] = [val_entry(v) for v in history["val"]]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "config.toml", lambda f: f.write(dump_toml(cfg.to_dict()).encode()))
        checkpoint.truncate_metrics(out / "metrics.jsonl", start)
    return start, history


def unbuilt_start(cfg: RunConfig, out: Path, resume: bool, rank: int) -> tuple[int, dict]:
    """Where a run whose model cannot be built stops (the memory cap cannot hold a rank's
    experts): with ``resume``, at the newest checkpoint whose ``meta.json`` and routing history
    this process reads alone (they need no model), else at step 0; then as :func:`begin`."""
    start, history = 0, fresh_history()
    for step in checkpoint.candidates(out) if resume else []:
        folder = checkpoint.step_folder(out, step)
        try:
            meta = json.loads((folder / checkpoint.META).read_text())
            routing = checkpoint.read_tensors(folder, "history/").get("history/routing")
        except Exception:  # noqa: BLE001 - a torn checkpoint can raise almost anything: try an older one
            continue
        start = int(meta["step"])
        history = {**history, **meta["history"], "routing": [] if routing is None else routing.tolist()}
        break
    return begin(cfg, out, start, history, rank)
