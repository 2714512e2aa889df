"""Training a local transformers checkpoint (``lrmoe train --hf-model DIR``): what the launcher
checks before any rank starts, the patched model every rank builds, and its ``save_pretrained``
export.

A checkpoint folder is what ``save_pretrained`` writes (``config.json`` and the weights) plus
the tokenizer's files. Every rank loads the same weights in fp32 (so every system starts from
identical weights, as with the built-in models) and replaces each MoE block by a
:class:`~lrmoe.layer.MoELayer` of the run's system (:func:`lrmoe.integrations.hf.patch_model`);
the rest of the model is transformers' own. The export (:func:`save_pretrained`) gathers every
layer's experts back into transformers blocks (a collective) and rank 0 writes a folder that
plain transformers loads: config, weights and tokenizer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import nn

from lrmoe.integrations.hf import check_model, hf_block_from_layer, patch_model
from lrmoe.layer import MoELayer, moe_layers
from lrmoe.models.transformer import lm_loss
from lrmoe.systems import spec_of
from lrmoe.train.config import ConfigError, RunConfig
from lrmoe.train.data import DataError, hf_tokenizer
from lrmoe.train.groups import Groups

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _quiet() -> None:
    """transformers' progress bars and info messages off: a rank's output is the run's progress."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _one_line(e: BaseException, limit: int = 200) -> str:
    return " ".join(str(e).split())[:limit]


def inspect_checkpoint(folder: str, seq_len: int) -> None:
    """The launcher's checks of ``--hf-model``, each a one-line ConfigError (or DataError for the
    tokenizer): a folder with a ``config.json`` transformers reads, weights, a causal LM whose
    MoE blocks lrmoe converts (:func:`lrmoe.integrations.hf.check_model`, on the meta device: no
    weights are read), a tokenizer whose ids the embedding holds, and windows of ``model.seq_len``
    within the model's context."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _quiet()
    where = f"--hf-model {folder}"
    path = Path(folder)
    if not path.is_dir():
        raise ConfigError(f"{where}: no such folder")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where}: not a transformers checkpoint (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{where}: transformers cannot read its config.json: {_one_line(e)}") from None
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(f"{where}: no weights ({' or '.join(WEIGHT_FILES[::2])})")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ConfigError(f"{where}: model type {config.model_type!r} is not a causal LM of transformers: "
                          f"{_one_line(e)}") from None
    try:
        check_model(model)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {_one_line(e, 300)}") from None
    vocab = len(hf_tokenizer(folder))
    if vocab > config.vocab_size:
        raise DataError(f"{where}: its tokenizer has {vocab} tokens, more than the model's vocab_size "
                        f"{config.vocab_size}")
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and seq_len > context:
        raise ConfigError(f"model.seq_len={seq_len} is invalid: {where} holds {context} positions "
                          f"(max_position_embeddings)")


class HFCausalLM(nn.Module):
    """A patched transformers causal LM under the interface the training loop reads from
    :class:`~lrmoe.models.MoETransformer`: ``forward`` (token ids → logits), ``loss`` and
    ``moe_layers``. The transformers model is ``hf``; its state-dict keys carry the ``hf.``
    prefix in lrmoe's checkpoints."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [m for _, m in moe_layers(self.hf)]

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids_BS, use_cache=False).logits

    def loss(self, ids_BS: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss with the MoE layers' aux losses, language-model cross entropy)."""
        return lm_loss(self(ids_BS), targets_BS, self.moe_layers)


def build_hf_model(cfg: RunConfig, vocab_size: int, groups: Groups) -> HFCausalLM:
    """``train.hf_model``'s weights in fp32, every MoE block an expert-parallel layer of
    ``train.system`` (this rank's experts), with the run's backward, budget, capacity factor and
    re-planning interval."""
    from transformers import AutoModelForCausalLM

    _quiet()
    t = cfg.train
    hf = AutoModelForCausalLM.from_pretrained(t.hf_model, dtype=torch.float32)
    if vocab_size > hf.config.vocab_size:  # the launcher checks it; a folder changed since then
        raise DataError(f"--hf-model {t.hf_model}: {vocab_size} tokens, vocab_size {hf.config.vocab_size}")
    hf.config.use_cache = False
    hf.config.output_router_logits = False  # the layers' own aux losses count (lm_loss), not transformers'
    budget = cfg.budget if spec_of(t.system).takes_budget else None
    patch_model(hf, system=t.system, backward=cfg.backward, budget=budget, group=groups.ep_group,
                capacity_factor=t.capacity_factor, replan_interval=t.replan_interval)
    return HFCausalLM(hf)


@torch.no_grad()
def save_pretrained(model: HFCausalLM, folder: Path, groups: Groups, tokenizer_folder: str) -> None:
    """Collective: ``folder`` as plain transformers' ``save_pretrained`` writes it (config,
    weights) with the tokenizer of ``tokenizer_folder``. Every expert-parallel group gathers each
    layer's experts into a transformers block (:func:`~lrmoe.integrations.hf.hf_block_from_layer`);
    rank 0 keeps them, one layer at a time, and writes ``folder`` through a temporary name, so a
    crash leaves the previous export or none, never a torn one."""
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for prefix, layer in moe_layers(model.hf):
        block = hf_block_from_layer(layer)
        if groups.rank == 0:
            blocks[prefix] = {f"{prefix}.{k}": v.cpu() for k, v in block.state_dict().items()}
    if groups.rank != 0:
        return
    _quiet()
    state = {k: v for k, v in model.hf.state_dict().items() if not any(k.startswith(p + ".") for p in blocks)}
    for tensors in blocks.values():
        state.update(tensors)
    folder = Path(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.hf.save_pretrained(tmp, state_dict=state)
    hf_tokenizer(tokenizer_folder).save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)

