"""The block helpers of lrmoe.selection.arrays: on block-sorted vectors, ``block_sum`` and
``expand`` give what ``segment_sum`` and the gather ``x_G[g]`` give, empty blocks included, on
NumPy arrays and torch tensors alike; and a sample drawn through them is the same on both."""

from __future__ import annotations

import numpy as np
import torch

from lrmoe.selection.arrays import block_sum, expand, segment_sum
from lrmoe.selection.sampling import sample_arrays


def _blocks(rng: np.random.Generator, G: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Block ids of N elements over G blocks, ascending, with empty blocks at both ends and between."""
    g = np.sort(rng.integers(1, G - 1, N))
    g[g == G // 2] = G // 2 + 1
    return g, np.bincount(g, minlength=G)


def test_block_sum_and_expand_match_segment_sum_and_gather():
    rng = np.random.default_rng(0)
    for N in (0, 1, 7, 500):
        g, sizes = _blocks(rng, 9, N)
        x, x_G = rng.lognormal(0, 3, N), rng.random(9)
        for lib in (np.asarray, torch.from_numpy):
            got = np.asarray(block_sum(lib(x), lib(sizes)))
            want = np.bincount(g, weights=x, minlength=9)
            assert got.shape == (9,) and np.allclose(got, want, rtol=1e-12, atol=0) and (got[sizes == 0] == 0).all()
            assert np.array_equal(np.asarray(expand(lib(x_G), lib(sizes), N)), x_G[g])
        assert np.array_equal(np.asarray(segment_sum(torch.from_numpy(x), torch.from_numpy(g), 9)),
                              np.asarray(block_sum(torch.from_numpy(x), torch.from_numpy(sizes))))


def test_sample_is_the_same_on_numpy_and_torch():
    """The host (NumPy) and device (torch) paths draw the same pairs with the same π."""
    rng = np.random.default_rng(1)
    for trial in range(40):
        g, sizes = _blocks(rng, 12, int(rng.integers(1, 400)))
        s = rng.lognormal(0, float(rng.uniform(0.1, 8)), len(g))
        s[rng.random(len(g)) < 0.2] = 0.0
        q = np.array([int(rng.integers(0, c + 2)) for c in sizes])
        u = rng.random(12)
        keep_np, pi_np = sample_arrays(s, g, q, u, 0.01)
        keep_t, pi_t = sample_arrays(*(torch.from_numpy(a) for a in (s, g, q, u)), 0.01)
        assert np.array_equal(keep_np, keep_t.numpy()), trial
        assert np.allclose(pi_np, pi_t.numpy(), rtol=1e-12, atol=1e-15), trial
        assert (np.bincount(g[keep_np], minlength=12) == np.minimum(q, sizes)).all(), trial
