"""lrmoe's routed-experts path below a router it does not own, on expert weights it does not own.

:class:`~lrmoe.layer.MoELayer` owns its router and its experts' parameters. Another library's
expert parallelism (transformers' ``EPImplementation``, :mod:`lrmoe.integrations.transformers`)
owns both and hands over, per call, the routed pairs (``ids_TK``, ``weights_TK``) and this rank's
expert weights. :class:`RoutedPath` runs the same passes on them (:mod:`lrmoe.passes`: the
planner's call plan, the dispatch, the complete forward, the compacted, trimmed backward and its
quotas) and keeps only what the passes carry across calls: the planner (load, placement, optimizer
steps), the replica copies a budget places, the selection streams, and the call log behind
``last_stats``. The expert weights are used as given: no copy is made of them, and their
gradients are returned to the owner's autograd graph.
"""

from __future__ import annotations

import torch

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.parallel import comm
from lrmoe.parallel.comm import Group
from lrmoe.parallel.replicas import Replicas
from lrmoe.passes import CallLog, CallRecord, LayerContext, RoutedExperts, routed_forward
from lrmoe.planning.placement import Placement
from lrmoe.planning.planner import LayerPlanner
from lrmoe.selection.streams import SelectionStreams
from lrmoe.systems import spec_of

SYSTEM = "lrmoe"


def check_settings(backward: BackwardConfig | None, budget: ClusterBudget | None) -> None:
    """One-line errors for settings the path cannot take, before any model is built."""
    if backward is not None and not isinstance(backward, BackwardConfig):
        raise TypeError(f"backward must be a BackwardConfig, got {type(backward).__name__}")
    if budget is not None and not isinstance(budget, ClusterBudget):
        raise TypeError(f"budget must be a ClusterBudget, got {type(budget).__name__}")
    if backward is not None and backward.layer_floors:
        # the path does not know which MoE layer of the model it serves
        raise ValueError(f"backward min_ratio_after={backward.min_ratio_after!r} has per-layer floors; "
                         "the transformers path takes one floor for every layer")
    if backward is not None and backward.keep is not None and budget is not None and budget.memory_bytes:
        raise ValueError(f"backward keep={backward.keep!r} with a memory cap: the cap chooses what is kept")


class RoutedPath:
    """The routed experts of one MoE layer (``config``: its global shape, top-k and dtype) over the
    expert-parallel ``group``, rank r holding experts [r·E/W, (r+1)·E/W) (the static placement,
    which is how transformers shards them: ``Shard(0)``)."""

    def __init__(self, config: MoEConfig, group: Group, backward: BackwardConfig | None = None,
                 budget: ClusterBudget | None = None) -> None:
        check_settings(backward, budget)
        spec = spec_of(SYSTEM)
        self.config, self.group = config, group
        self.backward = backward or BackwardConfig()
        self.world, self.rank = comm.world_size(group), comm.rank_of(group)
        self.planner = LayerPlanner(spec, config, self.world, self.rank, budget, self.backward)
        self.replicas = Replicas(config.dim, config.ffn_dim, config.torch_dtype)
        self._streams = SelectionStreams(self.backward.seed, self.rank)
        self._context = LayerContext(self.planner, spec, self.replicas, group, self.rank, self.backward,
                                     self._streams, self.planner.node_of)
        self._calls = CallLog()
        self._stale = self.planner.keeps_replicas  # replicas to fetch before the next training call
        self._placement_bytes = 0  # parameter bytes moved since the last training call

    @property
    def placement(self) -> Placement:
        return self.planner.placement

    def step_end(self) -> None:
        """After an optimizer step (no collective): the planner counts it (trim_after, floors,
        replica re-plans) and replicas are refetched from the updated owners at the next call."""
        if self.planner.step_end():
            self._stale = True

    def __call__(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
        """out_TD = Σ_k w_tk · expert_{ids_tk}(x_t) for this rank's T tokens (collective over the
        group). ``ids_TK``: global expert ids; ``gate_up`` (E/W, 2F, D) and ``down`` (E/W, D, F):
        this rank's experts. Differentiable in x, the weights and both expert tensors."""
        if self._stale:
            self.replicas.to(gate_up.device)
            self._placement_bytes += self.replicas.refresh(gate_up.detach(), down.detach(), self.placement,
                                                           self.rank, self.group)
            self._stale = False
        training = torch.is_grad_enabled()
        # a training call reports the bytes moved since the last one; a forward-only call leaves them
        pending = self._placement_bytes if training else 0
        self._placement_bytes -= pending
        call = CallRecord(self._context, ids_TK, training, pending, log=self._calls)
        self._calls.began(call)
        if training:
            return RoutedExperts.apply(x_TD, weights_TK, gate_up, down, call)
        out_TD = routed_forward(call, x_TD, weights_TK, gate_up, down)[0]
        call.saved.clear()  # forward only: nothing is kept for a backward
        return out_TD

    @property
    def last_stats(self) -> dict:
        """The latest call's figures, as :attr:`MoELayer.last_stats <lrmoe.layer.MoELayer.last_stats>`."""
        return self._calls.stats()

    @property
    def last_kept(self) -> torch.Tensor | None:
        """(T, K) bool: the pairs the latest backward kept."""
        return self._calls.kept_TK()
