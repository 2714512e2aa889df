"""Crash-safe checkpoints and metrics files.

A checkpoint of step N is a folder ``ckpt/step_N`` with one ``rank_R.pt`` per rank (model
shard: owned experts and replicated parameters, optimizer state, each MoE layer's train state,
RNG, run history); every file is written to a temporary name, fsynced and renamed, and
``ckpt/latest`` names the step only after every rank has saved. Resuming reads ``latest`` and
falls back to older steps when a file is missing or unreadable.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.comm import Group
from lrmoe.layer import MoELayer, moe_layers
from lrmoe.train.files import atomic_write


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be read."""


def _layers(model: torch.nn.Module) -> list[MoELayer]:
    return [m for _, m in moe_layers(model)]


def save(out: Path, rank: int, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, history: dict,
         group: Group) -> None:
    """This rank's checkpoint of step ``step``; ``latest`` moves only after every rank saved."""
    folder = out / "ckpt" / f"step_{step:07d}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
        "layers": [layer.train_state() for layer in _layers(model)],
        "rng": torch.get_rng_state(), "history": history,
    }
    atomic_write(folder / f"rank_{rank}.pt", lambda f: torch.save(state, f))
    if group is not None:
        dist.barrier(group=group)
    if rank == 0:
        atomic_write(out / "ckpt" / "latest", lambda f: f.write(str(step).encode()))


def load_latest(out: Path, rank: int) -> dict | None:
    """This rank's newest readable checkpoint, or None when there is none."""
    root = out / "ckpt"
    if not root.is_dir():
        return None
    steps = sorted((int(p.name.split("_")[1]) for p in root.glob("step_*") if p.is_dir()), reverse=True)
    latest = root / "latest"
    if latest.exists():
        try:
            newest = int(latest.read_text())
            steps = [s for s in steps if s <= newest]
        except ValueError:
            pass
    tried = []
    for step in steps:
        path = root / f"step_{step:07d}" / f"rank_{rank}.pt"
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
            tried.append(f"{path} ({e.__class__.__name__})")
            print(f"checkpoint {path} is missing or unreadable ({e.__class__.__name__}); trying an older one",
                  flush=True)
    if tried:
        raise CheckpointError(f"no readable checkpoint in {root}: tried {', '.join(tried)}")
    return None


def restore(state: dict, model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Put a loaded checkpoint back (model, optimizer, layer train state, RNG); returns its step."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    for layer, s in zip(_layers(model), state["layers"], strict=True):
        layer.load_train_state(s)
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def append_jsonl(path: Path, record: dict) -> None:
    """One whole line per record, flushed and fsynced: a crash leaves no torn line."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (and drop a torn last line) before a resume."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) <= step:
            keep.append(line)
    atomic_write(path, lambda f: f.write(("\n".join(keep) + ("\n" if keep else "")).encode()))
