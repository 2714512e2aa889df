"""``lrmoe train --hf-model DIR``: a local transformers checkpoint (tiny random models saved to a
temporary folder with a tokenizer trained here, all offline) trains at 2 ranks, and the folder it
saves loads back in plain transformers to the logits of the patched model at the end of training;
a folder it cannot train is one line and exit 2 before any rank starts."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from lrmoe.train import checkpoint
from lrmoe.train.groups import Groups
from lrmoe.train.state import TrainState
from tests.helpers.train import losses, one_line_error, run_main, write_text_folder

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TINY_SHAPE = {"vocab_size": 384, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64}
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
CONFIG = """[model]
seq_len = 32

[train]
steps = 10
batch = 4
lr = 1e-2
warmup = 2
eval_every = 5
eval_batches = 1
checkpoint_every = 5
nproc = 2
"""


def _tokenizer(corpus: Path):
    """A byte-level BPE of 300 tokens trained on the test corpus, as transformers' fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(p) for p in sorted(corpus.iterdir())], vocab_size=300, min_frequency=2, show_progress=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="</s>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The corpus, the config file and one checkpoint folder per family (weights and tokenizer)."""
    root = tmp_path_factory.mktemp("hf")
    write_text_folder(root / "corpus")
    (root / "cfg.toml").write_text(CONFIG)
    tokenizer = _tokenizer(root / "corpus")
    out = {"corpus": root / "corpus", "config": root / "cfg.toml"}
    for family, (config_class, extra) in FAMILIES.items():
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**TINY_SHAPE, **extra)
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
        out[family] = root / family
    return out


def _patched_from_checkpoint(source: Path, run: Path):
    """The patched model of ``source`` at world size 1 with the run's last checkpoint loaded (it
    loads at any world size)."""
    from lrmoe.integrations.hf import patch_model
    from lrmoe.train.hf_model import HFCausalLM

    model = HFCausalLM(patch_model(transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32),
                                   system="static"))
    groups = Groups(None, 0)
    state = TrainState(model, torch.optim.AdamW(model.parameters()), groups)
    meta, flat = checkpoint.load_latest(run, lambda index, meta: state.targets(index), None, 0)
    state.restore(flat)
    return model, meta["step"]


@pytest.mark.parametrize("family,system", [("qwen3-moe", "lrmoe"), ("mixtral", "static")])
def test_hf_checkpoint_trains_and_saves_what_transformers_reloads(folders, tmp_path, family, system):
    """2 ranks train the checkpoint with ``system``; the loss goes down; ``out/hf`` and every
    checkpoint's ``hf`` folder are plain transformers folders (config, weights, tokenizer), and
    ``out/hf`` gives the logits of the patched model with the last checkpoint loaded."""
    out = tmp_path / "run"
    r = run_main("train", "--config", folders["config"], "--hf-model", folders[family], "--data", folders["corpus"],
                 "--system", system, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    loss = losses(out)
    assert len(loss) == 10 and sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.1, loss
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.is_dir()) == ["step_0000005", "step_0000010"]
    assert (checkpoint.step_folder(out, 5) / "hf" / "config.json").is_file()
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    assert not any(type(m).__module__.startswith("lrmoe") for m in saved.modules())
    assert transformers.AutoTokenizer.from_pretrained(out / "hf").get_vocab() == \
        transformers.AutoTokenizer.from_pretrained(folders[family]).get_vocab()
    patched, step = _patched_from_checkpoint(folders[family], out)
    assert step == 10
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = patched(ids), saved(input_ids=ids).logits
        original = transformers.AutoModelForCausalLM.from_pretrained(folders[family])(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - original).abs().max() > 1e-2  # trained: not the folder it started from
    config = (out / "config.toml").read_text()
    assert f'hf_model = "{folders[family].resolve()}"' in config and "[model.moe]" not in config


def test_hf_run_resumes_from_its_checkpoint(folders, tmp_path):
    """A run stopped at step 5 goes on with ``--resume`` from its checkpoint (the patched layers'
    experts and their optimizer state included) to step 10."""
    out = tmp_path / "run"
    common = ("--config", folders["config"], "--hf-model", folders["qwen3-moe"], "--data", folders["corpus"],
              "--system", "symi", "--out", out)
    assert run_main("train", *common, "--steps", 5).returncode == 0
    first = (out / "metrics.jsonl").read_text().splitlines()
    r = run_main("train", *common, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))
    assert lines[:5] == first  # steps 1-5 not run again (their timings would differ)
    assert (out / "hf" / "model.safetensors").is_file()


def _meta_folder(tmp_path: Path, name: str, config) -> Path:
    """A folder with a model's config.json and a placeholder weights file: what the launcher
    reads before it loads any weight."""
    folder = tmp_path / name
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_hf_folders_it_cannot_train_are_one_line(folders, tmp_path):
    """No folder, no config.json, no weights, a model without MoE blocks, a refused family
    (gpt-oss), no tokenizer, [model] keys the checkpoint fixes, windows longer than its context:
    each one line, exit 2, before any rank starts (no output folder)."""
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in folders["qwen3-moe"].iterdir():
        if "token" not in f.name:
            shutil.copy(f, no_tokenizer / f.name)
    no_weights = tmp_path / "no-weights"
    transformers.Qwen3MoeConfig(**TINY_SHAPE).save_pretrained(no_weights)
    dense = _meta_folder(tmp_path, "llama", transformers.LlamaConfig(**TINY_SHAPE))
    gpt_oss = _meta_folder(tmp_path, "gpt-oss", transformers.GptOssConfig(**TINY_SHAPE, num_local_experts=4))
    (tmp_path / "empty").mkdir()
    shaped = tmp_path / "shaped.toml"
    shaped.write_text(CONFIG.replace("seq_len = 32", "seq_len = 32\ndim = 64"))
    cases = [
        (tmp_path / "missing", folders["config"], "no such folder"),
        (tmp_path / "empty", folders["config"], "not a transformers checkpoint (no config.json)"),
        (no_weights, folders["config"], "no weights"),
        (dense, folders["config"], "MoE"),
        (gpt_oss, folders["config"], "GptOssMLP"),
        (no_tokenizer, folders["config"], "no tokenizer"),
        (folders["qwen3-moe"], shaped, "['dim'] cannot be set with train.hf_model"),
    ]
    for folder, config, needle in cases:
        out = tmp_path / "out"
        r = run_main("train", "--config", config, "--hf-model", folder, "--data", folders["corpus"], "--out", out)
        assert needle in one_line_error(r), (folder, r.stderr)
        assert not out.exists()
    r = run_main("train", "--config", folders["config"], "--hf-model", folders["qwen3-moe"], "--data",
                 folders["corpus"], "--set", "model.seq_len=128", "--out", tmp_path / "out")
    assert "max_position_embeddings" in one_line_error(r)


def test_compare_runs_every_system_from_the_checkpoint(folders, tmp_path):
    """``compare --hf-model``: each system trains the same checkpoint and saves its own ``hf``."""
    out = tmp_path / "cmp"
    r = run_main("compare", "--config", folders["config"], "--hf-model", folders["qwen3-moe"], "--data",
                 folders["corpus"], "--systems", "static,lrmoe", "--steps", 5, "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert {"static", "lrmoe"} <= set(results["systems"])
    for system in ("static", "lrmoe"):
        assert (out / system / "hf" / "config.json").is_file()
