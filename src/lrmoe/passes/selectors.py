"""How a call's backward chooses its kept pairs: every pair the forward computed
(:class:`ForwardPairs`); a global selection over a score exchange (:class:`GlobalSelector`); a
local one in the plan's strata, exchanging nothing (:class:`StrataSelector`). Which one a call
takes is chosen with its row path (:func:`lrmoe.passes.row_paths.choose`); the interface they
share, :class:`~lrmoe.passes.record.Selector`, is the record's, which names it."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.parallel.comm import Channel
from lrmoe.passes.backward_rows import Kept
from lrmoe.passes.record import CallRecord, Selector
from lrmoe.selection.arrays import scatter_pairs
from lrmoe.selection.global_selection import select
from lrmoe.selection.ranked import rank_scores
from lrmoe.selection.scores import lrm_scores, pair_scores, squared_norms
from lrmoe.selection.strata import largest_remainder, select_in_strata, strata_on


class ForwardPairs(Selector):
    """Every pair the forward computed (a forward drop's kept ones)."""

    def select(self, call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor | None,
               channel: Channel) -> Kept:
        kept_E = call.plan.forward_SE.sum(0)
        return Kept(call.forward_keep_P, None, kept_E, kept_E)


def _scores(call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor) -> torch.Tensor:
    """LRM scores of this rank's pairs."""
    g_sq_P = squared_norms(g_TD).repeat_interleave(call.ids_TK.shape[1])
    return lrm_scores(weights_TK.reshape(-1), g_sq_P, h_sq_P)


class GlobalSelector(Selector):
    """``lrm``, ``random``, ``sampled``: the kept set chosen across ranks (collective)."""

    def select(self, call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor,
               channel: Channel) -> Kept:
        plan, layer = call.plan, call.layer
        own, shared = layer.streams.next()
        scores_P, ids_P = _scores(call, g_TD, weights_TK, h_sq_P), call.ids_TK.reshape(-1)
        if layer.planner.noise is not None:  # priced as a local-sampled draw of this rank's pairs by expert
            call.clock.lap("bwd_select")
            share_E = largest_remainder(plan.quota_E, plan.counts_SE)[layer.rank].to(ids_P.device)
            layer.planner.noise.add_pairs(scores_P, ids_P, plan.counts_SE[layer.rank], share_E, call.ids_TK.shape[0],
                                          layer.backward.score_power)
            call.clock.lap("bwd_noise")
        sel = select(scores_P, ids_P, plan.counts_SE, plan.quota_E, layer.backward, channel, own, shared)
        return Kept(sel.keep_P, sel.kept_SE, sel.quota_E, sel.kept_SE.sum(0), sel.scale_P, sel.nonfinite)


class StrataSelector(Selector):
    """``local``, ``local-sampled``: drawn in the strata the plan fixes, with no exchange and no
    device→host read; returns the kept mask over the forward's send order too. The strata's
    counts were planned with the backward's plan, during the forward (the record's plan)."""

    def select(self, call: CallRecord, g_TD: torch.Tensor, weights_TK: torch.Tensor, h_sq_P: torch.Tensor,
               channel: Channel) -> Kept:
        plan, layer = call.plan, call.layer
        own, _ = layer.streams.next()
        noise = layer.planner.noise
        send_N = call.rows.pair_idx  # every pair the forward computed, in its send order
        every_pair = np.array_equal(plan.quota_E.numpy(), plan.forward_SE.sum(0).numpy())  # (host counts)
        if every_pair and noise is None:  # no scores needed: every pair of every rank kept, no draw
            return self._every_pair(call, g_TD)
        scores_N = pair_scores(weights_TK.reshape(-1), squared_norms(g_TD), h_sq_P, send_N)
        strata = strata_on(plan.strata, scores_N.device)
        ranked = None
        if noise is not None:  # what trimming would add to the gradient's noise, at every ratio
            sizes_G = plan.strata.sizes_G
            ranked = rank_scores(scores_N, strata.group_N, len(sizes_G), layer.backward.score_power)
            # (for the next step's ratio: nothing in this pass waits for it)
            call.meanwhile(channel, "bwd_noise", lambda: noise.add_pairs(
                scores_N, strata.group_N, torch.from_numpy(sizes_G), strata.share_G, call.ids_TK.shape[0],
                layer.backward.score_power, ranked))
        if every_pair:
            return self._every_pair(call, g_TD)
        keep_N, scale_N, nonfinite = select_in_strata(scores_N, strata.group_N, strata.share_G, layer.backward, own,
                                                      ranked)
        keep_P = scatter_pairs(keep_N, send_N, call.ids_TK.numel())
        scale_P = None if scale_N is None else scatter_pairs(scale_N, send_N, call.ids_TK.numel())
        kept_SE = strata.counts.kept_SE
        return Kept(keep_P, kept_SE, plan.quota_E, kept_SE.sum(0), scale_P, nonfinite, strata, keep_N)

    @staticmethod
    def _every_pair(call: CallRecord, g_TD: torch.Tensor) -> Kept:
        """Every pair the forward computed, of every rank, kept: no draw, and the forward's rows
        (decided from the plan's global figures, so that every rank takes the same row path and
        sends the same messages)."""
        kept_SE = call.plan.strata.kept_SE
        sampled = call.layer.backward.selection == "local-sampled"  # its weights 1/π, here all 1
        scale_P = torch.ones(call.ids_TK.numel(), dtype=torch.float64, device=g_TD.device) if sampled else None
        return Kept(call.forward_keep_P, kept_SE, call.plan.quota_E, kept_SE.sum(0), scale_P, nonfinite=False)

