"""What a transformers checkpoint trains with where the config says nothing (``lrmoe train
--hf-model DIR``, with or without ``--config``): lrmoe's own defaults (:class:`TrainConfig`,
:class:`~lrmoe.config.BackwardConfig`), except the few that fine-tuning a pretrained model asks
for, listed here and nowhere else (configs/hf.toml repeats none of them), and a window that
fits the checkpoint: ``min(256, max_position_embeddings)``.

They are filled into the parsed TOML tables before validation (:func:`fill_hf_defaults`), so
the resolved config (``config.toml``, what the ranks load) states every value explicitly.
"""

from __future__ import annotations

import json
from pathlib import Path

# a pretrained model fine-tunes at a tenth of the from-scratch rate, and a long run keeps checkpoints
HF_TRAIN_DEFAULTS: dict[str, object] = {"lr": 3e-4, "checkpoint_every": 50}
HF_WINDOW = 256  # model.seq_len's default: at most this many positions, within the checkpoint's context


def checkpoint_positions(folder: str | Path) -> int | None:
    """The checkpoint's ``max_position_embeddings`` (its text model's, for a composite config), read
    from ``config.json`` as JSON; None where the folder or the field is missing (the launcher's
    checks of the folder then say what is wrong)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    for table in (config, config.get("text_config") or {}):
        value = table.get("max_position_embeddings") if isinstance(table, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def fill_hf_defaults(raw: dict) -> dict[str, object]:
    """Where ``raw`` (parsed TOML tables, ``--set`` applied) trains ``train.hf_model`` and leaves a
    key out, fill in the checkpoint default, in place; returns what was filled, by
    ``section.key`` (empty without a checkpoint, or when everything was given)."""
    train = raw.get("train")
    folder = train.get("hf_model") if isinstance(train, dict) else None
    if not folder or not isinstance(folder, str):
        return {}
    filled: dict[str, object] = {}
    for key, value in HF_TRAIN_DEFAULTS.items():
        if key not in train:
            train[key] = filled[f"train.{key}"] = value
    model = raw.setdefault("model", {})
    if isinstance(model, dict) and "seq_len" not in model:
        positions = checkpoint_positions(folder)
        model["seq_len"] = filled["model.seq_len"] = min(HF_WINDOW, positions or HF_WINDOW)
    return filled


def describe_choices(folder: str, filled: dict[str, object], train: dict[str, object], seq_len: int,
                     had_config: bool) -> str:
    """The one line printed before launch: the window and the defaults filled in (and, without
    ``--config``, the run's main values, since nothing else shows them)."""
    parts = []
    if "model.seq_len" in filled:
        positions = checkpoint_positions(folder)
        parts.append(f"model.seq_len={seq_len} (the checkpoint's {positions} positions, at most {HF_WINDOW})"
                     if positions else f"model.seq_len={seq_len}")
    parts += [f"{k}={v}" for k, v in filled.items() if k != "model.seq_len"]
    if not had_config:
        main = ("system", "steps", "batch", "warmup", "eval_every", "nproc", "data")
        parts += [f"train.{k}={train[k]}" for k in main]
        return f"--hf-model without --config: lrmoe's defaults for a checkpoint: {', '.join(parts)}"
    return f"--hf-model: lrmoe's defaults for a checkpoint: {', '.join(parts)}"
