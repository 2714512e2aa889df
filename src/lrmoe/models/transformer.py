"""A decoder-only transformer LM: RMSNorm, rotary causal attention, SwiGLU experts.

Presets follow the two reference families at a 2-core-CPU scale:
``qwen3-moe-tiny`` (softmax router, renormalised top-k, no shared expert, every layer MoE) and
``glm45-tiny`` (sigmoid router with an aux-loss-free correction bias, one shared expert, the
first layer dense).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from lrmoe.config import MoEConfig
from lrmoe.experts import SwiGLU
from lrmoe.layer import MoELayer, moe_layers
from lrmoe.validation import positive_int


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 1024
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 64
    first_dense_layers: int = 0
    dense_ffn_dim: int = 128
    rope_theta: float = 10000.0
    moe: MoEConfig = MoEConfig(dim=64, ffn_dim=64, num_experts=8, top_k=2)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len", "dense_ffn_dim"):
            v = getattr(self, f)
            positive_int(f"model.{f}", v)
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"model.n_heads={self.n_heads} is invalid: dim={self.dim} must split into "
                             "heads of an even size")
        if not 0 <= self.first_dense_layers <= self.n_layers:
            raise ValueError(f"model.first_dense_layers={self.first_dense_layers} is invalid: expected "
                             f"0..n_layers={self.n_layers}")
        if self.moe.dim != self.dim:
            raise ValueError(f"moe.dim={self.moe.dim} must equal model.dim={self.dim}")

    @staticmethod
    def from_dict(d: dict) -> ModelConfig:
        """From a TOML table: model fields plus a nested ``moe`` table of MoEConfig fields."""
        d = dict(d)
        preset = d.pop("preset", None)
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"model.preset={preset!r} is invalid: expected one of {sorted(PRESETS)}")
        base = PRESETS[preset] if preset else ModelConfig()
        moe = dict(d.pop("moe", {}))
        known = {f.name for f in fields(ModelConfig)} - {"moe"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"model has unknown keys {sorted(unknown)}: expected {sorted(known)}")
        dim = d.get("dim", base.dim)
        moe_known = {f.name for f in fields(MoEConfig)}
        if set(moe) - moe_known:
            raise ValueError(f"model.moe has unknown keys {sorted(set(moe) - moe_known)}")
        moe_cfg = replace(base.moe, **{"dim": dim, **moe})
        return replace(base, **d, moe=moe_cfg)


PRESETS = {
    "qwen3-moe-tiny": ModelConfig(
        vocab_size=1024, dim=64, n_layers=2, n_heads=4, seq_len=64,
        moe=MoEConfig(dim=64, ffn_dim=64, num_experts=8, top_k=2, router="softmax", norm_topk_prob=True,
                      aux_loss_coef=0.01),
    ),
    "glm45-tiny": ModelConfig(
        vocab_size=1024, dim=64, n_layers=3, n_heads=4, seq_len=64, first_dense_layers=1, dense_ffn_dim=128,
        moe=MoEConfig(dim=64, ffn_dim=64, num_experts=8, top_k=2, router="sigmoid", norm_topk_prob=True,
                      routed_scaling_factor=1.0, num_shared_experts=1),
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(x_BHSd: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding over the last dimension (pairs of halves)."""
    S, d = x_BHSd.shape[-2], x_BHSd.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x_BHSd.device) / d)
    angles = torch.arange(S, dtype=torch.float32, device=x_BHSd.device)[:, None] * freqs[None]
    cos, sin = angles.cos().to(x_BHSd.dtype), angles.sin().to(x_BHSd.dtype)
    a, b = x_BHSd[..., : d // 2], x_BHSd[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.theta = cfg.n_heads, cfg.rope_theta
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(x_BSD).view(B, S, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MoETransformer(nn.Module):
    """Token ids (B, S) → logits (B, S, V); ``loss`` adds the MoE layers' aux losses.

    ``make_moe(layer_index)`` builds each MoE layer (its system, group, budget…); dense layers
    (the first ``first_dense_layers``) are SwiGLU MLPs.
    """

    def __init__(self, cfg: ModelConfig, make_moe: Callable[[int], MoELayer] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        make_moe = make_moe or (lambda i: MoELayer(cfg.moe))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(cfg, SwiGLU(cfg.dim, cfg.dense_ffn_dim) if i < cfg.first_dense_layers else make_moe(i))
            for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=cfg.dim**-0.5)

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [m for _, m in moe_layers(self)]

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids_BS)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, ids_BS: torch.Tensor, targets_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(total loss with aux losses, language-model cross entropy)."""
        return lm_loss(self(ids_BS), targets_BS, self.moe_layers)


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor,
            layers: list[MoELayer]) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross entropy plus the aux losses of ``layers``' last forward, the cross entropy)."""
    ce = F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))
    aux = sum((layer.aux_loss for layer in layers), ce.new_zeros(()))
    return ce + aux, ce
