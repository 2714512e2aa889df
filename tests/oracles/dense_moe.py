"""An independent dense reference MoE: every expert applied to every token, then a dense
(T, E) combine matrix. Written without any lrmoe code so it can judge the layer.

``keep_TK`` (bool) marks the pairs whose expert path contributes to the backward; a dropped
pair's expert output is detached, so it adds nothing to expert weight gradients or to dx
through that expert, while the router gradient (through the weight) stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x_TD, params, cfg):
    logits = x_TD.float() @ params["router.weight"].float().t()
    E = cfg.num_experts
    if cfg.router == "softmax":
        probs = torch.softmax(logits, -1)
        w, ids = torch.topk(probs, cfg.top_k, -1)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
    else:
        s = torch.sigmoid(logits)
        choice = s.detach() + params.get("router.e_score_correction_bias", torch.zeros(E))
        if cfg.n_group > 1:
            g = choice.view(len(x_TD), cfg.n_group, -1)
            gs = g.topk(2, -1).values.sum(-1)
            top = gs.topk(cfg.topk_group, -1).indices
            mask = torch.zeros_like(gs, dtype=torch.bool).scatter(1, top, True)
            choice = choice.masked_fill(~mask.repeat_interleave(E // cfg.n_group, 1), float("-inf"))
        ids = choice.topk(cfg.top_k, -1).indices
        w = s.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return (w * cfg.routed_scaling_factor).to(x_TD.dtype), ids


def expert_outputs(x_TD, params):
    """(E, T, D) output of every expert on every token, and h (E, T, F)."""
    gu = torch.einsum("td,efd->etf", x_TD, params["experts.gate_up_proj"])
    gate, up = gu.chunk(2, -1)
    h = F.silu(gate) * up
    return torch.einsum("etf,edf->etd", h, params["experts.down_proj"]), h


def dense_moe(x_TD, params, cfg, keep_TK=None, scale_TK=None):
    """Returns (out_TD, ids_TK, h_TKF) with autograd through ``params`` and ``x_TD``.
    ``scale_TK`` scales each pair's expert-path gradient (a sampled backward's 1/π), leaving
    the output and the router gradient as they are."""
    w_TK, ids_TK = route(x_TD, params, cfg)
    y_ETD, h_ETF = expert_outputs(x_TD, params)
    T = x_TD.shape[0]
    t = torch.arange(T).unsqueeze(1).expand_as(ids_TK)
    y_TKD = y_ETD[ids_TK, t]
    if keep_TK is not None:
        y_TKD = torch.where(keep_TK.unsqueeze(-1), y_TKD, y_TKD.detach())
    if scale_TK is not None:
        y_TKD = y_TKD.detach() + scale_TK.unsqueeze(-1).to(y_TKD.dtype) * (y_TKD - y_TKD.detach())
    out = (w_TK.unsqueeze(-1) * y_TKD).sum(1)
    if "shared_experts.gate_proj.weight" in params:
        sh = F.silu(x_TD @ params["shared_experts.gate_proj.weight"].t()) * (
            x_TD @ params["shared_experts.up_proj.weight"].t()
        )
        out = out + sh @ params["shared_experts.down_proj.weight"].t()
    return out, ids_TK, h_ETF[ids_TK, t]


def reference_grads(x_TD, g_TD, state_dict, cfg, keep_TK=None, scale_TK=None):
    """Output, dx and parameter gradients of the dense reference for upstream gradient g."""
    params = {k: v.detach().clone().requires_grad_(v.is_floating_point() and "bias" not in k)
              for k, v in state_dict.items()}
    x = x_TD.detach().clone().requires_grad_(True)
    out, ids, _ = dense_moe(x, params, cfg, keep_TK, scale_TK)
    out.backward(g_TD)
    grads = {k: p.grad for k, p in params.items() if p.requires_grad}
    return out.detach(), x.grad, grads, ids
