"""HF transformers MoE blocks ⇄ MoELayer.

Conversion is a pure re-layout: lrmoe keeps transformers' 3-D expert layout
(``gate_up_proj`` (E, 2F, D) gate rows first, ``down_proj`` (E, D, F)), so weights are copied
as they are and only the config is translated.
"""

from __future__ import annotations

import torch
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.layer import MoELayer


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
