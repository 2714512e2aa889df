"""MoELayer: the ``nn.Module`` facade of one expert-parallel MoE layer.

It owns the parameters (router, this rank's experts or expert slices, replica copies, shared
expert and its gate), the :class:`~lrmoe.planning.planner.LayerPlanner` that decides placement
and each call's plan, and the checkpoint and full-shape views. The routed experts' forward and
backward live in :mod:`lrmoe.passes`; what each system does is read from its
:class:`~lrmoe.systems.SystemSpec` (docs/design.md "Systems").
"""

from __future__ import annotations

import torch
from torch import nn

from lrmoe.config import LOCAL_SELECTIONS, BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.experts import GroupedExperts, SwiGLU
from lrmoe.parallel import comm, sharding
from lrmoe.parallel.comm import Group
from lrmoe.parallel.replicas import Replicas
from lrmoe.passes import CallLog, CallRecord, LayerContext, RoutedExperts, routed_forward
from lrmoe.planning.controller import Controller
from lrmoe.planning.placement import Placement
from lrmoe.planning.planner import LayerPlanner
from lrmoe.router import Router, aux_losses
from lrmoe.selection.streams import SelectionStreams
from lrmoe.systems import DEFAULT_SYSTEM, PlacementKind, names_where, spec_of
from lrmoe.validation import positive_int

EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


class MoELayer(nn.Module):
    """An expert-parallel MoE layer over ``group`` (``None``: world size 1, same code).

    ``forward(x)`` takes (T, D) or (B, S, D). ``system`` selects placement and backward
    (docs/design.md "Systems"): ``static``, ``static-recompute``, ``lrmoe`` (``backward`` picks
    the selection and ratio; a ``budget`` adds the controller's quotas and replicas), ``masked``,
    ``symi`` (replicas re-planned every optimizer step), ``capacity`` (``capacity_factor``),
    ``lrmoe-capacity`` (lrmoe's backward over capacity's forward; a local selection), the replication
    family (docs/systems.md): ``fastermoe``, ``flexmoe``, ``smartmoe`` (``routing_trace``: (steps, E)
    loads for its offline pool), ``laer``, ``ultraep``, ``topoep`` (``budget.ranks_per_node``), ``llep``.
    ``last_stats`` is refreshed by each forward and backward; :meth:`step_end` after every optimizer step.

    ``budget.memory_bytes`` caps every system's expert side (docs/design.md "The paper's
    regime"; :mod:`lrmoe.planning.planner` says how each system fits): ``last_stats`` then reports
    ``memory_cap_bytes`` (and, but for lrmoe, ``predicted_peak_bytes``), and a call that cannot
    fit raises :class:`~lrmoe.errors.MemoryBudgetExceeded` on every rank before its rows move
    (a cap below a rank's owned experts, when the layer is built). ``replica_slots`` is the
    number of expert copies this rank holds in the call.
    """

    def __init__(
        self,
        config: MoEConfig,
        system: str = DEFAULT_SYSTEM,
        group: Group = None,
        backward: BackwardConfig | None = None,
        budget: ClusterBudget | None = None,
        capacity_factor: float = 1.25,
        replan_interval: int = 10,
        load_ema: float = 0.9,
        routing_trace: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be an MoEConfig, got {type(config).__name__}")
        spec = spec_of(system)
        if backward is not None and not isinstance(backward, BackwardConfig):
            raise TypeError(f"backward must be a BackwardConfig, got {type(backward).__name__}")
        if budget is not None and not isinstance(budget, ClusterBudget):
            raise TypeError(f"budget must be a ClusterBudget, got {type(budget).__name__}")
        if budget is not None and not spec.takes_budget:
            raise ValueError(f"budget is used by the systems {names_where(takes_budget=True)} (quotas, "
                             f"replicas, slots, topology), not system={system!r}")
        if spec.needs_topology and (budget is None or budget.ranks_per_node is None):
            raise ValueError(f"system={system!r} needs the topology: budget=ClusterBudget(ranks_per_node=...)")
        if routing_trace is not None and not spec.takes_trace:
            raise ValueError(f"routing_trace is used by {names_where(takes_trace=True)}, not system={system!r}")
        if backward is not None and backward.keep is not None and not spec.compacts:
            raise ValueError(f"backward keep={backward.keep!r} is for the compacting systems "
                             f"{names_where(backward='selective')}, not system={system!r}")
        if backward is not None and backward.layer_floors:
            raise ValueError(f"backward min_ratio_after={backward.min_ratio_after!r} has per-layer floors: "
                             "pass each layer its own, backward.for_layer(index, layers)")
        if backward is not None and backward.keep is not None and budget is not None and budget.memory_bytes:
            raise ValueError(f"backward keep={backward.keep!r} with a memory cap: the cap chooses what is kept")
        if not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
            raise ValueError(f"capacity_factor={capacity_factor!r} is invalid: expected a number > 0")
        positive_int("replan_interval", replan_interval)
        if not (isinstance(load_ema, (int, float)) and 0 <= load_ema < 1):
            raise ValueError(f"load_ema={load_ema!r} is invalid: expected a number in [0, 1)")
        self.config, self.system, self.spec, self.group = config, system, spec, group
        self.backward_config = backward or BackwardConfig()
        if spec.forward_drop and spec.selective and not self.backward_config.local:  # (scores of the kept pairs)
            raise ValueError(f"system={system!r} takes a local selection {LOCAL_SELECTIONS}, "
                             f"not selection={self.backward_config.selection!r}")
        self.world, self.rank = comm.world_size(group), comm.rank_of(group)
        self.planner = LayerPlanner(spec, config, self.world, self.rank, budget, self.backward_config,
                                    capacity_factor, replan_interval, load_ema, routing_trace)
        dtype = config.torch_dtype
        self.router = Router(config)
        if spec.placement is PlacementKind.SHARDED:  # a slice of every expert (sharding.py)
            sharding.check_shardable(config.ffn_dim, self.world)
            self.experts = GroupedExperts(config.num_experts, config.dim, config.ffn_dim // self.world, dtype)
        else:
            self.experts = GroupedExperts(len(self.base_placement.owned(self.rank)), config.dim, config.ffn_dim,
                                          dtype)
        self.replicas = Replicas(config.dim, config.ffn_dim, dtype)
        self.shared_experts = (
            SwiGLU(config.dim, config.shared_hidden, dtype) if config.num_shared_experts else None
        )
        # Qwen2-MoE / Qwen3-Next: the shared expert's output times sigmoid(x · w); replicated, as
        # the router and the shared expert are (only EXPERT_TENSORS are per-owner)
        self.shared_expert_gate = (
            nn.Linear(config.dim, 1, bias=False, dtype=dtype) if config.shared_expert_gate else None
        )
        self._streams = SelectionStreams(self.backward_config.seed, self.rank)  # one pair per selective backward
        self._routed = LayerContext(self.planner, spec, self.replicas, group, self.rank, self.backward_config,
                                    self._streams, self.planner.node_of)
        self._calls = CallLog()
        self._placement_bytes = 0  # parameter bytes moved since the last training call
        self._stale = self.planner.keeps_replicas  # replicas to fetch before the next forward
        self.aux_loss: torch.Tensor = torch.zeros(())
        # Replica gradients sent to their owners while the rest of the backward runs, added to
        # the owned experts' .grad when the pass ends (DDP-style). Off by default: with it,
        # torch.autograd.grad on the experts' weights would miss the replicas' share; the
        # training loop, which only calls .backward(), turns it on.
        self.overlap_replica_grads = False

    # ---------------------------------------------------------------- placement
    @property
    def placement(self) -> Placement:
        """Where experts live now (the planner's)."""
        return self.planner.placement

    @property
    def base_placement(self) -> Placement:
        return self.planner.base

    @property
    def controller(self) -> Controller | None:
        return self.planner.controller

    def _refresh_replicas(self, wait: bool = True) -> None:
        refresh = self.replicas.refresh if wait else self.replicas.start_refresh
        self._placement_bytes += refresh(self.experts.gate_up_proj.detach(), self.experts.down_proj.detach(),
                                         self.placement, self.rank, self.group)
        self._stale = False

    @torch.no_grad()
    def step_end(self) -> None:
        """Call after every optimizer step (collective): re-plans replicas when due and
        refreshes every replica from its owner's updated parameters. A no-op without replicas.
        The refresh is issued, not waited for: its rows travel while the next step runs up to
        this layer, whose forward installs them (its ``fwd_fetch`` stage holds any wait left);
        :meth:`wait_for_replicas` waits for them now."""
        if self.planner.step_end():
            self._refresh_replicas(wait=False)

    def wait_for_replicas(self) -> None:
        """Install the replicas a ``step_end`` refresh is still fetching (before a checkpoint, or
        the process group's end, so that no exchange is left under way)."""
        self.replicas.ready()

    def train_state(self) -> dict:
        """What a checkpoint needs beyond the state dict to resume exactly: load statistics,
        step and selection counters, the replica placement and the noise objective's state
        (collective with the noise objective: its pending sums, totalled over the group)."""
        noise = self.planner.noise
        return {**self.planner.state(), "backward_calls": self._streams.calls,
                "noise": None if noise is None else noise.state(self.group)}

    def load_train_state(self, state: dict) -> None:
        self.planner.load_state(state)
        if self.planner.noise is not None and state.get("noise") is not None:
            self.planner.noise.load_state(state["noise"], holder=self.rank == 0)
        self._streams.calls = int(state["backward_calls"])
        self._stale = self.planner.keeps_replicas  # refetched from the owners at the next forward

    @property
    def last_stats(self) -> dict:
        """The figures of the latest call begun or backward finished (:class:`~lrmoe.passes.CallStats`
        as a dict). A local selection's ``nonfinite`` flag stays on the device until read here,
        so the backward itself never waits for it."""
        return self._calls.stats()

    @property
    def last_kept(self) -> torch.Tensor | None:
        """(T, K) bool: the pairs the latest backward kept."""
        return self._calls.kept_TK()

    @property
    def last_scale(self) -> torch.Tensor | None:
        """(T, K): 1/π of the pairs the latest sampled backward kept (None: contributions × 1)."""
        latest = self._calls.latest_backward
        return None if latest is None else latest.scale_TK

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        D = self.config.dim
        if x.dim() not in (2, 3) or x.shape[-1] != D:
            raise ValueError(f"MoELayer expects input of shape (T, {D}) or (B, S, {D}), got {tuple(x.shape)}")
        if self._stale and self.planner.keeps_replicas:
            self._refresh_replicas()
        x_TD = x.reshape(-1, D)
        routing = self.router(x_TD)
        self.aux_loss = aux_losses(routing, self.config)
        training = torch.is_grad_enabled()
        # A training call reports the bytes moved since the last one (step_end refreshes); a
        # forward-only call (evaluation between steps) only its own, leaving those for the next.
        pending = self._placement_bytes if training else 0
        self._placement_bytes -= pending
        call = CallRecord(self._routed, routing.ids_TK, training, pending, log=self._calls,
                          overlap_grads=self.overlap_replica_grads)
        self._calls.began(call)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if training:
            out_TD = RoutedExperts.apply(x_TD, routing.weights_TK, gate_up, down, call)
        else:  # forward only: nothing is kept for a backward
            out_TD = routed_forward(call, x_TD, routing.weights_TK, gate_up, down)[0]
            call.saved.clear()
        if self.shared_experts is not None:
            shared_TD = self.shared_experts(x_TD)
            if self.shared_expert_gate is not None:
                shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
            out_TD = out_TD + shared_TD
        return out_TD.view(x.shape)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """As ``nn.Module.load_state_dict``; replicas are then refetched at the next forward."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._stale = self.planner.keeps_replicas
        return result

    # ---------------------------------------------------------------- full-shape views
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the state dict of the world-size-1 layer, keeping what this rank holds."""
        local = dict(state_dict)
        for name in EXPERT_TENSORS:
            if name not in local:
                raise KeyError(f"full state dict lacks {name!r}")
            if local[name].shape[0] != self.config.num_experts:
                raise ValueError(
                    f"{name} has {local[name].shape[0]} experts, the layer's config has {self.config.num_experts}"
                )
        full = [local[name] for name in EXPERT_TENSORS]
        if self.spec.placement is PlacementKind.SHARDED:
            mine = sharding.shard_full(*full, self.rank, self.world)
        else:
            owned = self.base_placement.owned(self.rank)
            mine = [t.index_select(0, torch.tensor(owned, dtype=torch.long, device=t.device)) for t in full]
        local.update(zip(EXPERT_TENSORS, mine))
        self.load_state_dict(local)
        if self.planner.keeps_replicas:  # every rank has the full tensors
            self.replicas.load_from_full(state_dict["experts.gate_up_proj"], state_dict["experts.down_proj"],
                                         self.placement, self.rank)
            self._stale = False

    def _gather_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full expert tensors (of the weights or their gradients), in expert order, on every
        rank: from the owners, or from every rank's slices when experts are sharded."""
        if self.spec.placement is PlacementKind.SHARDED:
            return dict(zip(EXPERT_TENSORS, sharding.gather_full(gate_up.detach(), down.detach(), self.group)))
        owned = [self.base_placement.owned(r) for r in range(self.world)]
        order = torch.tensor([e for o in owned for e in o], dtype=torch.long)
        out = {}
        for name, local in zip(EXPERT_TENSORS, (gate_up, down)):
            stacked = comm.all_gather(local.detach(), [len(o) for o in owned], self.group)
            out[name] = torch.empty_like(stacked)
            out[name][order.to(stacked.device)] = stacked
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: the world-size-1 layer's state dict, on every rank."""
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        sd.update(self._gather_experts(*(sd[name] for name in EXPERT_TENSORS)))
        return sd

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """Collective: gradients of the world-size-1 layer fed with all ranks' tokens.

        Replicated parameters (router, shared expert): summed over ranks. Experts: from owners.
        """
        grads = {}
        for name, p in self.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[name] = g if name in EXPERT_TENSORS else comm.all_reduce_sum(g.detach(), self.group)
        grads.update(self._gather_experts(*(grads[name] for name in EXPERT_TENSORS)))
        return grads

    # ---------------------------------------------------------------- training hooks
    @torch.no_grad()
    def update_router_bias(self, counts_E: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing (sigmoid router), once per optimizer step, global counts."""
        self.router.update_bias(counts_E, rate)


def moe_layers(model: nn.Module) -> list[tuple[str, MoELayer]]:
    """Every :class:`MoELayer` in ``model`` with its qualified name, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoELayer)]
