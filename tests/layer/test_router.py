"""Router losses and the aux-loss-free bias update."""

from __future__ import annotations

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from lrmoe.router import Router


def test_aux_and_z_loss_values():
    cfg = MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    x = torch.randn(20, 8)
    layer(x)
    logits = x @ layer.router.weight.t()
    probs = logits.softmax(-1)
    ids = probs.topk(2, -1).indices
    frac = torch.bincount(ids.flatten(), minlength=4).float() / ids.numel()
    want = 0.01 * 4 * (frac * probs.mean(0)).sum() + 0.001 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(layer.aux_loss, want)
    layer.aux_loss.backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_no_aux_loss_by_default():
    layer = MoELayer(MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=2))
    layer(torch.randn(5, 8))
    assert layer.aux_loss.item() == 0.0


def test_bias_update_moves_toward_balance():
    cfg = MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=1, router="sigmoid")
    router = Router(cfg)
    router.update_bias(torch.tensor([10, 0, 5, 5]), rate=0.1)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    with pytest.raises(ValueError, match="sigmoid"):
        Router(MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=1)).update_bias(torch.ones(4))


def test_bias_changes_choice_not_weights():
    cfg = MoEConfig(dim=8, ffn_dim=8, num_experts=4, top_k=1, router="sigmoid", norm_topk_prob=False)
    torch.manual_seed(0)
    router = Router(cfg)
    x = torch.randn(6, 8)
    before = router(x)
    router.e_score_correction_bias[1] = 100.0
    after = router(x)
    assert torch.all(after.ids_TK == 1)
    torch.testing.assert_close(after.weights_TK[:, 0], torch.sigmoid(x @ router.weight.t())[:, 1])
    assert not torch.equal(before.ids_TK, after.ids_TK)
