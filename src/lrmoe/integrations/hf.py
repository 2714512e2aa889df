"""HF transformers MoE blocks ⇄ MoELayer.

Conversion is a pure re-layout: lrmoe keeps transformers' 3-D expert layout
(``gate_up_proj`` (E, 2F, D) gate rows first, ``down_proj`` (E, D, F)), so weights are copied
as they are and only the config is translated (:mod:`lrmoe.integrations.hf_blocks`: the table of
families, the checks, the state-dict names).

Router logits: transformers (>= 5) collects them with forward hooks on its own router class
when a model is called with ``output_router_logits=True`` and computes its load-balancing loss
(``aux_loss``, added to ``loss`` times ``router_aux_loss_coef``) from them. A patched layer's
router feeds the same collector with its (T, E) fp32 logits, so ``loss``, ``aux_loss`` and
``router_logits`` are those of the unpatched model.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.integrations.hf_blocks import (
    FAMILIES,
    REFUSED_BLOCKS,
    SUPPORTED_BLOCKS,
    Family,
    check_model,
    config_from_hf_block,
    family_of,
    hf_block_state_dict,
)
from lrmoe.layer import MoELayer, moe_layers
from lrmoe.router import Routing
from lrmoe.systems import DEFAULT_SYSTEM

__all__ = [
    "FAMILIES", "REFUSED_BLOCKS", "SUPPORTED_BLOCKS", "Family", "HFOrigin", "check_model", "config_from_hf_block",
    "from_hf_block", "hf_block_from_layer", "hf_block_state_dict", "patch_model", "unpatch_model",
]


@dataclass(frozen=True)
class HFOrigin:
    """The transformers block a layer was made from, as a template on the meta device (no
    storage, no hooks): its class, config and each tensor's dtype, to rebuild it."""

    block: nn.Module


def _meta_template(block: nn.Module) -> HFOrigin:
    memo = {}
    for t in itertools.chain(block.parameters(), block.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    template = copy.deepcopy(block, memo)
    for m in template.modules():  # a plain block: transformers' (and anyone's) hooks stay on the original
        for key, value in vars(m).items():
            if key.startswith(("_forward_", "_backward_")) and isinstance(value, dict):
                value.clear()
    return HFOrigin(template)


def _convert(block: nn.Module, config: MoEConfig, **layer_kwargs) -> MoELayer:
    layer = MoELayer(config, **layer_kwargs)
    layer.load_full_state_dict(hf_block_state_dict(block))
    layer._hf_origin = _meta_template(block)
    return layer


def from_hf_block(block: nn.Module) -> MoELayer:
    """A world-size-1 :class:`MoELayer` with the block's weights and routing semantics
    (:data:`SUPPORTED_BLOCKS`; a one-line error otherwise, see :func:`config_from_hf_block`)."""
    return _convert(block, config_from_hf_block(block))


def hf_block_from_layer(layer: MoELayer) -> nn.Module:
    """Collective when the layer is expert parallel: a plain transformers block (the class the
    layer was made from by :func:`patch_model` or :func:`from_hf_block`, its tensors' dtypes,
    no hooks) holding the layer's current weights, on the layer's device."""
    origin = getattr(layer, "_hf_origin", None)
    if origin is None:
        raise ValueError("hf_block_from_layer: the layer was not made from a transformers block "
                         "(patch_model or from_hf_block)")
    full = layer.full_state_dict()
    block = copy.deepcopy(origin.block)
    dtypes = {name: t.dtype for name, t in origin.block.state_dict().items()}
    names = family_of(block).names()
    block.load_state_dict({theirs: full[ours].to(dtypes[theirs]) for ours, theirs in names.items()}, assign=True)
    left = [n for n, t in itertools.chain(block.named_parameters(), block.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"hf_block_from_layer: {type(block).__name__} tensors {left} are not in the state dict")
    return block.train(layer.training)


# MoEConfig fields read from the block's weights: an override would not fit them
_FROM_WEIGHTS = ("dim", "ffn_dim", "num_experts", "num_shared_experts", "shared_ffn_dim", "shared_expert_gate",
                 "dtype")


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
    """Replace every MoE block of a transformers model (:data:`SUPPORTED_BLOCKS`), in place, by an
    equivalent :class:`MoELayer` carrying the block's weights (each rank keeps its experts).
    Returns the model; :func:`check_model` runs first (a one-line ValueError for a model with
    none, a refused block or an unsupported setting, before anything changes).
    :func:`unpatch_model` gives the plain transformers model back.

    ``overrides``: :class:`MoEConfig` fields (``aux_loss_coef``, ``z_loss_coef``, routing
    semantics; not the shape fields the weights fix) and :class:`MoELayer` arguments
    (``capacity_factor``, ``replan_interval``, ``load_ema``, ``routing_trace``). ``aux_loss_coef``
    defaults to the model config's ``router_aux_loss_coef`` (0 without one), so each layer's
    ``aux_loss`` holds the per-layer Switch loss with the model's coefficient. With
    ``output_router_logits=True`` transformers itself adds its balancing loss over all layers to
    ``loss`` from the router logits the patched layers report: add ``layer.aux_loss`` only in a
    loop that does not use ``output_router_logits``, never both."""
    check_model(model)
    moe_overrides, layer_kwargs = _split_overrides(overrides)
    model_config = getattr(model, "config", None)
    moe_overrides.setdefault("aux_loss_coef", float(getattr(model_config, "router_aux_loss_coef", 0.0) or 0.0))
    targets = [(name, m) for name, m in model.named_modules() if type(m).__name__ in FAMILIES]
    for index, (name, block) in enumerate(targets):
        own = backward if backward is None else backward.for_layer(index, len(targets))
        layer = _convert(block, replace(config_from_hf_block(block), **moe_overrides), system=system, group=group,
                         backward=own, budget=budget, **layer_kwargs)
        layer.router.register_forward_hook(_record_patched_router)
        layer.to(next(block.parameters()).device)
        _set_submodule(model, name, layer)
    return model


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Inverse of :func:`patch_model` (collective when the layers are expert parallel): every
    patched layer becomes a transformers block again, with the layer's current (trained)
    weights, so the model saves with ``save_pretrained`` and reloads as usual."""
    patched = [(name, m) for name, m in moe_layers(model) if hasattr(m, "_hf_origin")]
    hooked = any(getattr(m, "_output_capturing_hooks_installed", False) for m in model.modules())
    for name, layer in patched:
        block = hf_block_from_layer(layer)
        if hooked:  # transformers will not hook the new router itself
            block.gate.register_forward_hook(_record_hf_gate)
        _set_submodule(model, name, block)
    return model
