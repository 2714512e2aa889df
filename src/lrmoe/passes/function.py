"""The routed experts as one autograd function: the forward and backward of
:mod:`lrmoe.passes.forward` and :mod:`lrmoe.passes.backward`. The two passes exchange rows with
separate layouts, so a backward may carry fewer rows (LRMoE compaction) or send them to other
copies than the forward did: hence a hand-written backward, not the autograd of the forward's
collectives."""

from __future__ import annotations

import torch

from lrmoe.passes.backward import routed_backward
from lrmoe.passes.forward import routed_forward
from lrmoe.passes.record import CallRecord


class RoutedExperts(torch.autograd.Function):
    """out_TD = Σ_k w_tk · expert_{ids_tk}(x_t) with the backward of :func:`routed_backward`."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, gate_up, down, call: CallRecord):
        out_TD, y_PD, h_sq_P = routed_forward(call, x_TD, weights_TK, gate_up, down)
        ctx.call = call
        ctx.save_for_backward(x_TD, weights_TK, y_PD, h_sq_P, gate_up, down)
        return out_TD

    @staticmethod
    def backward(ctx, g_TD):
        x_TD, weights_TK, y_PD, h_sq_P, gate_up, down = ctx.saved_tensors
        grads = routed_backward(ctx.call, g_TD, x_TD, weights_TK, y_PD, h_sq_P, gate_up, down)
        return (*grads, None)
