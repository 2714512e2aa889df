"""``lrmoe train --hf-model DIR`` with nothing else: lrmoe's defaults for a checkpoint
(lrmoe.train.hf_defaults), the window fitted to the checkpoint's positions, the choices printed
once; a tiny random Qwen3-MoE checkpoint of 128 positions (built here, offline) trains and its
``out/hf`` loads in plain transformers. Without ``--config`` and ``--hf-model``: one line, exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lrmoe.train.config import TrainConfig, from_dict, load
from lrmoe.train.hf_defaults import HF_TRAIN_DEFAULTS, HF_WINDOW, fill_hf_defaults
from tests.helpers.train import one_line_error, run_main, write_text_folder

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> dict[str, Path]:
    """A corpus and a Qwen3-MoE checkpoint of 128 positions with a 300-token BPE trained on it."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("hf-defaults")
    write_text_folder(root / "corpus")
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(p) for p in sorted((root / "corpus").iterdir())], vocab_size=300, min_frequency=2,
              show_progress=False)
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=128, moe_intermediate_size=16, num_experts=4,
                                         num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "ckpt")
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="</s>").save_pretrained(
        root / "ckpt")
    return {"ckpt": root / "ckpt", "corpus": root / "corpus"}


def test_defaults_fill_only_what_is_left_out(checkpoint):
    raw = {"train": {"hf_model": str(checkpoint["ckpt"])}}
    assert fill_hf_defaults(raw) == {**{f"train.{k}": v for k, v in HF_TRAIN_DEFAULTS.items()}, "model.seq_len": 128}
    given = {"train": {"hf_model": str(checkpoint["ckpt"]), "lr": 1e-2}, "model": {"seq_len": 32}}
    assert fill_hf_defaults(given) == {"train.checkpoint_every": 50} and given["train"]["lr"] == 1e-2
    assert fill_hf_defaults({"train": {"steps": 3}}) == {}  # no checkpoint: lrmoe's own defaults
    cfg = from_dict({"train": {"hf_model": str(checkpoint["ckpt"])}})
    assert cfg.model.seq_len == 128 and cfg.train.lr == HF_TRAIN_DEFAULTS["lr"]
    assert cfg.train.steps == TrainConfig.steps  # everything else: one source, the code's defaults


def test_window_is_at_most_the_default_and_the_checkpoints(checkpoint, tmp_path):
    folder = tmp_path / "long"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert from_dict({"train": {"hf_model": str(folder)}}).model.seq_len == HF_WINDOW
    # the shipped config repeats none of the defaults: a checkpoint of 128 positions fits it
    cfg = load(CONFIGS / "hf.toml", [f"train.hf_model={json.dumps(str(checkpoint['ckpt']))}"])
    assert cfg.model.seq_len == 128 and cfg.train.lr == HF_TRAIN_DEFAULTS["lr"]


def test_hf_model_alone_trains_and_saves_what_transformers_loads(checkpoint, tmp_path):
    out = tmp_path / "run"
    r = run_main("train", "--hf-model", checkpoint["ckpt"], "--data", checkpoint["corpus"], "--steps", "6",
                 "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    chosen = [line for line in r.stdout.splitlines() if line.startswith("--hf-model without --config")]
    assert len(chosen) == 1 and "model.seq_len=128 (the checkpoint's 128 positions, at most 256)" in chosen[0]
    assert "train.lr=0.0003" in chosen[0] and "train.steps=6" in chosen[0] and "train.nproc=2" in chosen[0]
    cfg = load(out / "config.toml")
    assert cfg.model.seq_len == 128 and cfg.train.steps == 6 and cfg.train.lr == HF_TRAIN_DEFAULTS["lr"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert not any(type(m).__module__.startswith("lrmoe") for m in saved.modules())
    assert saved(input_ids=torch.arange(8)[None]).logits.shape == (1, 8, 384)


def test_no_config_and_no_checkpoint_is_one_line(tmp_path):
    for command in ("train", "compare"):
        line = one_line_error(run_main(command, "--steps", "2", "--out", tmp_path / "out"))
        assert "--config FILE is required (or --hf-model DIR" in line
    assert not (tmp_path / "out").exists()
