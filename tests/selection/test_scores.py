"""The LRM scores' h factor (:func:`lrmoe.selection.scores.score_norms`)."""

from __future__ import annotations

import torch

from lrmoe.selection.scores import score_norms


def test_score_norms_take_each_rows_slot_mean():
    """With a control variate's slot means the h factor is ‖h_r − h̄_slot(r)‖², slot by slot
    (slots of 3, 0 and 5 rows, the empty one between); without them ‖h_r‖²."""
    torch.manual_seed(0)
    h = torch.randn(8, 6)
    means = torch.randn(3, 6)
    slot = [0, 0, 0, 2, 2, 2, 2, 2]
    counts = torch.tensor([3, 0, 5])
    want = torch.stack([(h[r].double() - means[s].double()).square().sum() for r, s in enumerate(slot)])
    close = {"rtol": 1e-6, "atol": 0.0}  # (one fp32 pass)
    torch.testing.assert_close(score_norms(h, counts, means), want, **close)
    torch.testing.assert_close(score_norms(h, counts, None), h.double().square().sum(1), **close)
