"""transformers families beyond Qwen3-MoE and GLM-4.5 (tests/integrations/test_hf_patch.py):
Mixtral, Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE, OLMoE and DeepSeek-V3. Each block converted with from_hf_block
gives transformers' output and every gradient (router, experts, shared expert and its gate);
each tiny model patched at world size 1 and 2 (expert parallel) gives transformers' loss,
aux loss, router logits and every gradient, and unpatches to a model with no lrmoe module in
it; gpt-oss and the settings MoELayer does not compute are refused with one line."""

from __future__ import annotations

import os

import pytest
import torch

from lrmoe.integrations.hf import (
    FAMILIES,
    REFUSED_BLOCKS,
    SUPPORTED_BLOCKS,
    check_model,
    from_hf_block,
    hf_block_from_layer,
    patch_model,
    unpatch_model,
)
from lrmoe.layer import EXPERT_TENSORS, moe_layers
from lrmoe.parallel import comm
from tests.helpers.layer import close

_ATTN = dict(vocab_size=128, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             max_position_embeddings=64, num_hidden_layers=2)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
# family → (transformers config class, its tiny arguments); 4 experts, top-2, two MoE layers
CONFIGS = {
    "mixtral": ("MixtralConfig", dict(_ATTN, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(_ATTN, **_MOE, intermediate_size=64, num_experts=4,
                                         shared_expert_intermediate_size=24, norm_topk_prob=False)),
    "qwen3-next": ("Qwen3NextConfig", dict(_ATTN, **_MOE, intermediate_size=64, num_experts=4,
                                           shared_expert_intermediate_size=24, norm_topk_prob=True,
                                           layer_types=["full_attention", "full_attention"])),
    "qwen3.5-moe": ("Qwen3_5MoeTextConfig", dict(_ATTN, **_MOE, num_experts=4, shared_expert_intermediate_size=24,
                                                layer_types=["full_attention", "full_attention"])),
    "olmoe": ("OlmoeConfig", dict(_ATTN, num_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                  norm_topk_prob=False)),
    "deepseek-v3": ("DeepseekV3Config", dict(_ATTN, **_MOE, num_hidden_layers=3, first_k_dense_replace=1,
                                             num_key_value_heads=2, intermediate_size=64, n_routed_experts=4,
                                             n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5,
                                             q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=16,
                                             qk_nope_head_dim=8, v_head_dim=16)),
}
# DeepSeek-V3 balances by its correction bias
WITH_AUX_LOSS = ("mixtral", "qwen2-moe", "qwen3-next", "qwen3.5-moe", "olmoe")


def tiny_config(family: str, **changes):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    name, kwargs = CONFIGS[family]
    return getattr(transformers, name)(**{**kwargs, **changes})


def tiny_model(family: str, seed: int = 0, **changes):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **changes))
    with torch.no_grad():  # a non-zero correction bias: the choice differs from the weights' order
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(std=0.05)
    return model


def blocks_of(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in SUPPORTED_BLOCKS]


def hf_names(layer) -> dict[str, str]:
    return FAMILIES[type(layer._hf_origin.block).__name__].names()


def lrmoe_modules(model) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__module__.startswith("lrmoe")]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_block_parity_and_round_trip(family):
    block = blocks_of(tiny_model(family))[-1]
    with torch.no_grad():  # decisive routing, a visible shared-expert gate
        for p in block.parameters():
            p.normal_(std=0.3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 12, 32, generator=gen)
    g = torch.randn(2, 12, 32, generator=gen)
    layer = from_hf_block(block)
    outs = {}
    for name, module in (("hf", block), ("lrmoe", layer)):
        xr = x.clone().requires_grad_(True)
        out = module(xr)
        out.backward(g)
        outs[name] = (out.detach(), xr.grad)
    close("out", outs["lrmoe"][0], outs["hf"][0])
    close("dx", outs["lrmoe"][1], outs["hf"][1])
    theirs = dict(block.named_parameters())
    grads = layer.gather_full_grads()
    assert {hf_names(layer)[n] for n in grads} == set(theirs)
    for ours, g_ours in grads.items():
        close(f"grad {ours}", g_ours, theirs[hf_names(layer)[ours]].grad)
    back = hf_block_from_layer(layer)
    assert type(back) is type(block) and not lrmoe_modules(back)
    want = block.state_dict()
    assert set(back.state_dict()) == set(want)
    for name, t in back.state_dict().items():
        assert t.dtype == want[name].dtype and torch.equal(t, want[name]), name


def test_block_from_layer_keeps_each_tensors_dtype():
    block = blocks_of(tiny_model("deepseek-v3"))[0].to(torch.bfloat16)
    block.gate.float()  # DeepSeek-V3 keeps its router in fp32 under a bf16 model
    back = hf_block_from_layer(from_hf_block(block))
    for name, t in block.state_dict().items():
        assert back.state_dict()[name].dtype == t.dtype and torch.equal(back.state_dict()[name], t), name


def _full_grads(model, group) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the whole model fed with all ranks' tokens, under the
    unpatched model's names."""
    grads, in_layers = {}, set()
    for name, layer in moe_layers(model):
        names = hf_names(layer)
        grads.update({f"{name}.{names[n]}": g for n, g in layer.gather_full_grads().items()})
        in_layers.update(f"{name}.{n}" for n, _ in layer.named_parameters())
    for name, p in model.named_parameters():
        if name not in in_layers:
            grads[name] = comm.all_reduce_sum(p.grad if p.grad is not None else torch.zeros_like(p), group)
    return grads


def model_case(group, family: str) -> None:
    model = tiny_model(family)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(10 + comm.rank_of(group)))
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0  # padding: transformers weights its balancing loss by the attention mask

    def step():
        out = model(ids, labels=ids, attention_mask=mask, output_router_logits=True)
        out.loss.backward()
        return out

    want = step()
    want_grads = {n: comm.all_reduce_sum(p.grad, group) for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    patch_model(model, system="static", group=group)
    assert len(moe_layers(model)) == 2
    # lrmoe.train.groups reduces ".mlp.experts." parameters over owners, every other one (the shared
    # expert's gate too) over all ranks
    routed = {n for n, _ in model.named_parameters() if ".mlp.experts." in n}
    assert routed == {f"{name}.{t}" for name, _ in moe_layers(model) for t in EXPERT_TENSORS}
    got = step()
    close("loss", got.loss.detach(), want.loss.detach(), 1e-6)
    assert (want.aux_loss is not None) == (family in WITH_AUX_LOSS) == (got.aux_loss is not None)
    if want.aux_loss is not None:
        close("aux_loss", got.aux_loss.detach(), want.aux_loss.detach(), 1e-6)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits, strict=True):
        close("router logits", a.detach(), b.detach(), 1e-6)
    got_grads = _full_grads(model, group)
    assert set(want_grads) <= set(got_grads)
    for name, g in got_grads.items():
        close(name, g, want_grads.get(name, torch.zeros_like(g)))
    unpatch_model(model)  # collective: gathers every expert
    assert not lrmoe_modules(model)
    with torch.no_grad():
        again = model(ids, labels=ids, attention_mask=mask, output_router_logits=True)
    assert len(again.router_logits) == 2
    close("unpatched loss", again.loss, want.loss.detach(), 1e-6)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_model_matches_transformers(pool, family, world):
    pool.run(world, model_case, family)


def _meta_model(family: str, **changes):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family, **changes))


def _one_line_error(fn, *args) -> str:
    with pytest.raises(ValueError) as err:
        fn(*args)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_shared_expert_gate_needs_a_shared_expert():
    from lrmoe import MoEConfig

    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=2, shared_expert_gate=True)


def test_check_model_reads_meta_models():
    for family in CONFIGS:
        check_model(_meta_model(family))
    assert "no transformers MoE block" in _one_line_error(check_model, torch.nn.Linear(2, 2))


@pytest.mark.parametrize("case", ["gpt-oss", "jitter", "activation"])
def test_refusals_are_one_line(case):
    from transformers import GptOssConfig

    if case == "gpt-oss":
        cfg = GptOssConfig(**{**_ATTN, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16})
        with torch.device("meta"):
            from transformers import AutoModelForCausalLM

            meta = AutoModelForCausalLM.from_config(cfg)
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

        block, words = GptOssMLP(cfg), ["GptOssMLP", REFUSED_BLOCKS["GptOssMLP"]]
    else:
        family, change = ("mixtral", {"router_jitter_noise": 0.1}) if case == "jitter" else \
            ("qwen2-moe", {"hidden_act": "gelu"})
        meta = _meta_model(family, **change)
        block = blocks_of(tiny_model(family, **change))[0]
        words = ["router_jitter_noise=0.1"] if case == "jitter" else ["hidden_act='gelu'"]
    for message in (_one_line_error(check_model, meta), _one_line_error(patch_model, meta),
                    _one_line_error(from_hf_block, block)):
        assert all(w in message for w in words), message
