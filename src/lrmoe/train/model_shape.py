"""A run's model as the byte model reads it (:mod:`lrmoe.train.memory_split`): its MoE layers
as the simulator's :class:`~lrmoe.sim.models.ModelSpec`, and what lies outside them.

Parameters outside the MoE layers are counted on a model built on the meta device (no
storage): the built-in transformer with its MoE layers left out, or the transformers
checkpoint's model less its MoE blocks, so the count is the model's own, embeddings tied or not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.sim.models import ModelSpec
from lrmoe.train.config import ConfigError, RunConfig

DENSE_DTYPE_BYTES = 4  # everything outside the experts trains in fp32 (a checkpoint is loaded in fp32 too)


@dataclass(frozen=True)
class RankShape:
    """What the byte model needs of a run's model."""

    spec: ModelSpec  # the MoE layers (their shape and count)
    expert_bytes: int  # bytes an element of the experts
    outside_params: int  # parameters outside the MoE layers (attention, embeddings, norms, dense FFNs, head)
    layers: int  # transformer layers, each with its attention
    dense_layers: int  # layers whose MLP is a dense FFN rather than an MoE layer
    dense_ffn_dim: int
    vocab: int


def _spec(moe: MoEConfig, moe_layers: int, where: str) -> ModelSpec:
    if moe_layers < 1:
        raise ConfigError(f"{where}: the model has no MoE layer whose expert side a budget could cap")
    return ModelSpec("run", dim=moe.dim, ffn_dim=moe.ffn_dim, num_experts=moe.num_experts, top_k=moe.top_k,
                     shared_ffn_dim=moe.shared_hidden, moe_layers=moe_layers, router=moe.router)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _builtin_shape(cfg: RunConfig, where: str) -> RankShape:
    from lrmoe.models import MoETransformer

    model = replace(cfg.model, vocab_size=cfg.train.vocab_size)  # the tokenizer's size, as build_model does
    with torch.device("meta"):
        rest = MoETransformer(model, make_moe=lambda i: nn.Identity())  # every MoE layer left out
    return RankShape(spec=_spec(model.moe, model.n_layers - model.first_dense_layers, where),
                     expert_bytes=model.moe.torch_dtype.itemsize, outside_params=_count(rest),
                     layers=model.n_layers, dense_layers=model.first_dense_layers,
                     dense_ffn_dim=model.dense_ffn_dim, vocab=model.vocab_size)


def _hf_shape(cfg: RunConfig, where: str) -> RankShape:
    from transformers import AutoConfig, AutoModelForCausalLM

    from lrmoe.integrations.hf import FAMILIES, config_from_hf_block

    config = AutoConfig.from_pretrained(cfg.train.hf_model)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = [m for m in model.modules() if type(m).__name__ in FAMILIES]
    if not blocks:
        raise ConfigError(f"{where}: the model has no MoE layer whose expert side a budget could cap")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dim, layers = text.hidden_size, text.num_hidden_layers
    return RankShape(spec=_spec(config_from_hf_block(blocks[0]), len(blocks), where),
                     expert_bytes=DENSE_DTYPE_BYTES,  # every rank loads the checkpoint in fp32
                     outside_params=_count(model) - sum(_count(b) for b in blocks), layers=layers,
                     dense_layers=layers - len(blocks),
                     dense_ffn_dim=getattr(text, "intermediate_size", None) or 4 * dim, vocab=text.vocab_size)


def shape_of(cfg: RunConfig, where: str = "memory_per_rank") -> RankShape:
    """The byte model's view of ``cfg``'s model: ``[model]`` or ``train.hf_model``'s checkpoint."""
    return _hf_shape(cfg, where) if cfg.train.hf_model else _builtin_shape(cfg, where)
