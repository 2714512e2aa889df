"""Crash-safe checkpoints with ``torch.distributed.checkpoint`` (DCP) that load at any world
size, and the metrics-file helpers.

A checkpoint of step N is the folder ``ckpt/step_NNNNNNN``: DCP's index ``.metadata`` (keys,
shapes, file offsets), one ``__R_0.distcp`` file per rank with that rank's tensors (the keys of
:mod:`lrmoe.train.state`: replicated tensors once, each expert by its owner) and ``meta.json``
(the step, the data position, the run history; JSON, no tensors). Tensors are read back with
``torch.load(weights_only=True)``; only DCP's own index is a pickle (of its dataclasses).

Crash safety: every rank writes into ``ckpt/step_NNNNNNN.tmp``; DCP's save returns on every
rank once all files and the index are written, then rank 0 adds ``meta.json``, renames the
folder to ``step_NNNNNNN`` and only then points ``ckpt/latest`` at N, so a crash at any moment
leaves the previous checkpoint as the latest. Rank 0 then removes all but the newest ``keep``
checkpoints (and what an abandoned attempt left). A resume reads ``latest`` and falls back to
older steps when a checkpoint is missing or unreadable; the ranks take every decision together.
A shared file system is needed when the ranks run on several machines.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lrmoe.parallel.comm import Group
from lrmoe.train.files import atomic_write
from lrmoe.train.groups import all_reduce

FORMAT = 2  # 1 was one pickled file per rank, tied to the world size
META = "meta.json"
_STEP = re.compile(r"step_(\d{7})")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: none readable, another model's, an older format."""


def step_folder(out: Path, step: int) -> Path:
    return Path(out) / "ckpt" / f"step_{step:07d}"


def _steps(root: Path) -> list[int]:
    """Steps of the complete checkpoint folders in ``root`` (not ``.tmp`` ones), ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m[1]) for p in root.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name)))


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable before ``latest`` names its result."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dcp(fn: Callable, tensors: dict[str, torch.Tensor], folder: Path, group: Group) -> None:
    """``dcp.save`` or ``dcp.load`` over ``group``; without one (world size 1) in this process
    alone, which is what we mean, so DCP's warning that it assumes so is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(tensors, checkpoint_id=folder, process_group=group, no_dist=group is None)


def save(out: Path, step: int, tensors: dict[str, torch.Tensor], meta: dict, group: Group, rank: int,
         keep: int) -> None:
    """Collective: the checkpoint of step ``step`` from every rank's ``tensors`` (distinct keys
    per rank, or the same values under a shared key) and rank 0's ``meta`` (JSON); ``latest``
    moves once it is complete, then only the newest ``keep`` checkpoints stay."""
    root = Path(out) / "ckpt"
    tmp = root / f"step_{step:07d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # files of an attempt that died while saving
        tmp.mkdir(parents=True)
    if group is not None:
        dist.barrier(group=group)
    _dcp(dcp.save, tensors, tmp, group)
    if rank != 0:
        return
    atomic_write(tmp / META, lambda f: f.write(json.dumps({"format": FORMAT, "step": step, **meta}).encode()))
    final = step_folder(out, step)
    if final.exists():  # left by an attempt that died before moving ``latest`` to it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write(root / "latest", lambda f: f.write(str(step).encode()))
    prune(root, keep, step)


def prune(root: Path, keep: int, newest: int) -> None:
    """Keep the ``keep`` newest checkpoints up to ``newest`` (the latest); remove older ones,
    newer ones (an abandoned attempt's, past ``latest``) and unfinished ``.tmp`` folders."""
    steps = _steps(root)
    kept = set([s for s in steps if s <= newest][-keep:])
    for s in steps:
        if s not in kept:
            shutil.rmtree(root / f"step_{s:07d}", ignore_errors=True)
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def candidates(out: Path) -> list[int]:
    """The steps a resume tries, newest first: the complete checkpoints up to ``latest``."""
    root = Path(out) / "ckpt"
    steps = _steps(root)
    try:
        newest = int((root / "latest").read_text())
        steps = [s for s in steps if s <= newest]
    except (OSError, ValueError):  # no or a torn ``latest``: every complete folder counts
        pass
    return steps[::-1]


def _agree(ok: bool, group: Group) -> bool:
    """Whether every rank's ``ok`` holds."""
    return bool(all_reduce(torch.tensor([1.0 if ok else 0.0]), group, dist.ReduceOp.MIN).item())


def _read_index(folder: Path) -> tuple[dict, Metadata]:
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"format {meta.get('format')!r}")
    return meta, FileSystemReader(folder).read_metadata()


def _why(e: BaseException) -> str:
    """A failure's exception class names (DCP's CheckpointException: those of its ranks)."""
    if isinstance(e, CheckpointException):
        return ", ".join(sorted({type(exc).__name__ for exc, _ in e.failures.values()}))
    return e.__class__.__name__


TargetsFn = Callable[[Metadata, dict], dict[str, torch.Tensor]]


def load_latest(out: Path, targets: TargetsFn, group: Group, rank: int) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """Collective: (``meta.json``, the loaded tensors) of the newest readable checkpoint in
    ``out``, or None when there is none. ``targets(index, meta)`` gives the empty tensors this
    rank reads (it raises a CheckpointError when the checkpoint does not fit the run: the same
    on every rank). An unreadable checkpoint is skipped for an older one; none readable is a
    CheckpointError, and so is a checkpoint of the earlier pickled format."""
    tried = []
    for step in candidates(out):
        folder = step_folder(out, step)
        if any(folder.glob("rank_*.pt")) and not (folder / ".metadata").exists():
            raise CheckpointError(f"--resume: {folder} holds a checkpoint of an earlier lrmoe (one pickled file per "
                                  f"rank), which this version does not read; start the run again with --overwrite")
        reason = None
        try:
            meta, index = _read_index(folder)
        except Exception as e:  # noqa: BLE001 - a torn pickle or JSON can raise almost anything
            reason = e.__class__.__name__
        if _agree(reason is None, group):
            want = targets(index, meta)
            try:
                _dcp(dcp.load, want, folder, group)
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises one for any rank's failure
                reason = _why(e)
            if _agree(reason is None, group):
                return meta, want
        tried.append(f"{folder} ({reason or 'unreadable on another rank'})")
        if rank == 0:
            print(f"checkpoint {folder} is missing or unreadable ({reason}); trying an older one", flush=True)
    if tried:
        raise CheckpointError(f"no readable checkpoint in {Path(out) / 'ckpt'}: tried {', '.join(tried)}")
    return None


def empty_like_saved(index: Metadata, prefix: str) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like every saved key under ``prefix``, to load into."""
    return {k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in index.state_dict_metadata.items() if k.startswith(prefix)}


def read_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` of one checkpoint folder, read in this process alone (to
    inspect a checkpoint: ``read_tensors(step_folder(out, 300), "model/")``)."""
    want = empty_like_saved(FileSystemReader(folder).read_metadata(), prefix)
    _dcp(dcp.load, want, folder, None)
    return want


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
