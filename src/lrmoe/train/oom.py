"""Out of memory as a record, not a crash: a call that does not fit the memory cap stops the run.

A layer raises :class:`~lrmoe.errors.MemoryBudgetExceeded` on every rank of its expert-parallel
group alike (the plan comes from the counts they share), before any row moves. Training turns it
into :class:`OutOfMemory`, which every rank of the run raises at the same point, and the loop
records it as the run's ``oom`` stop (:func:`lrmoe.train.loop.train`). With several
expert-parallel groups (data parallelism) the groups plan from different tokens, so where a
call is planned from them (building the model, a training step's forward, an evaluation) the
ranks agree (:func:`agree`: one all-reduce, only then). Elsewhere (``step_end``'s re-plan, a
checkpoint) :func:`during` names the phase of an error every rank raises alike.

An evaluation keeps nothing for a backward and its tokens are independent of each other, so a
validation batch whose call does not fit is evaluated as two calls of half as many sequences,
each halved again where it does not fit either, down to single sequences
(:func:`validation_totals`): the same cap and byte model, fewer rows per call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.models import MoETransformer
from lrmoe.train.groups import Groups, all_reduce


class OutOfMemory(Exception):  # noqa: N818 - the run's stop, not a failure
    """A call of some rank did not fit the memory cap ``during`` a phase of the run (``setup``,
    ``training step``, ``evaluation``, ``checkpoint``); every rank raises it at the same point."""

    def __init__(self, message: str, during: str) -> None:
        super().__init__(message)
        self.during = during


def agree(groups: Groups, error: MemoryBudgetExceeded | None, during: str) -> None:
    """Raise :class:`OutOfMemory` on every rank where any rank's call did not fit (``error``:
    this rank's), with the message of the first rank that did not fit. One expert-parallel
    group raises alike and needs no collective; several agree by one all-reduce."""
    if groups.dp_size == 1:
        if error is not None:
            raise OutOfMemory(str(error), during) from error
        return
    failed = all_reduce(torch.tensor([0.0 if error is None else 1.0]), groups.world_group, dist.ReduceOp.MAX)
    if failed.item():
        messages: list[str | None] = [None] * groups.world
        dist.all_gather_object(messages, None if error is None else str(error), group=groups.world_group)
        raise OutOfMemory(next(m for m in messages if m is not None), during)


def fitting(groups: Groups, during: str, fn, *args):
    """``fn(*args)``, where ``fn`` runs no collective across expert-parallel groups; a call in it
    that does not fit the cap stops every rank (:func:`agree`)."""
    try:
        result, error = fn(*args), None
    except MemoryBudgetExceeded as e:
        result, error = None, e
    agree(groups, error, during)
    return result


@contextmanager
def during(phase: str) -> Iterator[None]:
    """A :class:`MemoryBudgetExceeded` every rank raises alike in ``phase``, as the run's stop."""
    try:
        yield
    except MemoryBudgetExceeded as e:
        raise OutOfMemory(str(e), phase) from e


def validation_totals(model: MoETransformer, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """(cross entropy summed over the tokens, tokens) of one validation batch, float64. Where its
    call does not fit the cap (every rank of the group raised alike, before any row moved), its
    halves in turn, down to single sequences; a single sequence that does not fit raises."""
    try:
        _, ce = model.loss(ids, tgt)
        return torch.tensor([ce.item() * tgt.numel(), tgt.numel()], dtype=torch.float64)
    except MemoryBudgetExceeded:
        if len(ids) == 1:
            raise
    half = len(ids) // 2
    return validation_totals(model, ids[:half], tgt[:half]) + validation_totals(model, ids[half:], tgt[half:])


@torch.no_grad()
def evaluate(model: MoETransformer, batches, n: int, groups: Groups) -> float:
    """Validation cross entropy over ``n`` batches of every rank, token-weighted; raises
    :class:`OutOfMemory` on every rank where a single sequence's call does not fit the cap."""
    total = torch.zeros(2, dtype=torch.float64)
    device = next(model.parameters()).device
    error = None
    try:
        for ids, tgt in batches.val_batches(n):
            total += validation_totals(model, ids.to(device), tgt.to(device))
    except MemoryBudgetExceeded as e:
        error = e
    agree(groups, error, "evaluation")
    all_reduce(total, groups.world_group)
    return float(total[0] / total[1])


__all__ = ["OutOfMemory", "agree", "during", "evaluate", "fitting", "validation_totals"]
