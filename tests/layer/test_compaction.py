"""Compaction in place (lrmoe.passes.compaction): each slot's kept rows end up in the window of
its block that already held the most of them, the fewest rows move, and the compacted rows are
the kept ones in the order dy names them; checked against brute force over small random cases."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.passes.compaction import move_rows, plan_in_place


def _case(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fwd_L = rng.integers(0, 8, int(rng.integers(1, 5)))
    kept_L = np.array([rng.integers(0, f + 1) for f in fwd_L])
    starts_L = np.cumsum(fwd_L) - fwd_L
    kept = [np.sort(rng.choice(f, k, replace=False)) + s for f, k, s in zip(fwd_L, kept_L, starts_L)]
    return np.concatenate(kept).astype(np.int64), fwd_L, kept_L


def test_the_best_window_moves_the_fewest_rows_and_keeps_dy_order():
    rng = np.random.default_rng(0)
    for _ in range(500):
        kept_rows, fwd_L, kept_L = _case(rng)
        src, dst, layout = plan_in_place(kept_rows, fwd_L, kept_L)
        starts_L = np.cumsum(fwd_L) - fwd_L
        fewest = 0
        for l, (start, n, k) in enumerate(zip(starts_L, fwd_L, kept_L)):
            mine = set((kept_rows[(kept_rows >= start) & (kept_rows < start + n)] - start).tolist())
            held = [len(mine & set(range(a, a + k))) for a in range(n - k + 1)]
            a = int(layout.starts_L[l]) - start
            assert held[a] == max(held) and a == held.index(max(held)), "the first best window"
            fewest += k - max(held)
        assert len(src) == len(dst) == fewest
        rows = torch.arange(int(fwd_L.sum()), dtype=torch.float32).unsqueeze(1).repeat(1, 3)
        move_rows([rows], src, dst)
        compacted = torch.cat([rows[s : s + k, 0] for s, k in zip(layout.starts_L.tolist(), kept_L)])
        assert torch.equal(compacted.long(), torch.from_numpy(kept_rows)[layout.order_R])


def test_rows_already_together_do_not_move():
    """Kept rows that already lie together anywhere in their block stay where they are."""
    src, dst, layout = plan_in_place(np.array([2, 3, 4, 6]), np.array([5, 3]), np.array([3, 1]))
    assert len(src) == len(dst) == 0
    assert layout.starts_L.tolist() == [2, 6] and layout.order_R.tolist() == [0, 1, 2, 3]
