"""What the planners' comparisons with their frozen references (tests/oracles/planners.py) share:
the comparison itself and the random and paper-scale instances they run on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe.planning.placement import Placement


def same_outcome(ref, new, *args):
    """Both return equal values (tensors bit for bit), or both raise ValueError saying the same."""
    try:
        want = ref(*args)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            new(*args)
        assert str(got.value) == str(e)
        return None
    got = new(*args)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), (args, want, got)
    elif isinstance(want, Placement):
        assert got.slots == want.slots and torch.equal(got.owner_E, want.owner_E)
    else:
        assert got == want, (args, want, got)
    return got


def random_holders(rng, E: int, R: int, messy: bool = False) -> list[list[int]]:
    """1 to R holders per expert, often one; ``messy``: unsorted, repeated, or none."""
    most = int(rng.integers(1, R + 1))
    out = []
    for _ in range(E):
        k = 1 if rng.random() < 0.3 else int(rng.integers(1, most + 1))
        hs = sorted(rng.choice(R, size=k, replace=False).tolist())
        if messy:
            if rng.random() < 0.2:
                hs = hs[::-1] + hs[:1]  # unsorted, a repeat
            elif rng.random() < 0.1:
                hs = []
        out.append(hs)
    return out


def random_counts(rng, shape) -> np.ndarray:
    hot = int(rng.choice([1, 3, 30, 500]))
    counts = rng.integers(0, hot + 1, size=shape)
    counts[rng.random(shape) < 0.3] = 0
    if rng.random() < 0.3:
        counts[..., : shape[-1] // 2] *= 7  # uneven sources / experts
    return counts.astype(np.int64)


def paper_scale(seed: int, E: int = 128, W: int = 64):
    """As benchmarks/bench_planning.py: 8192 tokens x top-8 per rank, Zipf 1.2 popularity,
    static owners plus 0-2 random replicas (1-3 holders), counts (S, E)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, E + 1) ** 1.2
    popularity = rng.permutation(popularity / popularity.sum())
    counts_SE = torch.from_numpy(rng.multinomial(8192 * 8, popularity, size=W).astype(np.int64))
    base = Placement.static(E, W)
    replicas: list[list[int]] = [[] for _ in range(W)]
    for e in range(E):
        owner = int(base.owner_E[e])
        others = [r for r in rng.permutation(W).tolist() if r != owner]
        for r in others[: int(rng.integers(0, 3))]:
            replicas[r].append(e)
    return counts_SE, base, base.with_replicas(replicas)
