"""Foundation: the expert-parallel layer against an independent dense reference, at world sizes
1–4, with skewed routing, empty ranks and uneven expert ownership; transformers parity."""

from __future__ import annotations

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from lrmoe.integrations.hf import from_hf_block, hf_block_state_dict
from tests.reference import reference_grads

ATOL = 2e-5


def close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = max(want.float().abs().max().item() if want.numel() else 0.0, 1.0)
    assert err <= atol * scale, f"{name}: max abs error {err:.3g} (scale {scale:.3g})"


def make_problem(cfg: MoEConfig, n_tokens: int, seed: int, skew: str):
    """A full state dict and full inputs, identical on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    sd = MoELayer(cfg).state_dict()
    x = torch.randn(n_tokens, cfg.dim, generator=gen)
    g = torch.randn(n_tokens, cfg.dim, generator=gen)
    if skew != "none":
        # Every token gets a common direction u; the router row of expert 0 is ∓(large)·u.
        u = torch.ones(cfg.dim) / cfg.dim**0.5
        x = x + 3.0 * u
        sd["router.weight"][0] = (-8.0 if skew == "empty_expert" else 8.0) * u
    if "router.e_score_correction_bias" in sd:
        sd["router.e_score_correction_bias"] = 0.1 * torch.randn(cfg.num_experts, generator=gen)
    return sd, x, g


def split_tokens(n_tokens: int, world: int, empty_rank: int | None) -> list[int]:
    sizes = [n_tokens // world] * world
    sizes[-1] += n_tokens - sum(sizes)
    if empty_rank is not None and world > 1:
        sizes[(empty_rank + 1) % world] += sizes[empty_rank]
        sizes[empty_rank] = 0
    return sizes


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


QWEN = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)
GLM = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2, router="sigmoid", n_group=2, topk_group=1,
           routed_scaling_factor=2.5, num_shared_experts=1, shared_ffn_dim=12)


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


# ------------------------------------------------------------------- transformers parity


def hf_blocks():
    from transformers import Glm4MoeConfig, Qwen3MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    q = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=24, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True))
    glm = Glm4MoeMoE(Glm4MoeConfig(hidden_size=16, moe_intermediate_size=24, n_routed_experts=8,
                                   num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                   routed_scaling_factor=1.5, norm_topk_prob=True))
    for block in (q, glm):
        for p in block.parameters():
            torch.nn.init.normal_(p, std=0.3)
        if hasattr(block.gate, "e_score_correction_bias"):
            block.gate.e_score_correction_bias.normal_(std=0.05)
    return {"qwen3": q, "glm45": glm}


def hf_case(group, kind: str):
    from lrmoe.parallel import comm

    block = hf_blocks()[kind]
    world, rank = comm.world_size(group), comm.rank_of(group)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, 16, generator=gen)
    g = torch.randn(2, 12, 16, generator=gen)
    xr = x.clone().requires_grad_(True)
    block(xr).backward(g)
    hf_grads = {
        "router.weight": block.gate.weight.grad,
        "experts.gate_up_proj": block.experts.gate_up_proj.grad,
        "experts.down_proj": block.experts.down_proj.grad,
    }
    if kind == "glm45":
        for proj in ("gate_proj", "up_proj", "down_proj"):
            hf_grads[f"shared_experts.{proj}.weight"] = getattr(block.shared_experts, proj).weight.grad
    with torch.no_grad():
        hf_out = block(x)

    if world == 1:
        layer = from_hf_block(block)
    else:
        base = from_hf_block(block)
        layer = MoELayer(base.config, group=group)
        layer.load_full_state_dict(hf_block_state_dict(block))
    per = x.shape[0] // world
    xs = x[rank * per : (rank + 1) * per].clone().requires_grad_(True)
    out = layer(xs)
    out.backward(g[rank * per : (rank + 1) * per])
    close("hf out", out.detach(), hf_out[rank * per : (rank + 1) * per])
    close("hf dx", xs.grad, xr.grad[rank * per : (rank + 1) * per])
    grads = layer.gather_full_grads()
    for name, want in hf_grads.items():
        close(f"hf grad {name}", grads[name], want)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["qwen3", "glm45"])
def test_transformers_parity(pool, world, kind):
    pool.run(world, hf_case, kind)


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
