"""lrmoe inside transformers' own expert parallelism: ``DistributedConfig(ep_implementation="lrmoe")``.

transformers (>= 5.25) shards each MoE block's experts over the expert-parallel ranks (``Shard(0)``
of ``gate_up_proj`` (E, 2F, D) and ``down_proj`` (E, D, F) on its EP mesh) and hands the routed
pairs of every call to the ``EPImplementation`` that ``DistributedConfig.ep_implementation``
names in ``EPImplementationInterface``. Importing this module registers ``"lrmoe"`` there (and
changes nothing else in transformers): :class:`LRMoEImplementation` runs the call through lrmoe's
routed path (:class:`~lrmoe.integrations.routed_path.RoutedPath`: lrmoe's dispatch, complete
forward, compacted trimmed backward and quotas) on transformers' own local expert shards, inside
one ``torch.autograd.Function`` whose backward returns the gradients of the tokens, the routing
weights and both expert tensors to the ranks that hold them. The router and any shared expert
stay transformers'. :func:`register` registers it again with other settings.

lrmoe counts optimizer steps (``BackwardConfig.trim_after``, floors, replica refreshes) with a
global ``torch.optim`` post-step hook, installed when the first model is loaded with it.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.integrations.hf_blocks import _activation
from lrmoe.integrations.routed_path import RoutedPath, check_settings

__all__ = ["NAME", "LRMoEImplementation", "check_experts", "layer_stats", "lrmoe_experts", "register"]

NAME = "lrmoe"
_EXPERT_TENSORS = ("down_proj", "gate_up_proj")


def check_experts(experts: nn.Module) -> None:
    """A one-line ValueError unless lrmoe computes what ``experts`` (a transformers experts module)
    computes: SwiGLU experts y = down · (silu(gate) ⊙ up), gate rows before up rows in
    ``gate_up_proj`` (E, 2F, D), ``down_proj`` (E, D, F), no bias, nothing after the expert."""
    kind = type(experts).__name__
    if not hasattr(experts, "has_gate"):  # transformers' decorator states every layout flag
        raise ValueError(f"ep_implementation={NAME!r} cannot run {kind}: not a transformers experts module "
                         "with a declared layout (use_experts_implementation)")
    flags = {"has_bias": (True, "expert biases"), "has_gate": (False, "no gate projection"),
             "is_transposed": (True, "transposed expert weights"),
             "is_concatenated": (False, "interleaved gate/up rows"),
             "has_post_expert_norm": (True, "a norm after each expert")}
    problems = [why for flag, (bad, why) in flags.items() if bool(getattr(experts, flag)) == bad]
    if getattr(type(experts)._apply_gate, "__name__", "") != "_default_apply_gate":
        problems.append("its own gated activation (_apply_gate)")
    act = _activation(experts.act_fn) if hasattr(experts, "act_fn") else "none"
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act={act!r}")
    names = sorted(name for name, _ in experts.named_parameters())
    if names != list(_EXPERT_TENSORS):
        problems.append(f"tensors {names}")
    if problems:
        raise ValueError(f"ep_implementation={NAME!r} cannot run {kind}: {', '.join(problems)} (lrmoe's experts are "
                         "SwiGLU, silu(gate) * up, without biases)")


class LRMoEImplementation(EPImplementation):
    """One MoE block's routed experts through lrmoe (built by transformers when a model loads).

    Its :class:`RoutedPath` is reachable as ``experts.lrmoe.path``; ``experts.lrmoe.last_stats``
    is the latest call's figures, as :attr:`MoELayer.last_stats <lrmoe.layer.MoELayer.last_stats>`
    (``kept_E``, ``counts_E``, ``bwd_a2a_bytes``, ``peak_expert_side_bytes``, ...). Settings: the
    class attributes :func:`register` sets."""

    backward: BackwardConfig | None = None
    budget: ClusterBudget | None = None

    def __init__(self, experts: nn.Module, ep_mesh, tp_mesh) -> None:
        check_experts(experts)
        if tp_mesh.size() > 1:  # rows would have to be split over the TP ranks first
            raise ValueError(f"ep_implementation={NAME!r} runs without tensor parallelism: "
                             f"got tp_size={tp_mesh.size()}")
        super().__init__(experts, ep_mesh, tp_mesh)
        self.experts = experts
        self.group = ep_mesh.get_group()
        # the parameters' shapes are global here (DTensors, or not yet sharded)
        self.path = self._build(int(experts.config.num_experts_per_tok), experts.gate_up_proj.dtype)
        experts.lrmoe = self  # where a user reads the layer's figures (lrmoe_experts, layer_stats)
        _follow_optimizer_steps(self)

    def _build(self, top_k: int, dtype: torch.dtype) -> RoutedPath:
        E, two_F, D = self.experts.gate_up_proj.shape
        config = MoEConfig(dim=D, ffn_dim=two_F // 2, num_experts=E, top_k=top_k, dtype=dtype)
        return RoutedPath(config, self.group, self.backward, self.budget)

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        # transformers swaps its DTensor parameters for their local shards around this call
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        config = self.path.config
        if top_k_index.shape[1] != config.top_k or gate_up.dtype != config.torch_dtype:
            self.path = self._build(top_k_index.shape[1], gate_up.dtype)  # a model cast after loading
        x_TD = hidden_states.reshape(-1, config.dim)
        weights_TK = top_k_weights.to(x_TD.dtype)  # lrmoe combines in the experts' dtype
        out_TD = self.path(x_TD, top_k_index, weights_TK, gate_up, down)
        # the combine's output is a view, which FSDP2 (wrapping the experts) warns of: an in-place
        # op on it downstream would skip FSDP's pre-backward hook
        return out_TD.clone() if out_TD._base is not None else out_TD

    @property
    def last_stats(self) -> dict:
        return self.path.last_stats


_LIVE: weakref.WeakSet[LRMoEImplementation] = weakref.WeakSet()
_step_hook = None


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for implementation in list(_LIVE):
        implementation.path.step_end()


def _follow_optimizer_steps(implementation: LRMoEImplementation) -> None:
    global _step_hook
    _LIVE.add(implementation)
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_after_optimizer_step)


def register(backward: BackwardConfig | None = None, budget: ClusterBudget | None = None
             ) -> type[LRMoEImplementation]:
    """Register ``"lrmoe"`` in transformers' ``EPImplementationInterface`` with these settings, for
    the models loaded after the call (None: lrmoe's defaults, ``BackwardConfig()`` and no budget).
    Returns the registered class."""
    check_settings(backward, budget)
    settings = {"backward": backward, "budget": budget, "__module__": __name__}
    implementation = type("LRMoEImplementation", (LRMoEImplementation,), settings)
    EPImplementationInterface.register(NAME, implementation)
    return implementation


def lrmoe_experts(model: nn.Module) -> list[tuple[str, LRMoEImplementation]]:
    """Every experts module of ``model`` that lrmoe runs, by qualified name, with its implementation."""
    return [(name, m.lrmoe) for name, m in model.named_modules()
            if isinstance(getattr(m, "lrmoe", None), LRMoEImplementation)]


def layer_stats(model: nn.Module) -> dict[str, dict]:
    """Each lrmoe layer's ``last_stats``, with ``kept_ratio`` (pairs kept / pairs routed, over
    every expert) once a backward has run."""
    out = {}
    for name, implementation in lrmoe_experts(model):
        stats = implementation.last_stats
        if "kept_E" in stats:
            stats["kept_ratio"] = float(stats["kept_E"].sum()) / max(1, int(stats["counts_E"].sum()))
        out[name] = stats
    return out


register()
