"""Foundation: the expert-parallel layer against an independent dense reference, at world sizes
1–4, with skewed routing, empty ranks and uneven expert ownership; (B, S, D) input, recompute,
no_grad, bad input, and the full state dict's round trip. (transformers parity:
tests/integrations/test_hf_block.py.)"""

from __future__ import annotations

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from tests.helpers.layer import GLM, QWEN, close, make_problem, split_tokens
from tests.oracles.dense_moe import reference_grads


def ep_case(group, cfg_kwargs: dict, n_tokens: int, seed: int, skew: str, empty_rank, system: str,
            shape3d: bool = False):
    from lrmoe.parallel import comm

    cfg = MoEConfig(**cfg_kwargs)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, n_tokens, seed, skew)
    sizes = split_tokens(n_tokens, world, empty_rank)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])

    layer = MoELayer(cfg, system=system, group=group)
    layer.load_full_state_dict(sd)
    x_local = x[lo:hi].clone().requires_grad_(True)
    inp = x_local.view(1, -1, cfg.dim) if shape3d else x_local
    out = layer(inp)
    assert out.shape == inp.shape
    out.reshape(-1, cfg.dim).backward(g[lo:hi])
    full_grads = layer.gather_full_grads()

    ref_out, ref_dx, ref_grads, ref_ids = reference_grads(x, g, sd, cfg)
    close("out", out.reshape(-1, cfg.dim).detach(), ref_out[lo:hi])
    close("dx", x_local.grad, ref_dx[lo:hi])
    assert set(full_grads) == set(ref_grads), (set(full_grads), set(ref_grads))
    for name, want in ref_grads.items():
        close(f"grad {name}", full_grads[name], want)
    counts = torch.bincount(ref_ids.flatten(), minlength=cfg.num_experts)
    assert torch.equal(layer.last_stats["counts_E"], counts)
    return {k: layer.last_stats[k] for k in ("recv_rows", "fwd_a2a_bytes", "bwd_a2a_bytes")}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("cfg", [QWEN, GLM], ids=["softmax", "sigmoid"])
def test_matches_dense_reference(pool, world, cfg):
    pool.run(world, ep_case, cfg, 48, 1, "none", None, "static")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize(
    "case",
    [
        ("empty_expert", None, QWEN),
        ("one_expert", None, {**QWEN, "top_k": 1}),
        ("one_expert", None, QWEN),
        ("none", 1, QWEN),
        ("none", None, {**QWEN, "num_experts": 5}),
        ("empty_expert", 0, {**GLM, "num_experts": 6, "n_group": 1}),
    ],
    ids=["expert-no-tokens", "all-to-one-expert", "one-expert-hot", "rank-no-tokens",
         "E-not-multiple", "sigmoid-mixed"],
)
def test_extreme_routing(pool, world, case):
    skew, empty_rank, cfg = case
    pool.run(world, ep_case, cfg, 40, 2, skew, empty_rank, "static")


@pytest.mark.parametrize("world", [1, 2])
def test_three_d_input_and_recompute(pool, world):
    pool.run(world, ep_case, QWEN, 32, 3, "none", None, "static", True)
    pool.run(world, ep_case, GLM, 32, 3, "none", None, "static-recompute", True)


def test_no_grad_keeps_nothing():
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(**QWEN))
    x = torch.randn(12, 16)
    with torch.no_grad():
        y0 = layer(x)
    assert y0.grad_fn is None
    y1 = layer(x.requires_grad_(True))
    torch.testing.assert_close(y0, y1.detach())


def test_bad_input():
    layer = MoELayer(MoEConfig(**QWEN))
    with pytest.raises(ValueError, match=r"\(T, 16\)"):
        layer(torch.randn(4, 15))
    with pytest.raises(ValueError, match="system='nope'"):
        MoELayer(MoEConfig(**QWEN), system="nope")
    for field, value in [("top_k", 9), ("router", "relu"), ("dim", 0), ("n_group", 3),
                         ("aux_loss_coef", -1.0), ("dtype", "int8")]:
        with pytest.raises(ValueError, match=field):
            MoEConfig(**{**QWEN, field: value})


# ------------------------------------------------------------------- full state dict


def test_full_state_dict_roundtrip(pool):
    pool.run(3, state_dict_case)


def state_dict_case(group):
    cfg = MoEConfig(**{**GLM, "num_experts": 8})
    torch.manual_seed(11)
    sd = MoELayer(cfg).state_dict()
    layer = MoELayer(cfg, group=group)
    layer.load_full_state_dict(sd)
    back = layer.full_state_dict()
    assert set(back) == set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
