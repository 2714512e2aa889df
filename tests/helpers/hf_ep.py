"""Tiny transformers checkpoints loaded with transformers' own expert parallelism
(``DistributedConfig(fsdp_size=2, ep_size=2, ep_implementation=...)``), and the rank cases of
tests/integrations/test_hf_ep.py: the same batch through ``"all_to_all"`` and ``"lrmoe"``, their
losses, logits and every parameter gradient side by side."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

_ATTN = dict(vocab_size=128, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             max_position_embeddings=64, num_hidden_layers=2)
# family → (transformers config class, its tiny arguments): 4 routed experts, top-2
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(_ATTN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         intermediate_size=64)),
    "mixtral": ("MixtralConfig", dict(_ATTN, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)),
    "deepseek-v3": ("DeepseekV3Config", dict(_ATTN, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=2,
                                             intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                                             num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                             routed_scaling_factor=1.5, q_lora_rank=16, kv_lora_rank=16,
                                             qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=16)),
}
# refused: experts with biases, transposed and interleaved weights, a clamped SwiGLU
GPT_OSS = dict(_ATTN, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
CONFIGS = {**FAMILIES, "gpt-oss": ("GptOssConfig", GPT_OSS)}
EP_SIZE = 2


def make_checkpoint(family: str, path: str, seed: int = 0) -> str:
    """A random tiny checkpoint of ``family`` written by ``save_pretrained`` (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    name, kwargs = CONFIGS[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**kwargs))
    with torch.no_grad():  # a non-zero correction bias: the choice differs from the weights' order
        for buf_name, buf in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.05)
    model.save_pretrained(path)
    return path


def load(path: str, implementation: str | None):
    """The checkpoint on this rank: expert parallel over the pool's 2 ranks (FSDP2 on the rest)
    through ``implementation``, or whole and plain (None)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    if implementation is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = DistributedConfig(fsdp_size=EP_SIZE, ep_size=EP_SIZE, ep_implementation=implementation)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=config)


def batch(rank: int, rows: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(100 + rank))


def step(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) of one forward and backward on this rank's batch."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), out.logits.detach()


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a whole tensor (collective: FSDP and EP shards gathered)."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return grads


def differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """name → (max abs difference, max abs of ``want``)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return {n: ((got[n] - want[n]).abs().max().item(), want[n].abs().max().item()) for n in want}


def all_to_all_backward_bytes(model, ids: torch.Tensor) -> list[int]:
    """Per MoE layer, the bytes this rank sends in ``"all_to_all"``'s backward (collective, from
    the routing of ``ids``): the gradient of every row it received (other ranks' pairs at its
    experts) and of every expert output it got back (its pairs at other ranks' experts), D fp32
    values each; its own pairs cross no wire."""
    routed = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: routed.append(args[1].detach()))
             for name, m in model.named_modules() if name.endswith("mlp.experts")]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    rank, row_bytes = dist.get_rank(), model.config.hidden_size * 4
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts")).gate_up_proj.shape[0]
    out = []
    for ids_TK in routed:
        by_owner = torch.bincount(ids_TK.reshape(-1) // (experts // EP_SIZE), minlength=EP_SIZE)
        every = [torch.empty_like(by_owner) for _ in range(EP_SIZE)]
        dist.all_gather(every, by_owner)
        sent = int(by_owner.sum() - by_owner[rank])
        received = sum(int(every[s][rank]) for s in range(EP_SIZE) if s != rank)
        out.append((sent + received) * row_bytes)
    return out
