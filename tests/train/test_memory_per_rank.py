"""``--memory-per-rank`` / ``[budget] memory_per_rank``: a rank's whole memory split into what the
rest of the model takes and each MoE layer's expert-side budget (lrmoe.train.memory_split).

The split is checked against the byte model's documented formulas (docs/training.md "A memory
cap per rank", lrmoe.sim.budget, lrmoe.memory.bytes), written out here again by hand; the
activation estimate against what autograd really keeps; the command line's errors are one line
and exit 2 before any rank starts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lrmoe.models import MoETransformer
from lrmoe.train.config import ConfigError, apply_sets, from_dict, load
from lrmoe.train.memory_split import outside_activation_bytes, split_memory, with_memory_per_rank
from lrmoe.train.model_shape import shape_of
from lrmoe.train.toml_dump import dump_toml
from tests.helpers.train import TINY, config_file, one_line_error, run_main, tiny

MIB = 1 << 20


def by_hand(cfg):
    """The documented formulas for ``cfg`` (the built-in transformer, fp32, AdamW, no shared
    expert, no dense layer): (fixed bytes, one MoE layer's state, the slot, owned experts,
    rows a balanced forward brings, the model's MoE layers)."""
    m, t = cfg.model, cfg.train
    D, F, E, K, L, V = m.dim, m.moe.ffn_dim, m.moe.num_experts, m.moe.top_k, m.n_layers, t.vocab_size
    s, world, T = 4, t.ep_size or t.nproc, t.batch * m.seq_len
    params = 2 * V * D + L * (4 * D * D + 2 * D) + D  # embedding, head, attention + 2 norms a layer, final norm
    dense = params * (s + s + 2 * s)  # parameters, gradients, AdamW's two moments
    acts = T * (L * 13 * D + 4 * D + 2 * V) * s  # ATTENTION_ROWS, HEAD_ROWS, LOGIT_ROWS
    owned, P = -(-E // world), T * K
    state = (owned * 3 * D * F * 2 * s  # the owned experts' AdamW moments
             + P * D * s + P * (s + 16) + 8 * P + T * D * s  # home side: y per pair, weights, ids, order, |h|², x
             + E * D * (2 * s + 2 * s) + T * E * 4)  # router: parameters, gradients, moments; its logits
    return dense + acts, state, 2 * 3 * D * F * s, owned, P, L


def total_at(cfg, M: int) -> int:
    """The rank's bytes with a per-layer budget M: every other layer holds the controller's most
    slots at M (its owned experts plus a quarter of what is left, in slots)."""
    fixed, state, slot, owned, _, L = by_hand(cfg)
    E = cfg.model.moe.num_experts
    copies = min(E, owned + int((M - owned * slot) * 0.25 // slot))
    return fixed + L * state + (L - 1) * copies * slot + M


def smallest(cfg) -> int:
    """The least budget a layer runs with: owned slots, x and y of a balanced forward's rows (and
    ‖h‖²), one row's four activations."""
    _, _, slot, owned, P, _ = by_hand(cfg)
    D, F = cfg.model.dim, cfg.model.moe.ffn_dim
    return owned * slot + P * (2 * D * 4 + 8) + 4 * F * 4


@pytest.mark.parametrize("cap_mib", [6, 8, 64])
@pytest.mark.parametrize("nproc", [1, 2])
def test_split_is_the_byte_models(cap_mib, nproc):
    cfg = tiny(nproc=nproc)
    cap = cap_mib * MIB
    split = split_memory(cfg, cap)
    M = split.layer_budget
    assert total_at(cfg, M) <= cap < total_at(cfg, M + 1)  # the largest budget that fits
    fixed, state, *_ = by_hand(cfg)
    assert split.dense_state + split.outside_acts == fixed and split.moe_state == 2 * state
    assert split.dense_state + split.outside_acts + split.moe_state + split.expert_side == total_at(cfg, M)


def test_smallest_plan_is_the_floor():
    cfg = tiny()
    need = total_at(cfg, smallest(cfg))
    assert split_memory(cfg, need).layer_budget >= smallest(cfg)
    with pytest.raises(ConfigError, match="--memory-per-rank=.* is too small: the smallest plan needs"):
        split_memory(cfg, need - 1, "--memory-per-rank")


@pytest.mark.parametrize("shape", [dict(dim=32, n_heads=2, seq_len=32), dict(dim=64, n_heads=4, seq_len=64),
                                   dict(dim=128, n_heads=4, seq_len=64, n_layers=4)])
def test_activation_estimate_is_what_autograd_keeps(shape):
    """Within 10 % of the bytes autograd keeps outside the MoE layers (saved-tensor hooks) plus the
    logits' gradient that starts the backward."""
    raw = {**TINY, "model": {**TINY["model"], **shape, "moe": {**TINY["model"]["moe"]}}}
    cfg = from_dict(raw)
    model = MoETransformer(cfg.model.__class__(**{**vars(cfg.model), "vocab_size": cfg.train.vocab_size}),
                           make_moe=lambda i: nn.Identity())
    B, S, V = cfg.train.batch, cfg.model.seq_len, cfg.train.vocab_size
    ids = torch.randint(0, V, (B, S))
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        nn.functional.cross_entropy(model(ids).reshape(-1, V), ids.reshape(-1))
    real = sum(kept.values()) + B * S * V * 4
    estimate = outside_activation_bytes(shape_of(cfg), B, S)
    assert abs(estimate - real) <= 0.1 * real, (estimate, real)


def test_config_key_and_its_conflicts(tmp_path):
    raw = {**TINY, "budget": {"memory_per_rank": "40GiB", "ranks_per_node": 1}}
    cfg = from_dict(raw)
    assert cfg.memory_per_rank == 40 << 30 and cfg.budget.ranks_per_node == 1 and cfg.budget.memory_bytes is None
    assert from_dict({**TINY, "budget": {"memory_per_rank": 1_000_000}}).memory_per_rank == 1_000_000
    assert from_dict(apply_sets({**TINY}, ["budget.memory_per_rank=3MiB"])).memory_per_rank == 3 * MIB
    again = tmp_path / "again.toml"
    again.write_text(dump_toml(cfg.to_dict()))
    assert load(again) == cfg
    with pytest.raises(ConfigError, match="memory_per_rank and memory_bytes exclude each other"):
        from_dict({**TINY, "budget": {"memory_per_rank": "40GiB", "memory_bytes": 1000}})
    with pytest.raises(ConfigError, match="budget.memory_per_rank='40GB\\?' is invalid"):
        from_dict({**TINY, "budget": {"memory_per_rank": "40GB?"}})


def test_resolved_config_holds_the_derived_budget(capsys):
    cfg = from_dict({**TINY, "budget": {"memory_per_rank": "8MiB"}})
    resolved = with_memory_per_rank(cfg)
    split = split_memory(cfg, 8 * MIB)
    assert resolved.memory_per_rank is None and resolved.budget.memory_bytes == split.layer_budget
    assert from_dict(resolved.to_dict()) == resolved  # what the ranks load
    out = capsys.readouterr().out
    assert "memory_per_rank 8 MiB (8,388,608 bytes)" in out and f"budget.memory_bytes = {split.layer_budget:,}" in out
    for row in ("dense params+grads+optimizer", "activations outside MoE", "MoE layers' own state", "per MoE layer"):
        assert row in out


def test_train_runs_with_the_split_printed(tmp_path):
    out = tmp_path / "run"
    r = run_main("train", "--config", config_file(tmp_path), "--memory-per-rank", "8MiB", "--steps", "2",
                 "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    M = split_memory(tiny(), 8 * MIB).layer_budget
    assert "--memory-per-rank 8 MiB" in r.stdout and f"budget.memory_bytes = {M:,}" in r.stdout
    assert load(out / "config.toml").budget.memory_bytes == M


@pytest.mark.parametrize("args, needle", [
    (["--memory-per-rank", "1MiB"], "--memory-per-rank=1 MiB is too small: the smallest plan needs"),
    (["--memory-per-rank", "40GB?"], "--memory-per-rank='40GB?' is invalid"),
    (["--memory-per-rank=-1GiB"], "--memory-per-rank='-1GiB' is invalid: a size must be > 0"),
    (["--memory-per-rank", "0"], "--memory-per-rank='0' is invalid: a size must be > 0"),
    (["--memory-per-rank", "8MiB", "--set", "budget.memory_bytes=1000000"], "exclude each other"),
    (["--set", "budget.memory_per_rank=1MiB"], "budget.memory_per_rank=1 MiB is too small"),
])
def test_train_errors_are_one_line_before_launch(tmp_path, args, needle):
    out = tmp_path / "run"
    line = one_line_error(run_main("train", "--config", config_file(tmp_path), *args, "--out", out))
    assert needle in line, line
    assert not out.exists()


def test_compare_takes_it_and_refuses_it_with_memory_caps(tmp_path):
    cfg = config_file(tmp_path)
    line = one_line_error(run_main("compare", "--config", cfg, "--memory-per-rank", "8MiB", "--memory-caps", "0.8x",
                                   "--out", tmp_path / "cmp"))
    assert "--memory-caps and --memory-per-rank" in line
    line = one_line_error(run_main("compare", "--config", cfg, "--memory-per-rank", "1MiB", "--out", tmp_path / "c"))
    assert "too small" in line


def test_flag_replaces_the_files_memory_bytes(tmp_path):
    """A config that caps the expert side (configs/paper.toml) runs with a rank's cap instead."""
    path = config_file(tmp_path, budget={"memory_bytes": 95_000_000})
    r = run_main("train", "--config", path, "--memory-per-rank", "1MiB", "--out", tmp_path / "run")
    assert "too small" in one_line_error(r)  # derived, not refused as both
