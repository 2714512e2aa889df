"""HF transformers MoE blocks ⇄ MoELayer.

Conversion is a pure re-layout: lrmoe keeps transformers' 3-D expert layout
(``gate_up_proj`` (E, 2F, D) gate rows first, ``down_proj`` (E, D, F)), so weights are copied
as they are and only the config is translated.

Router logits: transformers (>= 5) collects them with forward hooks on its own router class
when a model is called with ``output_router_logits=True`` and computes its load-balancing loss
(``aux_loss``, added to ``loss`` times ``router_aux_loss_coef``) from them. A patched layer's
router feeds the same collector with its (T, E) fp32 logits, so ``loss``, ``aux_loss`` and
``router_logits`` are those of the unpatched model.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.layer import MoELayer, moe_layers
from lrmoe.router import Routing
from lrmoe.systems import DEFAULT_SYSTEM


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
# MoEConfig fields read from the block's weights: an override would not fit them
_FROM_WEIGHTS = ("dim", "ffn_dim", "num_experts", "num_shared_experts", "shared_ffn_dim", "dtype")


def _active_collector():
    """transformers' collector of the current forward (a dict of lists, ``"router_logits"`` among
    them when the model was called with ``output_router_logits=True``), or None."""
    try:
        from transformers.utils.output_capturing import _active_collector as collector
    except ImportError:  # pragma: no cover - transformers < 5 or absent
        return None
    return collector.get()


def _record(logits_TE: torch.Tensor) -> None:
    collected = _active_collector()
    if collected is not None and "router_logits" in collected:
        collected["router_logits"].append(logits_TE)


def _record_patched_router(router: nn.Module, args, routing: Routing) -> None:
    """Forward hook of a patched layer's router: its logits go where transformers' own router's would."""
    _record(routing.logits_TE)


def _record_hf_gate(gate: nn.Module, args, output) -> None:
    """Forward hook of a restored transformers router, for models whose hooks transformers
    installed before the patch (it installs them once per model)."""
    _record(output[0])


def _split_overrides(kwargs: dict) -> tuple[dict, dict]:
    """``patch_model``'s keyword arguments: (MoEConfig overrides, MoELayer arguments)."""
    moe_fields = {f.name for f in fields(MoEConfig)}
    moe = {k: v for k, v in kwargs.items() if k in moe_fields}
    fixed = sorted(set(moe) & set(_FROM_WEIGHTS))
    if fixed:
        raise ValueError(f"patch_model: {fixed} come from the block's weights and cannot be overridden")
    return moe, {k: v for k, v in kwargs.items() if k not in moe_fields}


def patch_model(
    model: nn.Module,
    system: str = DEFAULT_SYSTEM,
    backward=None,
    budget=None,
    group=None,
    **overrides,
) -> nn.Module:
    """Replace every Qwen3-MoE / GLM-4.5 MoE block of a transformers model, in place, by an
    equivalent :class:`MoELayer` carrying the block's weights (each rank keeps its experts).
    Returns the model. ``unpatch_model`` gives the plain transformers model back.

    ``overrides``: :class:`MoEConfig` fields (``aux_loss_coef``, ``z_loss_coef``, routing
    semantics; not the shape fields the weights fix) and :class:`MoELayer` arguments
    (``capacity_factor``, ``replan_interval``, ``load_ema``, ``routing_trace``). ``aux_loss_coef``
    defaults to the model config's ``router_aux_loss_coef`` (0 without one), so each layer's
    ``aux_loss`` holds the per-layer Switch loss with the model's coefficient. With
    ``output_router_logits=True`` transformers itself adds its balancing loss over all layers to
    ``loss`` from the router logits the patched layers report: add ``layer.aux_loss`` only in a
    loop that does not use ``output_router_logits``, never both."""
    moe_overrides, layer_kwargs = _split_overrides(overrides)
    model_config = getattr(model, "config", None)
    moe_overrides.setdefault("aux_loss_coef", float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0))
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in _SUPPORTED]
    if not targets:
        raise ValueError("patch_model found no Qwen3MoeSparseMoeBlock or Glm4MoeMoE in the model")
    for name, block in targets:
        layer = MoELayer(replace(config_from_hf_block(block), **moe_overrides), system=system, group=group,
                         backward=backward, budget=budget, **layer_kwargs)
        layer.load_full_state_dict(hf_block_state_dict(block))
        layer.router.register_forward_hook(_record_patched_router)
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
    hooked = any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules())
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
        if hooked:  # transformers will not hook the new router itself
            block.gate.register_forward_hook(_record_hf_gate)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, block)
    return model
