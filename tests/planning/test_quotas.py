"""Max-min fair quotas (lrmoe.planning.quotas) and the largest common ratio
(lrmoe.planning.quota_ratio): their properties on a small case; the fast path against the
quotas before the speed-ups (tests/oracles/planners.py), which it must match bit for bit, on
random and paper-scale instances and on instances chosen to exercise each of its shortcuts: ample
ranks left out of round 1's max-flow, frozen sets that fill their holders exactly leaving the
problem (and the next round's first blocking set derived without a max-flow), rounds whose last
set does not fill its holders (tied counts), leftover capacity (the reference then runs), messy
holder lists, infeasible capacities (the same error text), and the ratio from the steps of q,
including counts whose sums pass 2⁵³."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe.planning.quota_ratio import fair_quotas, largest_ratio, quota_array
from lrmoe.planning.quotas import _contested_experts, max_min_quotas
from tests.helpers.planning import paper_scale, random_counts, random_holders, same_outcome
from tests.oracles.planners import ref_largest_ratio, ref_max_min_quotas


def test_max_min_quotas_properties():
    counts = torch.tensor([100, 50, 10, 0, 40])
    holders = [[0], [0, 1], [1], [1], [2]]
    q = max_min_quotas(counts, holders, [60, 30, 100])
    assert (q <= counts).all() and q[3] == 0
    assert q[4] == 40, "an expert on an idle rank keeps everything"
    assert int(q[:3].sum()) == 90, "the bottleneck ranks are filled"
    ratios = q[:3].double() / counts[:3].double()
    assert ratios.max() - ratios.min() < 0.05, "max-min fair: one ratio for the bottleneck"
    # ample capacity: exact
    assert torch.equal(max_min_quotas(counts, holders, [1000] * 3), counts)
    # monotone in capacity
    prev = torch.zeros(5, dtype=torch.long)
    for cap in (10, 20, 40, 80, 160, 320):
        q = max_min_quotas(counts, holders, [cap] * 3)
        assert (q >= prev).all()
        prev = q
    with pytest.raises(ValueError, match="one pair of every expert"):
        max_min_quotas(counts, holders, [1, 0, 5])


def skewed(rng, E: int, W: int) -> tuple[torch.Tensor, list[list[int]], list[int]]:
    """Zipf expert loads, each expert on its owner and 0-2 other ranks, a capacity near the mean
    load per rank (from ample down to infeasible): many rounds, most of them saturated."""
    pop = 1.0 / np.arange(1, E + 1) ** rng.choice([0.6, 1.2, 2.0])
    counts = rng.multinomial(int(rng.integers(E, 4000 * W)), rng.permutation(pop / pop.sum()))
    holders = []
    for e in range(E):
        others = [r for r in rng.permutation(W).tolist() if r != e % W]
        holders.append(sorted([e % W] + others[: int(rng.integers(0, 3))]))
    mean = max(int(counts.sum()) // W, 1)
    cap = (mean * rng.choice([0.05, 0.5, 0.9, 1.0, 1.3]) * rng.uniform(0.7, 1.3, W)).astype(int).tolist()
    return torch.from_numpy(counts.astype(np.int64)), holders, cap


def test_matches_reference_on_skewed_loads():
    rng = np.random.default_rng(11)
    for _ in range(150):
        E = int(rng.integers(2, 80))
        W = int(rng.integers(1, 24))
        same_outcome(ref_max_min_quotas, max_min_quotas, *skewed(rng, E, W))


def test_matches_reference_with_ties():
    """Equal counts step together: a round's quotas can leave room on its holders (the set then
    stays), and leftover capacity goes to frozen experts (the reference's flow decides)."""
    rng = np.random.default_rng(12)
    for _ in range(300):
        R = int(rng.integers(1, 7))
        E = int(rng.integers(1, 16))
        counts = np.full(E, int(rng.choice([3, 7, 100, 1001])), np.int64)
        counts[rng.random(E) < 0.3] *= int(rng.integers(1, 4))
        holders = random_holders(rng, E, R)
        scale = max(int(counts.sum()) // R, 1)
        cap = (scale * rng.choice([0.3, 0.6, 0.9], R) + rng.integers(-2, 3, R)).clip(0).astype(int).tolist()
        same_outcome(ref_max_min_quotas, max_min_quotas, torch.from_numpy(counts), holders, cap)


def test_matches_reference_with_messy_holders_and_bad_capacities():
    """Unsorted or repeated holders, experts without one, zero capacities; holders that are not
    ranks and negative capacities go to the reference's own path."""
    rng = np.random.default_rng(13)
    for case in range(300):
        R = int(rng.integers(1, 9))
        E = int(rng.integers(1, 25))
        counts, holders, cap = skewed(rng, E, R)
        holders = [hs[::-1] + hs[:1] if rng.random() < 0.3 else hs for hs in holders]
        if rng.random() < 0.2:
            holders[int(rng.integers(0, E))] = []
        if rng.random() < 0.3:
            cap[int(rng.integers(0, R))] = 0
        if case % 41 == 0:
            cap[0] = -1
        same_outcome(ref_max_min_quotas, max_min_quotas, counts, holders, cap)
        if case % 37 == 0:  # a holder past the last rank: both fail alike
            holders[-1] = [R]
            for planner in (ref_max_min_quotas, max_min_quotas):
                with pytest.raises(IndexError):
                    planner(counts, holders, cap)


def test_errors_name_the_same_sets():
    rng = np.random.default_rng(14)
    raised = 0
    for _ in range(200):
        counts, holders, cap = skewed(rng, int(rng.integers(2, 40)), int(rng.integers(1, 12)))
        cap = [x // int(rng.integers(1, 2000)) for x in cap]  # down to less than a pair per expert
        try:
            ref_max_min_quotas(counts, holders, cap)
        except ValueError:
            raised += 1
        same_outcome(ref_max_min_quotas, max_min_quotas, counts, holders, cap)
    assert raised > 20


def test_every_cut_expert_is_contested():
    """The experts round 1's max-flow keeps (none of their holders can take all of its experts'
    pairs) include every expert the quotas cut."""
    rng = np.random.default_rng(15)
    for _ in range(100):
        counts, holders, cap = skewed(rng, int(rng.integers(2, 80)), int(rng.integers(1, 24)))
        try:
            quotas = ref_max_min_quotas(counts, holders, cap)
        except ValueError:
            continue
        contested = _contested_experts(counts.tolist(), holders, cap, len(cap))
        assert set(torch.nonzero(quotas < counts).flatten().tolist()) <= set(contested)


def test_fair_quotas_are_the_quotas_at_the_largest_ratio():
    """One pass for ρ and q(ρ, c), as the reference's bisection settles them, for counts from a
    few pairs up to 2⁵², whose sums pass 2⁵³ (where float sums are no longer exact)."""
    rng = np.random.default_rng(16)
    for case in range(3000):
        n = int(rng.integers(1, 30))
        kind = case % 4
        if kind == 0:
            c = rng.integers(1, 60, n)
        elif kind == 1:
            c = rng.integers(1, 10**6, n)
        elif kind == 2:
            c = rng.choice([int(rng.integers(1, 100)), 2**51 - 1, 2**52 - 1], n)
        else:
            c = rng.integers(1, 2**51, n)
        c = c.astype(np.int64)
        room = int(rng.integers(n - 2, int(c.sum()) + 3))
        rho = ref_largest_ratio(c, room)
        assert largest_ratio(c, room) == rho, (c.tolist(), room)
        counts = c.tolist()
        assert fair_quotas(counts, [float(x) for x in counts], room) == quota_array(c, rho).tolist(), (counts, room)


def test_max_min_quotas_matches_reference():
    rng = np.random.default_rng(1)
    for case in range(600):
        R = int(rng.integers(1, 10))
        E = int(rng.integers(0, 30)) if case % 50 else 0
        counts = random_counts(rng, (E,))
        if rng.random() < 0.3 and E > 1:
            counts[rng.integers(0, E, E // 2)] = counts[0]  # repeated counts: steps coincide
        holders = random_holders(rng, E, R, messy=case % 7 == 0)
        scale = max(int(counts.sum()) // R, 1)
        cap = (rng.random(R) * scale * rng.choice([0.05, 0.3, 1.0, 3.0])).astype(int).tolist()
        same_outcome(ref_max_min_quotas, max_min_quotas, torch.from_numpy(counts), holders, cap)


@pytest.mark.parametrize("fraction", [0.3, 1.0])
def test_max_min_quotas_matches_reference_at_paper_scale(fraction):
    for seed in range(2):
        counts_SE, _, placement = paper_scale(seed)
        cap = [int(fraction * 8192 * 8)] * counts_SE.shape[0]
        same_outcome(ref_max_min_quotas, max_min_quotas, counts_SE.sum(0), placement.holder_lists, cap)


def test_largest_ratio_matches_bisection():
    rng = np.random.default_rng(2)
    for case in range(3000):
        n = int(rng.integers(1, 40))
        kind = case % 5
        if kind == 0:
            c = rng.integers(0, 4, n)
        elif kind == 1:
            c = rng.integers(0, 60, n)
        elif kind == 2:
            c = rng.integers(0, 10**6, n)
        elif kind == 3:
            c = np.full(n, int(rng.integers(1, 1000)))
        else:
            c = (rng.zipf(1.3, n) * int(rng.integers(1, 1000))).clip(0, 10**9)
        c = c.astype(np.int64)
        room = int(rng.integers(-2, int(c.sum()) + 3))
        assert largest_ratio(c, room) == ref_largest_ratio(c, room), (c.tolist(), room)
