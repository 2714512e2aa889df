"""Fully sharded experts (the ``laer`` system, after LAER-MoE): every rank holds a slice of
every expert, and the experts a call needs are assembled by an all-to-all of slices.

Slices run along the expert hidden dimension F, so a shard keeps the 3-D layout: rank q holds
rows ``[q·F/W, (q+1)·F/W)`` of the gate and of the up projection (``gate_up`` shard
(E, 2F/W, D), gate rows first) and the same columns of ``down`` ((E, D, F/W)). Parameters and
optimizer state per rank are 1/W of all experts; an expert assembled on a rank costs its
(W−1)/W remote slices on the wire, and its weight gradient goes back the same way, summed into
the slices' owners (a reduce-scatter written as one all-to-all). One expert slice travels as one
row of 3·D·F/W values (gate, up, down).
"""

from __future__ import annotations

import torch

from lrmoe.parallel import comm
from lrmoe.parallel.comm import Group, WireCounter
from lrmoe.parallel.replicas import flat_rows
from lrmoe.planning.placement import Placement
from lrmoe.systems import PlacementKind, names_where


def check_shardable(ffn_dim: int, world: int) -> None:
    if ffn_dim % world:
        sharded = names_where(placement=PlacementKind.SHARDED)[0]  # the one system that shards its experts
        raise ValueError(f"system={sharded!r} shards the expert hidden size over ranks: ffn_dim={ffn_dim} must be "
                         f"a multiple of the world size {world}")


def shard_full(gate_up_EXD: torch.Tensor, down_EDF: torch.Tensor, rank: int, world: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slices of full expert weights ((E, 2F, D), (E, D, F))."""
    F = down_EDF.shape[2]
    f = F // world
    lo, hi = rank * f, (rank + 1) * f
    gate_up = torch.cat([gate_up_EXD[:, lo:hi], gate_up_EXD[:, F + lo : F + hi]], dim=1)
    return gate_up.contiguous(), down_EDF[:, :, lo:hi].contiguous()


def _unshard(rows_WLX: torch.Tensor, D: int, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slices from each of W ranks for L experts (rank-major) → full (L, 2F, D), (L, D, F)."""
    W, L = rows_WLX.shape[:2]
    gu = rows_WLX[..., : 2 * f * D].reshape(W, L, 2, f, D)
    gate_up = gu.permute(1, 2, 0, 3, 4).reshape(L, 2 * W * f, D)  # (gate | up), each rank-ordered
    down = rows_WLX[..., 2 * f * D :].reshape(W, L, D, f).permute(1, 2, 0, 3).reshape(L, D, W * f)
    return gate_up, down


def _reshard(gate_up_LXD: torch.Tensor, down_LDF: torch.Tensor, world: int) -> torch.Tensor:
    """Inverse of :func:`_unshard`: full (L, 2F, D), (L, D, F) → rows (W, L, 3·D·F/W)."""
    L, _, D = gate_up_LXD.shape
    f = down_LDF.shape[2] // world
    gu = gate_up_LXD.reshape(L, 2, world, f, D).permute(2, 0, 1, 3, 4).reshape(world, L, 2 * f * D)
    dn = down_LDF.reshape(L, D, world, f).permute(2, 0, 1, 3).reshape(world, L, D * f)
    return torch.cat([gu, dn], dim=2)


def assemble(gate_up_s: torch.Tensor, down_s: torch.Tensor, placement: Placement, rank: int, group: Group,
             wire: WireCounter) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: full weights of the experts in this rank's slots (slot order), from every
    rank's slices. ``wire`` counts the slice bytes."""
    W = placement.world
    mine = list(placement.slots[rank])
    send = flat_rows(gate_up_s, down_s, [e for d in range(W) for e in placement.slots[d]])
    recv = comm.all_to_all(send, [len(placement.slots[d]) for d in range(W)], [len(mine)] * W, group, wire)
    return _unshard(recv.view(W, len(mine), -1), gate_up_s.shape[2], down_s.shape[2])


def reduce_grads(dgate_up_LXD: torch.Tensor, ddown_LDF: torch.Tensor, placement: Placement, rank: int,
                 group: Group, wire: WireCounter, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: slot weight gradients → this rank's slice gradients, summed over every rank
    that assembled each expert (zeros for experts nobody assembled)."""
    W = placement.world
    D, f = dgate_up_LXD.shape[2], ddown_LDF.shape[2] // W
    send = _reshard(dgate_up_LXD, ddown_LDF, W).reshape(-1, 3 * D * f)
    sizes = [len(placement.slots[d]) for d in range(W)]
    recv = comm.all_to_all(send, [len(placement.slots[rank])] * W, sizes, group, wire)
    acc = recv.new_zeros(num_experts, 3 * D * f)
    idx = torch.tensor([e for d in range(W) for e in placement.slots[d]], dtype=torch.long)
    if len(idx):
        acc.index_add_(0, idx.to(acc.device), recv)
    return acc[:, : 2 * f * D].reshape(num_experts, 2 * f, D), acc[:, 2 * f * D :].reshape(num_experts, D, f)


def gather_full(gate_up_s: torch.Tensor, down_s: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Collective: the full (E, 2F, D), (E, D, F) expert tensors on every rank."""
    W, E = comm.world_size(group), gate_up_s.shape[0]
    rows = comm.all_gather(flat_rows(gate_up_s, down_s), [E] * W, group)
    return _unshard(rows.view(W, E, -1), gate_up_s.shape[2], down_s.shape[2])
