"""transformers models patched with MoELayer: same loss and gradients, the router logits and
load-balancing loss transformers computes with ``output_router_logits=True``, expert-parallel
training with the LRMoE backward, and back to a plain transformers model that saves and reloads."""

from __future__ import annotations

import os

import pytest
import torch

from lrmoe import BackwardConfig, MoELayer
from lrmoe.integrations.hf import patch_model, unpatch_model
from lrmoe.parallel import comm
from tests.helpers.layer import close


def tiny_qwen(seed: int = 0):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                         num_experts_per_tok=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


def tiny_glm(seed: int = 0):
    """A GLM-4.5 model: one dense layer, then two MoE layers (sigmoid router, groups, shared expert)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                        num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                        n_shared_experts=1, routed_scaling_factor=1.5, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():  # a non-zero correction bias: the choice differs from the weights' order
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.05)
    return model


def _router_grads(model) -> list[torch.Tensor]:
    grads = []
    for m in model.modules():
        if isinstance(m, MoELayer):
            grads.append(m.gather_full_grads()["router.weight"])
        elif hasattr(m, "gate") and hasattr(m, "experts"):
            grads.append(m.gate.weight.grad.clone())
    return grads


@pytest.mark.parametrize("make", [tiny_qwen, tiny_glm], ids=["qwen3-moe", "glm45"])
def test_router_logits_and_aux_loss_match_transformers(make):
    model = make()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # padding: transformers weights its balancing loss by the attention mask
    want = model(ids, labels=ids, attention_mask=mask, output_router_logits=True)
    want.loss.backward()
    want_grads = _router_grads(model)
    model.zero_grad()
    patch_model(model, system="static")
    got = model(ids, labels=ids, attention_mask=mask, output_router_logits=True)
    got.loss.backward()
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits, strict=True):
        close("router logits", a.detach(), b.detach(), 1e-6)
    close("loss", got.loss.detach(), want.loss.detach(), 1e-6)
    if make is tiny_qwen:  # Qwen3-MoE: Switch balancing loss, router_aux_loss_coef x aux_loss in loss
        assert want.aux_loss is not None and float(want.aux_loss.detach()) > 0
        close("aux_loss", got.aux_loss.detach(), want.aux_loss.detach(), 1e-6)
    else:  # GLM-4.5 balances without an aux loss
        assert got.aux_loss is None and want.aux_loss is None
    for a, b in zip(_router_grads(model), want_grads, strict=True):
        close("router grad", a, b)
    # back to transformers: its routers report their logits again (hooks were installed before)
    unpatch_model(model)
    with torch.no_grad():
        again = model(ids, labels=ids, attention_mask=mask, output_router_logits=True)
    assert len(again.router_logits) == 2
    close("unpatched loss", again.loss, want.loss.detach(), 1e-6)


def test_patch_model_takes_router_aux_loss_coef_and_overrides():
    model = tiny_qwen()
    model.config.router_aux_loss_coef = 0.02
    patch_model(model, z_loss_coef=1e-3, replan_interval=5)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert [m.config.aux_loss_coef for m in layers] == [0.02, 0.02]
    assert [m.config.z_loss_coef for m in layers] == [1e-3, 1e-3]
    ids = torch.randint(0, 128, (2, 8))
    model(ids)
    assert all(float(m.aux_loss.detach()) > 0 for m in layers), "each layer's own Switch loss, for loops that add it"
    assert all(m.config.aux_loss_coef == 0.5 for m in patch_model(tiny_qwen(), aux_loss_coef=0.5).modules()
               if isinstance(m, MoELayer))
    assert all(m.config.aux_loss_coef == 0.0 for m in patch_model(tiny_glm()).modules() if isinstance(m, MoELayer))
    with pytest.raises(ValueError, match="num_experts"):
        patch_model(tiny_qwen(), num_experts=8)
    with pytest.raises(TypeError):
        patch_model(tiny_qwen(), no_such_argument=1)


def test_patched_static_matches_transformers():
    model = tiny_qwen()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    patch_model(model, system="static")
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == 2
    loss2 = model(ids, labels=ids).loss
    loss2.backward()
    close("loss", loss2.detach(), loss.detach(), 1e-6)
    got = {}
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            full = m.gather_full_grads()
            got[f"{name}.gate.weight"] = full["router.weight"]
            got[f"{name}.experts.gate_up_proj"] = full["experts.gate_up_proj"]
            got[f"{name}.experts.down_proj"] = full["experts.down_proj"]
    got.update({n: p.grad for n, p in model.named_parameters() if ".mlp." not in n})
    assert set(got) == set(want)
    for name, g in want.items():
        close(name, got[name], g)


def train_patched_case(group, out_dir: str):
    from lrmoe.train.loop import Groups, reduce_gradients

    model = tiny_qwen()
    patch_model(model, system="lrmoe", backward=BackwardConfig(ratio=0.5), group=group)
    rank = comm.rank_of(group)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(10 + rank))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    groups = Groups(group, 0)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=ids).loss
        loss.backward()
        reduce_gradients(model, groups)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for m in model.modules():
            if isinstance(m, MoELayer):
                m.step_end()
        losses.append(float(comm.all_reduce_sum(loss.detach(), group)) / comm.world_size(group))
    kept = [m.last_kept for m in model.modules() if isinstance(m, MoELayer)]
    assert all(not bool(k.all()) for k in kept), "the backward was trimmed"
    with torch.no_grad():
        before = model(ids).logits
    unpatch_model(model)  # collective: gathers every expert
    assert not any(isinstance(m, MoELayer) for m in model.modules())
    with torch.no_grad():
        after = model(ids).logits
    close("unpatched logits", after, before, 1e-5)
    if rank == 0:
        model.save_pretrained(out_dir)
    if group is not None:
        torch.distributed.barrier(group=group)
    from transformers import Qwen3MoeForCausalLM

    reloaded = Qwen3MoeForCausalLM.from_pretrained(out_dir)
    with torch.no_grad():
        close("reloaded logits", reloaded(ids).logits, before, 1e-5)
    return losses


def test_patched_lrmoe_trains_expert_parallel_and_unpatches(pool2, tmp_path):
    # on the 2-rank pool: the case builds process groups (lrmoe.train.groups), and dist.new_group
    # needs every rank of the pool's default group (tests/conftest.py)
    losses = pool2.run(2, train_patched_case, str(tmp_path))[0]
    assert losses[-1] < 0.7 * losses[0], losses


def test_patch_model_gives_each_layer_its_floor():
    """Per-layer floors (``min_ratio_after`` with a list) reach the patched layers in model order;
    a list of another length is refused before anything changes."""
    model = tiny_glm()  # one dense layer, then two MoE layers
    backward = BackwardConfig(objective="time", min_ratio_after=[[5, [0.3, 0.6]]])
    with pytest.raises(ValueError, match=r"one ratio per MoE layer \(2\)"):
        patch_model(model, system="lrmoe", backward=BackwardConfig(min_ratio_after=[[5, [0.3]]]))
    assert not any(isinstance(m, MoELayer) for m in model.modules())
    patch_model(model, system="lrmoe", backward=backward)
    floors = [m.backward_config.at_step(5).min_ratio for m in model.modules() if isinstance(m, MoELayer)]
    assert floors == [0.3, 0.6]
