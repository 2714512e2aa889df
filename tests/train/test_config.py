"""Every field of every config validated (the layer's, the backward's, the budget's, training's,
compare's, the model's) with a message naming the field and the value; the layer's own
arguments; topoep's topology; unknown keys rejected."""

from __future__ import annotations

import re

import pytest
import torch

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.models import ModelConfig
from lrmoe.train.config import CompareConfig, ConfigError, TrainConfig, from_dict

BAD = [
    (MoEConfig, dict(dim=8, ffn_dim=8, num_experts=4, top_k=2), [
        ("dim", -1), ("ffn_dim", 0), ("num_experts", 0), ("top_k", 5), ("router", "tanh"),
        ("norm_topk_prob", "yes"), ("routed_scaling_factor", 0), ("n_group", 3), ("topk_group", 9),
        ("num_shared_experts", -1), ("shared_ffn_dim", 0), ("aux_loss_coef", -0.1), ("z_loss_coef", "x"),
        ("dtype", "int8")]),
    (BackwardConfig, {}, [("selection", "best"), ("ratio", 0), ("ratio", 2), ("seed", "s"), ("p_min", 0),
                          ("p_min", 1.5), ("objective", "speed"), ("drop_cost", -0.1)]),
    (ClusterBudget, dict(memory_bytes=10), [("memory_bytes", 0), ("memory_bytes", [1, 0]), ("network_bytes", -5),
                                            ("network_fraction", 0), ("network_fraction", True),
                                            ("slots", 0), ("ranks_per_node", 0), ("inter_node_gbps", 0),
                                            ("intra_node_gbps", "fast")]),
    (TrainConfig, {}, [("system", "fast"), ("steps", 0), ("batch", -2), ("lr", 0), ("weight_decay", -1),
                       ("warmup", -1), ("seed", -1), ("eval_every", 0), ("eval_batches", 0),
                       ("checkpoint_every", -1), ("nproc", 0), ("ep_size", 3), ("vocab_size", 100),
                       ("val_fraction", 0.9), ("bias_update_rate", -1), ("capacity_factor", 0),
                       ("replan_interval", 0), ("on_nonfinite", "ignore"), ("device", "tpu"),
                       ("routing_trace", "runs/x/routing.npz"), ("keep_checkpoints", 0)]),
    (CompareConfig, {}, [("systems", ("static", "warp")), ("target_fraction", 0), ("budget_factor", 0.5),
                         ("dense_eval_every", -1), ("dense_eval_every", 2.5), ("seeds", (1, 1)), ("seeds", (-1,)),
                         ("seeds", 3)]),
    (ModelConfig, {}, [("vocab_size", 0), ("dim", 0), ("n_layers", 0), ("n_heads", 3), ("seq_len", 0),
                       ("first_dense_layers", 9), ("dense_ffn_dim", 0)]),
]


@pytest.mark.parametrize("cls,base,field,value",
                         [(c, b, f, v) for c, b, cases in BAD for f, v in cases],
                         ids=lambda p: getattr(p, "__name__", str(p)))
def test_every_field_is_validated(cls, base, field, value):
    with pytest.raises(ValueError) as e:
        cls(**{**base, field: value})
    msg = str(e.value)
    shown = {str(value), repr(value), repr(list(value)) if isinstance(value, tuple) else repr(value)}
    assert field in msg and any(v in msg for v in shown), msg


@pytest.mark.parametrize("kwargs,field", [
    ({"system": "fastest"}, "system"), ({"capacity_factor": 0}, "capacity_factor"),
    ({"replan_interval": 0}, "replan_interval"), ({"load_ema": 1.0}, "load_ema"),
    ({"system": "static", "budget": ClusterBudget(10)}, "budget"),  # cannot hold its own experts
    ({"system": "topoep"}, "ranks_per_node"),
    ({"system": "static", "routing_trace": torch.ones(2, 4)}, "routing_trace"),
])
def test_layer_arguments_validated(kwargs, field):
    from lrmoe import MoELayer

    with pytest.raises(ValueError, match=field):
        MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=2), **kwargs)


def test_topoep_config_needs_topology():
    with pytest.raises(ConfigError, match="ranks_per_node"):
        from_dict({"train": {"system": "topoep"}})
    assert from_dict({"train": {"system": "topoep"}, "budget": {"ranks_per_node": 1}}).budget.node_of(2) == [0, 1]


def test_a_model_training_cannot_take_is_refused_before_launch():
    """The built-in model's other layers are float32 (a bf16 MoE layer would meet float32 rows at
    its first GEMM), and a model of dense layers alone has nothing for lrmoe to train."""
    with pytest.raises(ConfigError, match=r"model.moe.dtype='bfloat16' is invalid for training"):
        from_dict({"model": {"moe": {"dtype": "bfloat16"}}})
    assert from_dict({"model": {"moe": {"dtype": "float32"}}}).model.moe.torch_dtype == torch.float32
    with pytest.raises(ConfigError, match=r"model.first_dense_layers=2 is invalid for training: it leaves no MoE"):
        from_dict({"model": {"n_layers": 2, "first_dense_layers": 2}})


def test_a_forced_keep_mode_under_a_cap_is_refused_before_launch():
    for budget in ({"memory_bytes": 70_000_000}, {"memory_per_rank": "4GiB"}):
        with pytest.raises(ConfigError, match=r"backward.keep='x\+gate_up' with a memory cap is invalid"):
            from_dict({"backward": {"keep": "x+gate_up"}, "budget": budget})
    assert from_dict({"backward": {"keep": "x+gate_up"}}).backward.keep == "x+gate_up"


@pytest.mark.parametrize("table, needle", [
    ({"target_loss": float("nan")}, "compare.target_loss=nan"), ({"target_loss": 0.0}, "compare.target_loss=0.0"),
    ({"target_loss": float("inf")}, "compare.target_loss=inf"), ({"budget_factor": float("inf")}, "budget_factor=inf"),
    ({"seeds": [2**63]}, "compare.seeds"), ({"systems": ["static", "static"]}, "listed twice")])
def test_compare_values_that_would_fail_after_the_runs_are_refused_first(table, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        from_dict({"compare": table})


def test_unknown_keys_are_rejected():
    for raw, needle in [({"train": {"stepz": 3}}, "stepz"), ({"trian": {}}, "trian"),
                        ({"model": {"moe": {"experts": 3}}}, "experts"), ({"model": {"preset": "big"}}, "big")]:
        with pytest.raises(ConfigError, match=needle):
            from_dict(raw)


def test_compare_seeds_and_dense_evaluation_round_trip():
    import tomllib

    from lrmoe.train.toml_dump import dump_toml

    cfg = from_dict({"compare": {"seeds": [0, 1, 2], "dense_eval_every": 3}})
    assert cfg.compare.seeds == (0, 1, 2) and cfg.compare.dense_eval_every == 3
    assert from_dict({}).compare.dense_eval_every == 5 and from_dict({}).compare.seeds == ()
    assert from_dict(tomllib.loads(dump_toml(cfg.to_dict()))) == cfg


def test_per_layer_floors_reach_their_layers():
    """``[backward] min_ratio_after`` with a list per MoE layer: each built layer plans with its own
    floor; a list that does not match the model's MoE layers is a ConfigError naming the table."""
    from lrmoe.layer import moe_layers
    from lrmoe.train.build import build_model
    from lrmoe.train.groups import Groups
    from tests.helpers.train import tiny

    cfg = tiny(backward={"objective": "time", "min_ratio_after": [[10, [0.3, 0.6]]]})
    model = build_model(cfg, 64, Groups(None, 1))
    floors = [layer.backward_config.at_step(10).min_ratio for _, layer in moe_layers(model)]
    assert floors == [0.3, 0.6]
    with pytest.raises(ConfigError, match=r"\[backward\].*one ratio per MoE layer \(2\)"):
        tiny(backward={"min_ratio_after": [[10, [0.3, 0.6, 0.5]]]})
