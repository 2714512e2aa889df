"""The config's error and its checks (a leaf module: :mod:`lrmoe.train.config` and the modules it
builds on share them; ``lrmoe.train.config`` re-exports the error): single values, and the rules
across a run config's tables that no one table can check alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lrmoe.systems import spec_of
from lrmoe.validation import is_int_at_least

if TYPE_CHECKING:  # (types only: the tables' modules do not import this one)
    from lrmoe.cluster_budget import ClusterBudget
    from lrmoe.config import BackwardConfig
    from lrmoe.models import ModelConfig


class ConfigError(ValueError):
    """A user-facing configuration problem: field, value, what is allowed."""


def require_int(where: str, v: object, least: int) -> int:
    """``v`` itself when it is an integer >= ``least`` (a bool is not); else a ConfigError that
    names ``where`` (a field or a flag), the value and the bound."""
    if not is_int_at_least(v, least):
        raise ConfigError(f"{where}={v!r} is invalid: expected an integer >= {least}")
    return v


def require_number(where: str, v: object, least: float, strict: bool) -> None:
    """A ConfigError unless ``v`` is a number (not a bool) > ``least`` (``strict``) or >= it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > least if strict else v >= least):
        raise ConfigError(f"{where}={v!r} is invalid: expected a number {'>' if strict else '>='} {least}")


def check_tables(model: ModelConfig, system: str, hf_model: str, backward: BackwardConfig,
                 budget: ClusterBudget | None, memory_per_rank: int | None, emulated: bool = False) -> None:
    """A ConfigError for what the run's tables allow one by one but not together (``system`` and
    ``hf_model``: ``[train]``'s): the memory given twice, a forced keep mode under a cap, a
    built-in model training cannot take (no MoE layer, or an expert dtype other than float32), a
    system without its topology (which emulated nodes give, ``emulated``), per-layer floors that do
    not match the MoE layers."""
    if memory_per_rank is not None:
        require_int("budget.memory_per_rank", memory_per_rank, 1)
        if budget is not None and budget.memory_bytes is not None:
            raise ConfigError("[budget] memory_per_rank and memory_bytes exclude each other: memory_per_rank "
                              "is the whole rank's memory, from which lrmoe derives memory_bytes (each MoE "
                              "layer's expert side)")
    if backward.keep is not None and (memory_per_rank is not None or (budget is not None and budget.memory_bytes)):
        raise ConfigError(f"backward.keep={backward.keep!r} with a memory cap is invalid: the cap chooses "
                          "what is kept (backward.keep forces a keep mode in runs without one)")
    if not hf_model and model.first_dense_layers >= model.n_layers:
        raise ConfigError(f"model.first_dense_layers={model.first_dense_layers} is invalid for training: it "
                          f"leaves no MoE layer of model.n_layers={model.n_layers}")
    if not hf_model and model.moe.torch_dtype != torch.float32:
        raise ConfigError(f"model.moe.dtype={model.moe.dtype!r} is invalid for training: lrmoe trains in "
                          "float32 (a transformers checkpoint is loaded in float32 too) and has no mixed "
                          "precision yet; MoELayer and lrmoe simulate take bfloat16")
    if spec_of(system).needs_topology and (budget is None or budget.ranks_per_node is None) and not emulated:
        raise ConfigError(f"train.system={system!r} needs the topology: [budget] ranks_per_node = ... (or "
                          "--emulate-nodes N)")
    if backward.layer_floors and not hf_model:  # a checkpoint's count is known once loaded
        try:
            backward.for_layer(0, model.n_layers - model.first_dense_layers)
        except ValueError as e:
            raise ConfigError(f"[backward] {e}") from None
