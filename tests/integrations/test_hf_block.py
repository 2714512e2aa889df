"""transformers parity: Qwen3-MoE's and GLM-4.5's MoE blocks converted with from_hf_block (world
size 1) or loaded into an expert-parallel layer (world size 2) give transformers' outputs,
input gradients and parameter gradients."""

from __future__ import annotations

import pytest
import torch

from lrmoe import MoELayer
from lrmoe.integrations.hf import from_hf_block, hf_block_state_dict
from tests.helpers.layer import close


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
