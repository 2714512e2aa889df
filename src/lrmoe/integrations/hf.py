"""HF transformers MoE blocks ⇄ MoELayer.

Conversion is a pure re-layout: lrmoe keeps transformers' 3-D expert layout
(``gate_up_proj`` (E, 2F, D) gate rows first, ``down_proj`` (E, D, F)), so weights are copied
as they are and only the config is translated.
"""

from __future__ import annotations

import torch
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.layer import MoELayer, moe_layers


def config_from_hf_block(block: nn.Module) -> MoEConfig:
    """The :class:`MoEConfig` equivalent to a ``Qwen3MoeSparseMoeBlock`` or ``Glm4MoeMoE``."""
    kind = type(block).__name__
    gate, experts = block.gate, block.experts
    E, two_F, D = experts.gate_up_proj.shape
    dtype = experts.gate_up_proj.dtype
    if kind == "Qwen3MoeSparseMoeBlock":
        return MoEConfig(
            dim=D, ffn_dim=two_F // 2, num_experts=E, top_k=gate.top_k, router="softmax",
            norm_topk_prob=bool(gate.norm_topk_prob), dtype=dtype,
        )
    if kind == "Glm4MoeMoE":
        shared = block.shared_experts.gate_proj.out_features
        n_shared = int(block.config.n_shared_experts)
        return MoEConfig(
            dim=D, ffn_dim=two_F // 2, num_experts=E, top_k=gate.top_k, router="sigmoid",
            norm_topk_prob=bool(gate.norm_topk_prob),
            routed_scaling_factor=float(gate.routed_scaling_factor),
            n_group=int(gate.num_group), topk_group=int(gate.topk_group),
            num_shared_experts=n_shared, shared_ffn_dim=shared // n_shared if n_shared else None,
            dtype=dtype,
        )
    raise TypeError(f"from_hf_block supports Qwen3MoeSparseMoeBlock and Glm4MoeMoE, got {kind}")


def hf_block_state_dict(block: nn.Module) -> dict[str, torch.Tensor]:
    """The block's weights under MoELayer's (world-size-1) state-dict names."""
    sd = {
        "router.weight": block.gate.weight.detach(),
        "experts.gate_up_proj": block.experts.gate_up_proj.detach(),
        "experts.down_proj": block.experts.down_proj.detach(),
    }
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        sd["router.e_score_correction_bias"] = bias.detach()
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sd[f"shared_experts.{proj}.weight"] = getattr(shared, proj).weight.detach()
    return {k: v.clone() for k, v in sd.items()}


def from_hf_block(block: nn.Module) -> MoELayer:
    """A world-size-1 :class:`MoELayer` with the block's weights and routing semantics."""
    layer = MoELayer(config_from_hf_block(block))
    layer.load_full_state_dict(hf_block_state_dict(block))
    return layer


_SUPPORTED = ("Qwen3MoeSparseMoeBlock", "Glm4MoeMoE")


def patch_model(
    model: nn.Module,
    system: str = "static",
    backward=None,
    budget=None,
    group=None,
    **layer_kwargs,
) -> nn.Module:
    """Replace every Qwen3-MoE / GLM-4.5 MoE block of a transformers model, in place, by an
    equivalent :class:`MoELayer` carrying the block's weights (each rank keeps its experts).
    Returns the model. ``unpatch_model`` gives the plain transformers model back."""
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in _SUPPORTED]
    if not targets:
        raise ValueError("patch_model found no Qwen3MoeSparseMoeBlock or Glm4MoeMoE in the model")
    for name, block in targets:
        layer = MoELayer(config_from_hf_block(block), system=system, group=group, backward=backward, budget=budget,
                         **layer_kwargs)
        layer.load_full_state_dict(hf_block_state_dict(block))
        layer.to(next(block.parameters()).device)
        layer._hf_block_class = type(block)
        layer._hf_config = block.config if hasattr(block, "config") else model.config
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Inverse of :func:`patch_model` (collective when the layers are expert parallel): every
    patched layer becomes a transformers block again, with the layer's current (trained)
    weights, so the model saves with ``save_pretrained`` and reloads as usual."""
    patched = [(name, m) for name, m in moe_layers(model) if hasattr(m, "_hf_block_class")]
    for name, layer in patched:
        sd = layer.full_state_dict()
        block = layer._hf_block_class(layer._hf_config)
        with torch.no_grad():
            block.gate.weight.copy_(sd["router.weight"])
            block.experts.gate_up_proj.copy_(sd["experts.gate_up_proj"])
            block.experts.down_proj.copy_(sd["experts.down_proj"])
            if "router.e_score_correction_bias" in sd:
                block.gate.e_score_correction_bias.copy_(sd["router.e_score_correction_bias"])
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"shared_experts.{proj}.weight"
                if key in sd:
                    getattr(block.shared_experts, proj).weight.copy_(sd[key])
        block.to(layer.router.weight.device)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, block)
    return model
