"""Process groups of one rank, the all-reduces over them, and the rank's device.

Ranks form expert-parallel (EP) groups of ``ep_size`` consecutive ranks; the EP groups are the
data-parallel (DP) replicas of each other. Gradient reduction, for the global mean loss
(1/W) Σ_r loss_r: replicated parameters (embeddings, attention, norms, routers, shared
experts) are summed over all W ranks; an expert's gradient at its owner already sums its EP
group's tokens (and its replicas' gradients), so it is summed over the DP group of owners;
both are divided by W. AdamW keeps expert optimizer state at owners only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lrmoe.layer import moe_layers
from lrmoe.parallel import comm
from lrmoe.train.config import RunConfig


class Groups:
    """World, expert-parallel and data-parallel groups of this rank (None at world size 1)."""

    def __init__(self, world_group, ep_size: int) -> None:
        self.world = comm.world_size(world_group)
        self.rank = comm.rank_of(world_group)
        self.ep_size = ep_size or self.world
        self.dp_size = self.world // self.ep_size
        self.world_group = world_group
        self.ep_group = self.dp_group = None
        if self.world > 1:
            ranks = dist.get_process_group_ranks(world_group)
            for k in range(self.dp_size):  # every rank creates every group, in one order
                g = dist.new_group([ranks[k * self.ep_size + i] for i in range(self.ep_size)])
                if k == self.rank // self.ep_size:
                    self.ep_group = g if self.ep_size > 1 else None
            for i in range(self.ep_size):
                g = dist.new_group([ranks[k * self.ep_size + i] for k in range(self.dp_size)])
                if i == self.rank % self.ep_size:
                    self.dp_group = g if self.dp_size > 1 else None
        self.dp_rank = self.rank // self.ep_size


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In place, and a no-op without a group; host tensors go through the accelerator when the
    group is NCCL, so metrics kept on the host reduce the same way on CPU and GPU."""
    if group is None:
        return t
    device = comm.comm_device(group)
    if device is None or t.device == device:
        dist.all_reduce(t, op=op, group=group)
    else:
        moved = t.to(device)
        dist.all_reduce(moved, op=op, group=group)
        t.copy_(moved)
    return t


def reduce_gradients(model: torch.nn.Module, groups: Groups) -> None:
    """Gradients of the global mean loss: replicated parameters summed over all ranks, routed
    experts over the data-parallel group of owners, both divided by the world size."""
    W = groups.world
    experts = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}  # not shared ones
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce(p.grad, groups.dp_group if id(p) in experts else groups.world_group)
        p.grad.div_(W)


def train_device(cfg: RunConfig) -> torch.device:
    """``train.device``: ``auto`` takes this rank's CUDA device when there is one."""
    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device='cuda' but this machine's torch sees no CUDA device")
    return torch.device("cuda", torch.cuda.current_device())
