"""Which transformers MoE blocks convert to :class:`~lrmoe.layer.MoELayer`, and how.

One table, :data:`FAMILIES`: block class name → :class:`Family`, what differs between the
families that convert (router kind, whether the top-k weights are always renormalised, the
shared expert's attribute and gate). Everything else is read from the block itself: shapes from
its tensors, ``top_k`` / ``norm_topk_prob`` / routed scaling / groups from its router's
attributes, so the reading works on a model built on the meta device (shapes, no values).
:data:`REFUSED_BLOCKS` are blocks of a form MoELayer does not compute, refused with the reason.
docs/training.md "Supported transformers blocks" is the table for users.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.layer import EXPERT_TENSORS

_PROJ = ("gate_proj", "up_proj", "down_proj")
_SILU = ("silu", "swish")


@dataclass(frozen=True)
class Family:
    """What one transformers MoE block class computes, in MoEConfig's terms.

    ``router``: ``"softmax"`` (softmax over all experts, top-k, renormalised when the router's
    ``norm_topk_prob``, or always with ``always_renormalised``) or ``"sigmoid"`` (correction
    bias for the choice, ``routed_scaling_factor``, ``n_group`` / ``topk_group`` read from the
    router). ``shared``: the block's attribute holding its shared-expert MLP (None: none);
    ``shared_gate``: that MLP's output is scaled by ``sigmoid(shared_expert_gate(x))``.
    """

    name: str
    router: str = "softmax"
    always_renormalised: bool = False
    shared: str | None = None
    shared_gate: bool = False

    def names(self) -> dict[str, str]:
        """MoELayer's (world-size-1) state-dict names → the block's."""
        names = {"router.weight": "gate.weight", **{t: t for t in EXPERT_TENSORS}}
        if self.router == "sigmoid":
            names["router.e_score_correction_bias"] = "gate.e_score_correction_bias"
        if self.shared is not None:
            names.update({f"shared_experts.{p}.weight": f"{self.shared}.{p}.weight" for p in _PROJ})
        if self.shared_gate:
            names["shared_expert_gate.weight"] = "shared_expert_gate.weight"
        return names


_GATED_SHARED = dict(shared="shared_expert", shared_gate=True)
_DEEPSEEK = dict(router="sigmoid", shared="shared_experts")

FAMILIES: dict[str, Family] = {
    "Qwen3MoeSparseMoeBlock": Family("Qwen3-MoE"),
    "Qwen2MoeSparseMoeBlock": Family("Qwen2-MoE", **_GATED_SHARED),
    "Qwen3NextSparseMoeBlock": Family("Qwen3-Next", **_GATED_SHARED),
    "Qwen3_5MoeSparseMoeBlock": Family("Qwen3.5-MoE", always_renormalised=True, **_GATED_SHARED),
    "MixtralSparseMoeBlock": Family("Mixtral", always_renormalised=True),
    "OlmoeSparseMoeBlock": Family("OLMoE"),
    "Glm4MoeMoE": Family("GLM-4.5", **_DEEPSEEK),
    "DeepseekV3MoE": Family("DeepSeek-V3", **_DEEPSEEK),
}
SUPPORTED_BLOCKS: tuple[str, ...] = tuple(FAMILIES)
REFUSED_BLOCKS: dict[str, str] = {
    "GptOssMLP": "gpt-oss is not supported: its experts carry biases, interleave gate/up rows and use a "
                 "clamped SwiGLU (alpha, limit, up + 1), and its router has a bias and softmaxes over the "
                 "top-k logits only; MoELayer computes none of these",
}


def family_of(block: nn.Module) -> Family:
    """The block's :class:`Family`; a ValueError for a refused block, a TypeError for any other."""
    kind = type(block).__name__
    if kind in REFUSED_BLOCKS:
        raise ValueError(f"{kind}: {REFUSED_BLOCKS[kind]}")
    if kind not in FAMILIES:
        raise TypeError(f"lrmoe converts the transformers blocks {', '.join(SUPPORTED_BLOCKS)}; got {kind}")
    return FAMILIES[kind]


def _activation(act_fn: nn.Module) -> str:
    """The ``hidden_act`` name of a transformers activation module (its class name if unknown)."""
    if isinstance(act_fn, nn.SiLU):
        return "silu"
    from transformers.activations import ACT2CLS

    for name, cls in ACT2CLS.items():
        if type(act_fn) is (cls[0] if isinstance(cls, tuple) else cls):
            return name
    return type(act_fn).__name__


def _check_settings(block: nn.Module, family: Family) -> None:
    """One-line ValueErrors for what the family allows but MoELayer does not compute."""
    kind = type(block).__name__
    jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise ValueError(f"{kind} ({family.name}): router_jitter_noise={jitter} is not supported "
                         "(training-time noise on the router's input); set it to 0")
    mlps = [block.experts] + ([getattr(block, family.shared)] if family.shared else [])
    for mlp in mlps:
        act = _activation(mlp.act_fn)
        if act not in _SILU:
            raise ValueError(f"{kind} ({family.name}): hidden_act={act!r} is not supported "
                             "(MoELayer's experts are SwiGLU: silu)")
    unmapped = sorted(set(block.state_dict()) - set(family.names().values()))
    if unmapped:
        raise ValueError(f"{kind} ({family.name}): tensors {unmapped} have no MoELayer counterpart")


def _shared_fields(block: nn.Module, family: Family) -> dict:
    if family.shared is None:
        return {}
    hidden = getattr(block, family.shared).gate_proj.out_features
    # GLM-4.5 / DeepSeek-V3 fuse n_shared_experts into one MLP; Qwen2-MoE / Qwen3-Next have one
    n_shared = int(getattr(getattr(block, "config", None), "n_shared_experts", None) or 1)
    return dict(num_shared_experts=n_shared, shared_ffn_dim=hidden // n_shared, shared_expert_gate=family.shared_gate)


def config_from_hf_block(block: nn.Module) -> MoEConfig:
    """The :class:`MoEConfig` equivalent to a transformers MoE block of :data:`SUPPORTED_BLOCKS`
    (read from shapes and attributes only: works on the meta device). A one-line ValueError for
    a refused block or setting, a TypeError for a block of no known family."""
    family = family_of(block)
    _check_settings(block, family)
    gate, experts = block.gate, block.experts
    E, two_F, D = experts.gate_up_proj.shape
    routing = dict(
        router=family.router, top_k=int(gate.top_k),
        norm_topk_prob=True if family.always_renormalised else bool(gate.norm_topk_prob),
    )
    if family.router == "sigmoid":
        routing.update(routed_scaling_factor=float(gate.routed_scaling_factor), n_group=int(gate.num_group),
                       topk_group=int(gate.topk_group))
    return MoEConfig(dim=D, ffn_dim=two_F // 2, num_experts=E, **routing, **_shared_fields(block, family),
                     dtype=experts.gate_up_proj.dtype)


def hf_block_state_dict(block: nn.Module) -> dict[str, torch.Tensor]:
    """The block's weights under MoELayer's (world-size-1) state-dict names."""
    sd = block.state_dict()
    return {ours: sd[theirs].detach().clone() for ours, theirs in family_of(block).names().items()}


def check_model(model: nn.Module) -> None:
    """A one-line ValueError unless every MoE block of ``model`` converts: none of
    :data:`SUPPORTED_BLOCKS` found, a refused block (named, with why), or a supported block with
    a setting MoELayer does not compute (router jitter, an activation other than silu). Reads
    configs and shapes only, so a model built on the meta device can be checked."""
    found = 0
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in REFUSED_BLOCKS or kind in FAMILIES:
            try:
                config_from_hf_block(module)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
            found += 1
    if not found:
        raise ValueError(f"no transformers MoE block lrmoe converts in {type(model).__name__} "
                         f"(supported: {', '.join(SUPPORTED_BLOCKS)})")
