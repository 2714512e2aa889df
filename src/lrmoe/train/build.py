"""The model of one rank: expert-parallel MoE layers with the same initial weights everywhere,
and the routing trace (an earlier run's ``routing.npz``) a trace-taking system plans from."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.layer import MoELayer, moe_layers
from lrmoe.models import ModelConfig, MoETransformer
from lrmoe.parallel import sharding
from lrmoe.planning.planner import LayerPlanner
from lrmoe.systems import PlacementKind, spec_of
from lrmoe.train.config import ConfigError, RunConfig
from lrmoe.train.groups import Groups
from lrmoe.train.hf_model import HFCausalLM, build_hf_model


def build_model(cfg: RunConfig, vocab_size: int, groups: Groups) -> MoETransformer | HFCausalLM:
    """The model with EP layers, initialised from the world-size-1 model of the same seed (or
    loaded from ``train.hf_model``), so every system, world size and EP layout starts from
    identical weights."""
    if cfg.train.hf_model:
        return build_hf_model(cfg, vocab_size, groups)
    model_cfg = replace(cfg.model, vocab_size=vocab_size)
    torch.manual_seed(cfg.train.seed)
    full = MoETransformer(model_cfg).state_dict()
    t = cfg.train
    budget = cfg.budget if spec_of(t.system).takes_budget else None
    trace_SLE = read_routing_trace(t.routing_trace, model_cfg) if t.routing_trace else None

    moe_count = model_cfg.n_layers - model_cfg.first_dense_layers

    def make_moe(i: int) -> MoELayer:
        j = i - model_cfg.first_dense_layers  # its index among the MoE layers
        return MoELayer(model_cfg.moe, system=t.system, group=groups.ep_group,
                        backward=cfg.backward.for_layer(j, moe_count), budget=budget,
                        capacity_factor=t.capacity_factor, replan_interval=t.replan_interval,
                        routing_trace=None if trace_SLE is None else trace_SLE[:, j])

    model = MoETransformer(model_cfg, make_moe)
    moe_prefixes = {name for name, _ in moe_layers(model)}
    plain = {k: v for k, v in full.items() if not any(k.startswith(p + ".") for p in moe_prefixes)}
    missing = model.load_state_dict(plain, strict=False).missing_keys
    for prefix in moe_prefixes:
        layer = model.get_submodule(prefix)
        layer.load_full_state_dict({k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")})
    assert all(any(k.startswith(p + ".") for p in moe_prefixes) for k in missing), missing
    return model


def check_layers(cfg: RunConfig) -> None:
    """What the ranks' MoE layers would raise when they are built, raised on the launcher as a
    ConfigError: each rank's budget lists and topology for an expert-parallel group of this
    run's size, and for the built-in model the planner of such a group (replica slots against
    the experts a rank owns, a sharded system's hidden size and assembly slots). A memory cap
    the layers cannot live in passes: the ranks record it as the run's out of memory, as
    documented (a comparison goes on with its other systems)."""
    t = cfg.train
    world = t.ep_size or t.nproc
    spec = spec_of(t.system)
    budget = cfg.budget if spec.takes_budget else None
    where = f"an expert-parallel group of {world} ranks"
    try:
        if budget is not None:
            budget.per_rank(world)
            budget.node_of(world)
        if t.hf_model:  # (its MoE blocks are known once the checkpoint is loaded)
            return
        moe = cfg.model.moe
        if spec.placement is PlacementKind.SHARDED:
            sharding.check_shardable(moe.ffn_dim, world)
        layers = cfg.model.n_layers - cfg.model.first_dense_layers
        LayerPlanner(spec, moe, world, 0, budget, cfg.backward.for_layer(0, layers), t.capacity_factor,
                     t.replan_interval)
    except MemoryBudgetExceeded:  # not a config error: the run's out-of-memory record (lrmoe.train.oom)
        return
    except ValueError as e:
        raise ConfigError(f"train.system={t.system!r} on {where}: {e}") from None


def for_training(model: nn.Module) -> nn.Module:
    """``model`` as the training loop uses it: the loop only calls ``.backward()``, so the
    replicas' gradients may finish when the backward pass ends (``MoELayer.overlap_replica_grads``)."""
    for _, layer in moe_layers(model):
        layer.overlap_replica_grads = True
    return model


def wait_for_replicas(model: nn.Module | None) -> None:
    """No replica refresh left under way (``MoELayer.step_end`` issues them): before a checkpoint,
    and before the process group ends (None: no model was built)."""
    for _, layer in moe_layers(model) if model is not None else ():
        layer.wait_for_replicas()


def read_routing_trace(path: str, model_cfg: ModelConfig) -> torch.Tensor:
    """(steps, MoE layers, experts) counts of an earlier run's routing.npz, checked against the
    model here so a bad trace is a ConfigError before any rank starts."""
    try:
        counts = np.load(path)["counts"]
    except (OSError, KeyError, ValueError) as e:
        raise ConfigError(f"train.routing_trace={path!r} cannot be read as a routing.npz with 'counts': {e}") from None
    want = (model_cfg.n_layers - model_cfg.first_dense_layers, model_cfg.moe.num_experts)
    if counts.ndim != 3 or counts.shape[1:] != want or not len(counts):
        raise ConfigError(f"train.routing_trace={path!r} holds counts of shape {counts.shape}, expected "
                         f"(steps, {want[0]}, {want[1]}) for this model")
    return torch.from_numpy(counts.astype(np.float64))
