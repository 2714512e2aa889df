"""Replica copies of other ranks' experts: refreshed from owners, gradients reduced to owners.

Owners keep parameters and optimizer state; a replica is a plain buffer (not a parameter, not
in the state dict) that receives the owner's current weights after each optimizer step or
re-placement (fetched while the next step runs up to the layer: :meth:`Replicas.start_refresh`),
and whose weight gradient is sent back and added to the owner's gradient in the backward of the
layer call that produced it (or, with the layer's ``overlap_replica_grads``, when that backward
pass ends: :class:`PendingGrads`). One expert travels as one row of 3·D·F values
(gate_up then down, flattened).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lrmoe.parallel import comm
from lrmoe.parallel.comm import Group, WireCounter
from lrmoe.planning.placement import Placement


def flat_rows(gate_up: torch.Tensor, down: torch.Tensor, idx: list[int] | None = None) -> torch.Tensor:
    """Experts ``idx`` of a set (all of them: None) as rows of 3·D·F values (gate_up then down),
    the way experts travel: only the rows that travel are copied, in ``idx``'s order (repeats
    allowed), each gathered straight into its half of the rows (one copy, not a gathered set
    then a concatenation)."""
    gu, dn = gate_up.flatten(1), down.flatten(1)
    at = torch.tensor(range(len(gu)) if idx is None else idx, dtype=torch.long, device=gu.device)
    rows = gu.new_empty((len(at), gu.shape[1] + dn.shape[1]))
    torch.index_select(gu, 0, at, out=rows[:, : gu.shape[1]])
    torch.index_select(dn, 0, at, out=rows[:, gu.shape[1]:])
    return rows


@dataclass
class _Pending:
    """A refresh under way: the exchange (None: no replica anywhere), whose rows arrive in
    replica slot order, and the experts the replicas will then be."""

    exchange: comm.PendingExchange | None
    experts: tuple[int, ...]


class Replicas(nn.Module):
    """This rank's replica weights, in its replica slot order (ascending expert id)."""

    def __init__(self, dim: int, ffn_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dim, self.ffn_dim = dim, ffn_dim
        self.register_buffer("gate_up_proj", torch.empty(0, 2 * ffn_dim, dim, dtype=dtype), persistent=False)
        self.register_buffer("down_proj", torch.empty(0, dim, ffn_dim, dtype=dtype), persistent=False)
        self.experts: tuple[int, ...] = ()
        self._pending: _Pending | None = None  # a refresh under way (start_refresh)

    def _unflat(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the (n, 2F, D) and (n, D, F) halves of rows of 3·D·F values."""
        n, D, F = rows.shape[0], self.dim, self.ffn_dim
        return rows[:, : 2 * F * D].view(n, 2 * F, D), rows[:, 2 * F * D :].view(n, D, F)

    @torch.no_grad()
    def refresh(self, gate_up: torch.Tensor, down: torch.Tensor, placement: Placement, rank: int,
                group: Group) -> int:
        """Fetch every replica this rank holds from its owner (collective). Returns the bytes this
        rank sent. A placement without replicas on any rank (every rank holds the same one)
        exchanges nothing: each rank's replica set is simply emptied."""
        sent = self.start_refresh(gate_up, down, placement, rank, group)
        self.ready()
        return sent

    @torch.no_grad()
    def start_refresh(self, gate_up: torch.Tensor, down: torch.Tensor, placement: Placement, rank: int,
                      group: Group) -> int:
        """:meth:`refresh` issued without waiting for the rows (collective): they travel while
        the caller goes on (after an optimizer step: the next step's attention), and
        :meth:`ready` installs them — every use of the replicas' weights calls it first. The
        replicas then are views of the received rows, nothing copied, so installing them inside
        a layer call allocates nothing; where rows arrive out of slot order (owners not in
        expert order, world > 2) they are put in order here instead, waited for, as a plain refresh.
        Returns the bytes this rank sent."""
        self.ready()
        mine = placement.replicas(rank)
        if placement.num_copies == placement.num_experts:
            self._pending = _Pending(None, mine)
            return 0
        W = placement.world
        owned = placement.owned(rank)
        sends = [[e for e in placement.replicas(d) if int(placement.owner_E[e]) == rank] for d in range(W)]
        send = flat_rows(gate_up, down, [owned.index(e) for d in range(W) for e in sends[d]])
        by_source = [[e for e in mine if int(placement.owner_E[e]) == s] for s in range(W)]
        wire = WireCounter()
        exchange = comm.all_to_all_start(send, [len(s) for s in sends], [len(s) for s in by_source], group, wire)
        self._pending = _Pending(exchange, mine)
        slot = [mine.index(e) for s in range(W) for e in by_source[s]]  # each received row's replica slot
        if slot != sorted(slot):  # owners not in expert order: the rows put in slot order now
            self.ready()
            order = torch.tensor(sorted(range(len(slot)), key=slot.__getitem__), device=self.gate_up_proj.device)
            self.gate_up_proj, self.down_proj = self.gate_up_proj[order], self.down_proj[order]
        return wire.sent

    def ready(self) -> None:
        """Install the rows of a refresh under way (waits for them); nothing if none is."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        # the old copies let go first (an empty slice would keep their storage)
        self.gate_up_proj = self.gate_up_proj.new_empty((0, *self.gate_up_proj.shape[1:]))
        self.down_proj = self.down_proj.new_empty((0, *self.down_proj.shape[1:]))
        if pending.exchange is not None:  # (None: no replica anywhere) the received rows are the replicas
            self.gate_up_proj, self.down_proj = self._unflat(pending.exchange.wait())
        self.experts = pending.experts

    def load_from_full(self, full_gate_up: torch.Tensor, full_down: torch.Tensor, placement: Placement,
                       rank: int) -> None:
        """Fill replicas from world-size-1 tensors every rank has (no communication)."""
        self.ready()
        mine = list(placement.replicas(rank))
        self.gate_up_proj = full_gate_up[mine].clone().to(self.gate_up_proj.dtype)
        self.down_proj = full_down[mine].clone().to(self.down_proj.dtype)
        self.experts = tuple(mine)

    def start_reduce_grads(self, dgate_up: torch.Tensor, ddown: torch.Tensor, placement: Placement, rank: int,
                           group: Group, wire: WireCounter) -> PendingGrads:
        """Send replica-slot gradients to their owners without waiting (collective): the returned
        :class:`PendingGrads` adds what this rank's owned experts receive from others' replicas
        into their gradients (only the experts that have replicas are touched)."""
        W = placement.world
        mine = placement.replicas(rank)
        to_owner = [[e for e in mine if int(placement.owner_E[e]) == d] for d in range(W)]
        send = flat_rows(dgate_up, ddown, [mine.index(e) for d in range(W) for e in to_owner[d]])
        owned = placement.owned(rank)
        from_src = [[e for e in placement.replicas(s) if int(placement.owner_E[e]) == rank] for s in range(W)]
        exchange = comm.all_to_all_start(send, [len(x) for x in to_owner], [len(x) for x in from_src], group, wire)
        idx = torch.tensor([owned.index(e) for s in range(W) for e in from_src[s]], dtype=torch.long,
                           device=dgate_up.device)
        return PendingGrads(exchange, idx, self._unflat)


@dataclass
class PendingGrads:
    """Replica gradients on their way to the owners (:meth:`Replicas.start_reduce_grads`)."""

    exchange: comm.PendingExchange
    idx: torch.Tensor  # the owned slot of each received row
    unflat: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

    def add_into(self, own_gu: torch.Tensor | None, own_down: torch.Tensor | None) -> None:
        """Wait for the rows and add them into the owned experts' gradients (None: not wanted)."""
        recv = self.exchange.wait()
        if not len(recv):
            return
        idx = self.idx.to(recv.device)
        for own, got in zip((own_gu, own_down), self.unflat(recv)):
            if own is not None:
                own.index_add_(0, idx, got)
