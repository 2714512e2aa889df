"""Collectives of the expert-parallel data path, with exact byte accounting.

Every exchange of a layer call goes through :func:`all_to_all` (uneven ``all_to_all_single``, or
on gloo over slow links receives-first point-to-point messages, :func:`exchange_kind`;
:func:`all_to_all_start` where the caller goes on while it travels),
including the small ones (per-expert counts, scores), so one counter sees every byte a rank
puts on the wire. A ``group`` of ``None`` or of size 1 is world size 1: the same code, no
collective. List-form ``dist.all_to_all`` is avoided on purpose: gloo rejects uneven shapes.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

Group = dist.ProcessGroup | None
A2A_ENV, COLLECTIVE, RECEIVES_FIRST = "LRMOE_A2A", "collective", "receives-first"


def comm_device(group: Group) -> torch.device | None:
    """Where the group's collectives need their tensors: the current CUDA device for NCCL, else
    anywhere (None). Host-side exchanges (counts, scores) are copied there and back."""
    if group is None or dist.get_backend(group) != "nccl":
        return None
    return torch.device("cuda", torch.cuda.current_device())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (counts, offsets, index plans) copied to ``device`` without making the host
    wait for the device: on CUDA through a pinned staging copy that the caching host allocator
    keeps alive until the transfer is done (a plain ``.to`` from pageable memory synchronises)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def world_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def rank_of(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class WireCounter:
    """Bytes this rank sent to / received from other ranks (its own chunk excluded); with
    ``node_of`` (rank → node) also the part of ``sent`` that crossed to another node."""

    sent: int = 0
    received: int = 0
    node_of: list[int] | None = None
    inter_sent: int = 0


def all_to_all(
    send_XD: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Group,
    counter: WireCounter | None = None,
) -> torch.Tensor:
    """Uneven all-to-all along dim 0: rows ``send_splits[r]`` go to rank r; returns received rows.

    Rows from rank s arrive in rank order, ``recv_splits[s]`` of them. Both split lists must be
    the ones every peer agrees on (they are derived from already-exchanged counts, never
    guessed), so no size exchange is needed here.
    """
    return all_to_all_start(send_XD, send_splits, recv_splits, group, counter).wait()


@dataclass
class PendingExchange:
    """An :func:`all_to_all_start` under way: :meth:`wait` returns the received rows."""

    recv_XD: torch.Tensor
    works: list[dist.Work]  # empty: nothing was exchanged (world 1) or it is done
    home: torch.device
    send_XD: torch.Tensor | None = None  # held until the exchange is done

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works, self.send_XD = [], None
        return self.recv_XD.to(self.home)


def all_to_all_start(
    send_XD: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: Group,
    counter: WireCounter | None = None,
) -> PendingExchange:
    """:func:`all_to_all` issued without waiting for it (every rank must issue it in the same
    order among its collectives, as any other): the rows arrive while the caller goes on, and
    :meth:`PendingExchange.wait` hands them over. ``send_XD`` must not change until then."""
    me = rank_of(group)
    if counter is not None:
        row_bytes = math.prod(send_XD.shape[1:]) * send_XD.element_size()
        counter.sent += (sum(send_splits) - send_splits[me]) * row_bytes
        counter.received += (sum(recv_splits) - recv_splits[me]) * row_bytes
        if counter.node_of is not None:
            node = counter.node_of
            counter.inter_sent += sum(n for r, n in enumerate(send_splits) if node[r] != node[me]) * row_bytes
    if world_size(group) == 1:
        return PendingExchange(send_XD, [], send_XD.device)
    home, device = send_XD.device, comm_device(group)
    send_XD = send_XD.contiguous() if device is None else send_XD.to(device).contiguous()
    recv_XD = send_XD.new_empty((sum(recv_splits), *send_XD.shape[1:]))
    if device is None and exchange_kind() == RECEIVES_FIRST:
        works = _receives_first(recv_XD, send_XD, recv_splits, send_splits, group)
    else:
        works = [dist.all_to_all_single(recv_XD, send_XD, recv_splits, send_splits, group=group, async_op=True)]
    return PendingExchange(recv_XD, works, home, send_XD)


def exchange_kind() -> str:
    """How gloo exchanges: ``collective`` (its ``all_to_all_single``, the default: fastest over one
    machine's loopback) or ``receives-first`` (:func:`_receives_first`; for links slower than the
    machine: the emulated cluster's nodes, or gloo across real machines), from ``LRMOE_A2A``."""
    kind = os.environ.get(A2A_ENV, COLLECTIVE)
    if kind not in (COLLECTIVE, RECEIVES_FIRST):
        raise ValueError(f"{A2A_ENV}={kind!r} is invalid: expected {COLLECTIVE!r} or {RECEIVES_FIRST!r}")
    return kind


def _receives_first(recv_XD: torch.Tensor, send_XD: torch.Tensor, recv_splits: list[int], send_splits: list[int],
                    group: Group) -> list[dist.Work]:
    """gloo's all-to-all as point-to-point messages, every receive posted before any send. gloo's
    own ``all_to_all_single`` posts each send before its receive, and a gloo receive is announced
    to the sender over the same connection as the data: on a link slower than the machine, the
    announcement waits behind this rank's outgoing rows, so the two directions take turns and each
    gets half the link (benchmarks/link.py; docs/results.md "Links"). Same rows, same order."""
    me, W = rank_of(group), world_size(group)
    recv_at, send_at = [0, *itertools.accumulate(recv_splits)], [0, *itertools.accumulate(send_splits)]
    works = [dist.irecv(recv_XD[recv_at[r]:recv_at[r + 1]], group=group, group_src=r)
             for r in ((me - i) % W for i in range(1, W)) if recv_splits[r]]
    works += [dist.isend(send_XD[send_at[r]:send_at[r + 1]], group=group, group_dst=r)
              for r in ((me + i) % W for i in range(1, W)) if send_splits[r]]
    recv_XD[recv_at[me]:recv_at[me + 1]].copy_(send_XD[send_at[me]:send_at[me + 1]])
    return works


def all_gather(
    x_ND: torch.Tensor, sizes: list[int], group: Group, counter: WireCounter | None = None
) -> torch.Tensor:
    """Concatenate every rank's ``x_ND`` (rank r contributes ``sizes[r]`` rows) on every rank."""
    W = world_size(group)
    if W == 1:
        return x_ND
    send = x_ND.unsqueeze(0).expand(W, *x_ND.shape).reshape(W * x_ND.shape[0], *x_ND.shape[1:])
    return all_to_all(send, [x_ND.shape[0]] * W, sizes, group, counter)


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over ranks (used outside layer calls: full-shape views, bias updates)."""
    if world_size(group) == 1:
        return x
    device = comm_device(group)
    out = x.clone() if device is None else x.to(device, copy=True)
    dist.all_reduce(out, group=group)
    return out.to(x.device)


class MemoryHook(Protocol):
    """What a :class:`Channel` tells of the row buffers its exchanges deliver and free."""

    def hold(self, *tensors: torch.Tensor | None) -> None: ...

    def drop(self, *tensors: torch.Tensor | None) -> None: ...


@dataclass
class Channel:
    """One pass of one layer call over ``group``: every exchange goes through it, so ``wire``
    counts every byte the pass puts on the wire and ``memory`` (the call's meter, once it
    exists) hears of every row buffer an exchange delivers and frees. Nothing else in the data
    path takes a counter or a meter. ``meanwhile``: host work that nothing before the pass's end
    waits for (planning, the noise measurement), done inside the next all-to-all's wait, which
    on the CPU is otherwise idle time (the rows in flight, the slowest rank still computing);
    it must issue no collective."""

    group: Group
    wire: WireCounter
    memory: MemoryHook | None = None
    meanwhile: list[Callable[[], None]] = field(default_factory=list)  # host work for the next exchange's flight

    @property
    def rank(self) -> int:
        return rank_of(self.group)

    def all_to_all(self, send_XD: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """:func:`all_to_all`; the :attr:`meanwhile` work is done while the rows travel and the
        slowest rank catches up, after the exchange is issued and before it is waited for."""
        pending = all_to_all_start(send_XD, send_splits, recv_splits, self.group, self.wire)
        try:
            self.flush()
        finally:  # (work that raises still lets the exchange finish: every rank issued it)
            recv_XD = pending.wait()
        return recv_XD

    def flush(self) -> None:
        """Do the :attr:`meanwhile` work not yet done (a pass ends with it: no exchange was left)."""
        while self.meanwhile:
            self.meanwhile.pop(0)()

    def all_gather(self, x_ND: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        return all_gather(x_ND, sizes, self.group, self.wire)

    def delivered(self, *tensors: torch.Tensor | None) -> None:
        """Row buffers an exchange (or its regroup) now holds on the expert side."""
        if self.memory is not None:
            self.memory.hold(*tensors)

    def freed(self, *tensors: torch.Tensor | None) -> None:
        if self.memory is not None:
            self.memory.drop(*tensors)
