"""Tiny decoder-only language models whose MoE layers are :class:`lrmoe.MoELayer`."""

from lrmoe.models.transformer import PRESETS, ModelConfig, MoETransformer

__all__ = ["PRESETS", "ModelConfig", "MoETransformer"]
