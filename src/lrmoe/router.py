"""Top-k routers with the semantics of HF transformers' MoE blocks: softmax (Qwen3-MoE, Qwen2-MoE,
Qwen3-Next, Mixtral, OLMoE) and sigmoid with correction bias and groups (GLM-4.5, DeepSeek-V3);
lrmoe.integrations.hf_blocks reads which from each block.

The router's parameters are replicated on every rank; it only ever sees this rank's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lrmoe.config import MoEConfig


@dataclass(frozen=True)
class Routing:
    """What the router decided for T tokens: K expert ids and weights per token."""

    weights_TK: torch.Tensor  # combine weights (differentiable), dtype of the input
    ids_TK: torch.Tensor  # int64 expert ids
    logits_TE: torch.Tensor  # fp32 router logits, for aux/z losses


class Router(nn.Module):
    """Softmax (Qwen3) or sigmoid-with-correction-bias (GLM-4.5) top-k router.

    Aux-loss-free balancing (sigmoid router): ``e_score_correction_bias`` only influences which
    experts are chosen, never the weights, and is moved by :meth:`update_bias` once per optimizer
    step, outside autograd.
    """

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim))
        if config.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        else:
            self.e_score_correction_bias = None
        nn.init.normal_(self.weight, std=config.dim**-0.5)

    def forward(self, x_TD: torch.Tensor) -> Routing:
        cfg = self.config
        # fp32 logits, as both reference implementations compute them for numerical stability.
        logits_TE = F.linear(x_TD.float(), self.weight.float())
        if cfg.router == "softmax":
            probs_TE = torch.softmax(logits_TE, dim=-1)
            weights_TK, ids_TK = torch.topk(probs_TE, cfg.top_k, dim=-1)
            if cfg.norm_topk_prob:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        else:
            scores_TE = logits_TE.sigmoid()
            ids_TK = self._choose(scores_TE.detach() + self.e_score_correction_bias)
            weights_TK = scores_TE.gather(1, ids_TK)
            if cfg.norm_topk_prob:
                weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * cfg.routed_scaling_factor
        return Routing(weights_TK.to(x_TD.dtype), ids_TK, logits_TE)

    def _choose(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Group-limited top-k (DeepSeek-V3 / GLM-4.5): best groups by the sum of their top-2."""
        cfg = self.config
        if cfg.n_group > 1:
            T = choice_TE.shape[0]
            grouped_TGe = choice_TE.view(T, cfg.n_group, -1)
            group_score_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
            groups_TG = torch.topk(group_score_TG, cfg.topk_group, dim=-1, sorted=False).indices
            keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, groups_TG, True)
            keep_TE = keep_TG.unsqueeze(-1).expand_as(grouped_TGe).reshape(T, -1)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        return torch.topk(choice_TE, cfg.top_k, dim=-1, sorted=False).indices

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor, rate: float = 1e-3) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the rest.

        Call once per optimizer step with the global per-expert counts since the last call.
        """
        if self.e_score_correction_bias is None:
            raise ValueError("update_bias needs router='sigmoid' (the softmax router has no bias)")
        load_E = counts_E.to(self.e_score_correction_bias)
        self.e_score_correction_bias += rate * torch.sign(load_E.mean() - load_E)


def aux_losses(routing: Routing, config: MoEConfig) -> torch.Tensor:
    """Switch-Transformer load-balancing loss plus ST-MoE router z-loss, on this rank's tokens.

    aux = coef · E · Σ_e f_e · P_e, with f_e the fraction of the T·K pairs routed to e and P_e the
    mean router probability of e; z = coef · mean_t logsumexp(logits_t)².
    """
    logits_TE = routing.logits_TE
    loss = logits_TE.new_zeros(())
    T, E = logits_TE.shape
    if T == 0:
        return loss
    if config.aux_loss_coef > 0:
        probs_TE = torch.softmax(logits_TE, -1) if config.router == "softmax" else logits_TE.sigmoid()
        counts_E = torch.bincount(routing.ids_TK.flatten(), minlength=E).to(probs_TE)
        frac_E = counts_E / routing.ids_TK.numel()
        loss = loss + config.aux_loss_coef * E * (frac_E * probs_TE.mean(0)).sum()
    if config.z_loss_coef > 0:
        loss = loss + config.z_loss_coef * torch.logsumexp(logits_TE, -1).square().mean()
    return loss
