"""transformers models patched with MoELayer: same loss and gradients, expert-parallel training
with the LRMoE backward, and back to a plain transformers model that saves and reloads."""

from __future__ import annotations

import os

import torch

from lrmoe import BackwardConfig, MoELayer, comm
from lrmoe.integrations.hf import patch_model, unpatch_model
from tests.test_layer import close


def tiny_qwen(seed: int = 0):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                         num_experts_per_tok=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg)


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


def test_patched_lrmoe_trains_expert_parallel_and_unpatches(pool, tmp_path):
    losses = pool.run(2, train_patched_case, str(tmp_path))[0]
    assert losses[-1] < 0.7 * losses[0], losses
