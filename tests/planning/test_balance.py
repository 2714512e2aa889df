"""assign_min_peak against an independent exact method (binary search over the peak with a
networkx max-flow feasibility test), property-based; the compact pair assignment's views against
its dense form; and assign_min_peak against the planner it replaced (tests/oracles/planners.py),
bit for bit and error for error, on random cases and at paper scale (128 experts x 64 ranks)."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.planning.assignment import PairAssignment
from lrmoe.planning.balance import assign_min_peak, min_peak_assignment
from tests.helpers.planning import paper_scale, random_counts, random_holders, same_outcome
from tests.oracles.planners import ref_assign_min_peak


def optimal_peak(counts, holders, capacity=None, base=None):
    """Smallest P such that a flow places every row with base_r + rows_r <= min(P, cap_r);
    None when no P works."""
    E, R = counts.shape
    base = [0] * R if base is None else list(base)
    n = counts.sum(1).tolist()

    def feasible(P):
        g = nx.DiGraph()
        for e in range(E):
            if n[e]:
                g.add_edge("s", ("e", e), capacity=n[e])
                for r in holders[e]:
                    g.add_edge(("e", e), ("r", r))  # no capacity attribute: unbounded
        for r in range(R):
            room = min(P, capacity[r]) if capacity is not None else P
            g.add_edge(("r", r), "t", capacity=max(room - base[r], 0))
        if sum(n) == 0:
            return True
        return nx.maximum_flow_value(g, "s", "t") == sum(n)

    lo, hi = max(base), max(base) + sum(n)
    if not feasible(hi if capacity is None else max(hi, max(capacity))):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@st.composite
def instances(draw, max_e=32, max_r=8):
    R = draw(st.integers(1, max_r))
    E = draw(st.integers(1, max_e))
    holders = [sorted(draw(st.sets(st.integers(0, R - 1), min_size=1, max_size=min(4, R)))) for _ in range(E)]
    hot = draw(st.integers(0, 50))
    counts = torch.tensor([[draw(st.integers(0, hot)) for _ in range(R)] for _ in range(E)], dtype=torch.long)
    base = draw(st.one_of(st.none(), st.lists(st.integers(0, 30), min_size=R, max_size=R)))
    return counts, holders, base


def check(counts, holders, assign, capacity=None, base=None):
    E, R = counts.shape
    assert assign.shape == (E, R, R) and assign.dtype == torch.long
    assert torch.equal(assign.sum(2), counts), "conservation"
    assert (assign >= 0).all()
    for e in range(E):
        others = [r for r in range(R) if r not in holders[e]]
        assert assign[e][:, others].sum() == 0, "rows only on holders"
    load = assign.sum((0, 1)) + (torch.tensor(base) if base is not None else 0)
    if capacity is not None:
        assert (load <= torch.tensor(capacity)).all(), "capacity respected"
    return int(load.max())


@settings(max_examples=150, deadline=None)
@given(instances())
def test_peak_is_optimal(inst):
    counts, holders, base = inst
    assign = assign_min_peak(counts, holders, base_R=base)
    peak = check(counts, holders, assign, base=base)
    assert peak == optimal_peak(counts, holders, base=base)


@settings(max_examples=100, deadline=None)
@given(instances(), st.data())
def test_capacity_respected_or_infeasible(inst, data):
    counts, holders, base = inst
    R = counts.shape[1]
    base_l = base or [0] * R
    capacity = [b + data.draw(st.integers(0, 80)) for b in base_l]
    want = optimal_peak(counts, holders, capacity, base_l)
    if want is None:
        with pytest.raises(ValueError, match="infeasible"):
            assign_min_peak(counts, holders, capacity, base_l)
        return
    assign = assign_min_peak(counts, holders, capacity, base_l)
    assert check(counts, holders, assign, capacity, base_l) == want


@settings(max_examples=100, deadline=None)
@given(instances(max_e=16, max_r=6))
def test_full_replication_peak_and_locality(inst):
    """Every rank holds every expert and no rank has a base load. Then any split is allowed, so
    the optimal peak is P = ceil(total / R), never above the all-local peak (the largest
    column sum); and a rank must hand off at least max(own_r − P, 0) of its own rows, so the
    most rows that can stay on rank r is min(own_r, P). The assignment must reach both bounds:
    optimal peak, and on every rank exactly min(own_r, P) of its own rows kept local (in
    particular every row stays local when the all-local assignment is already optimal)."""
    counts, _, _ = inst
    E, R = counts.shape
    holders = [list(range(R))] * E
    own_R = counts.sum(0)
    local_peak = int(own_R.max())
    assign = assign_min_peak(counts, holders)
    peak = check(counts, holders, assign)
    want = -(-int(counts.sum()) // R)
    assert peak == want, "not the optimal peak ceil(total / R)"
    assert peak <= local_peak, "worse than keeping every row local"
    kept_local_R = assign[:, torch.arange(R), torch.arange(R)].sum(0)
    assert torch.equal(kept_local_R, torch.clamp(own_R, max=peak)), "rows moved that could have stayed"
    if peak == local_peak:
        diag = assign[:, torch.arange(R), torch.arange(R)]
        assert torch.equal(diag, counts), "an optimal all-local assignment exists but rows moved"


def test_local_rows_stay_when_balanced():
    counts = torch.tensor([[5, 5], [5, 5]])
    assign = assign_min_peak(counts, [[0, 1], [0, 1]])
    assert assign[:, 0, 1].sum() == 0 and assign[:, 1, 0].sum() == 0


def test_deterministic_and_errors():
    counts = torch.tensor([[3, 4, 0], [0, 9, 2], [1, 1, 1]])
    holders = [[0, 2], [1], [0, 1, 2]]
    a = assign_min_peak(counts, holders)
    assert torch.equal(a, assign_min_peak(counts.clone(), [list(h) for h in holders]))
    with pytest.raises(ValueError, match="no holder"):
        assign_min_peak(counts, [[0], [], [1]])
    with pytest.raises(ValueError, match="infeasible capacity"):
        assign_min_peak(counts, holders, capacity_R=[2, 2, 2])
    with pytest.raises(ValueError, match="holders has"):
        assign_min_peak(counts, holders[:2])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.randoms(use_true_random=False))
def test_pair_assignment_views_match_the_dense_form(R, E, rnd):
    """Every view the row plans and the fitting read off the compact form equals the same view of
    the dense (E, S, R) tensor, for the min-peak planner's result (an entry per holder, some with
    no rows) and for an arbitrary dense assignment read back."""
    counts = torch.tensor([[rnd.randrange(0, 9) for _ in range(R)] for _ in range(E)])
    holders = [sorted(rnd.sample(range(R), rnd.randint(1, R))) for _ in range(E)]
    compact = min_peak_assignment(counts, holders)
    assert [(int(e), int(r)) for e, r in zip(compact.expert_H, compact.rank_H)] == [
        (e, r) for e, hs in enumerate(holders) for r in hs]
    arbitrary = torch.tensor([[[rnd.randrange(0, 3) * (rnd.random() < 0.3) for _ in range(R)] for _ in range(R)]
                              for _ in range(E)])
    for pairs in (compact, PairAssignment.from_dense(arbitrary)):
        dense = pairs.dense()
        assert torch.equal(PairAssignment.from_dense(dense).dense(), dense)
        assert torch.equal(pairs.rows_ER(), dense.sum(1))
        assert pairs.rows_R() == dense.sum((0, 1)).tolist()
        assert torch.equal(pairs.rows_SR(), dense.sum(0))
        for s in range(R):
            assert torch.equal(pairs.sent_ER(s), dense[:, s, :])
        experts = rnd.sample(range(E), rnd.randint(0, E))
        for r in range(R):
            assert torch.equal(pairs.received_SL(r, experts), dense[experts, :, r].t().reshape(R, len(experts)))
    assert torch.equal(compact.dense(), assign_min_peak(counts, holders))


# ------------------------------------------------------------------- against the frozen planner


def test_assign_min_peak_matches_reference():
    rng = np.random.default_rng(0)
    for case in range(600):
        R = int(rng.integers(1, 11))
        E = int(rng.integers(0, 33)) if case % 50 else 0
        counts = random_counts(rng, (E, R))
        holders = random_holders(rng, E, R, messy=case % 7 == 0)
        if case % 29 == 0 and E:
            holders[-1] = [R]  # not a rank
        base = None if rng.random() < 0.5 else rng.integers(0, 40, R).tolist()
        capacity = None
        if rng.random() < 0.7:  # from ample down to infeasible, sometimes below the base
            low = np.asarray(base or [0] * R)
            capacity = (low + rng.integers(-2, 1 + int(counts.sum()) // max(R // 2, 1) + 3, R)).tolist()
        same_outcome(ref_assign_min_peak, assign_min_peak, torch.from_numpy(counts), holders, capacity, base)


def test_assign_min_peak_matches_reference_at_paper_scale():
    for seed in range(3):
        counts_SE, _, placement = paper_scale(seed)
        holders = placement.holder_lists
        assign = same_outcome(ref_assign_min_peak, assign_min_peak, counts_SE.t(), holders)
        # the layer's call: the placement's own index, one entry per (expert, holder)
        compact = min_peak_assignment(counts_SE.t(), placement.holder_index)
        assert torch.equal(compact.dense(), assign)
        assert [(int(e), int(r)) for e, r in zip(compact.expert_H, compact.rank_H)] == [
            (e, r) for e, hs in enumerate(holders) for r in hs]
        cap = [int(assign.sum((0, 1)).max()) * 9 // 10] * counts_SE.shape[0]  # below the peak: infeasible
        same_outcome(ref_assign_min_peak, assign_min_peak, counts_SE.t(), holders, cap)
        kept = counts_SE.t() // 2
        same_outcome(ref_assign_min_peak, assign_min_peak, kept, holders, [int(kept.sum()) // 50] * len(cap))
