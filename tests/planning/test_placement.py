"""Replica placement (lrmoe.planning.placement): the hot expert copied within the ranks' slots,
ownership never moving; and plan_replicas, its helpers (copies by load, LPT placement) and LAER's
layout against the planners before the speed-ups (tests/oracles/planners.py), bit for bit and
error for error, on random cases (ties, zero and negative loads, too few slots, nodes) and at
paper scale (128 experts x 64 ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lrmoe.planning.placement import Placement, copies_by_load, place_copies, plan_replicas
from lrmoe.planning.strategies import laer_layout
from tests.helpers.planning import paper_scale, same_outcome
from tests.oracles.planners import ref_copies_by_load, ref_laer_layout, ref_place_copies, ref_plan_replicas


def test_replica_planner():
    base = Placement.static(8, 4)
    load = torch.tensor([100.0, 1, 1, 1, 1, 1, 1, 1])
    p = plan_replicas(base, load, [3, 3, 3, 3])
    assert len(p.holders(0)) == 4, "the hot expert is copied to every rank"
    assert all(len(s) <= 3 for s in p.slots)
    assert all(p.owned(r) == base.owned(r) for r in range(4)), "ownership never moves"
    assert p.slots[0][:2] == (0, 1) and p.replicas(0) == tuple(sorted(p.replicas(0)))
    with pytest.raises(ValueError, match="owns"):
        plan_replicas(base, load, [1, 3, 3, 3])


def test_replica_planning_matches_reference():
    rng = np.random.default_rng(3)
    for case in range(300):
        W = int(rng.integers(1, 9))
        E = int(rng.integers(1, 25))
        base = Placement.static(E, W)
        owned = [len(base.owned(r)) for r in range(W)]
        slots = [o + int(rng.integers(0, 4)) for o in owned]
        if case % 31 == 0:
            slots[0] = owned[0] - 1  # too few slots: an error
        load = rng.integers(0, 6, E).astype(float) * rng.choice([1.0, 0.5, 1 / 3])  # ties
        load[rng.random(E) < 0.2] = 0.0
        if case % 5 == 0:
            load[0] = -1.0
        node_of = None if case % 3 else sorted(rng.integers(0, 3, W).tolist())
        same_outcome(ref_plan_replicas, plan_replicas, base, torch.from_numpy(load), slots, node_of)
        counts = torch.from_numpy(rng.integers(0, 5, E) * rng.integers(0, 2, E))
        same_outcome(ref_laer_layout, laer_layout, counts, base, slots)
        # the two helpers directly, from uneven starts
        copies = rng.integers(0, W + 2, E).tolist()
        free = int(rng.integers(-1, 2 * W))
        assert copies_by_load(list(load), copies, free, W) == ref_copies_by_load(list(load), copies, free, W)
        units = [(float(rng.integers(0, 4)), int(rng.integers(0, E))) for _ in range(int(rng.integers(0, 12)))]
        rank_load = rng.integers(0, 3, W).astype(float).tolist()
        free_R = rng.integers(0, 3, W).tolist()
        holds = [set(rng.integers(0, E, int(rng.integers(0, 3))).tolist()) for _ in range(W)]
        args = (units, rank_load, free_R, holds, node_of)
        ref_args = (units, list(rank_load), list(free_R), [set(h) for h in holds], node_of)
        assert place_copies(*args) == ref_place_copies(*ref_args)
        assert (rank_load, free_R, holds) == ref_args[1:4]


def test_replica_planning_matches_reference_at_paper_scale():
    for seed in range(2):
        counts_SE, base, _ = paper_scale(seed)
        slots = [len(base.owned(r)) + 1 for r in range(base.world)]
        load = counts_SE.sum(0).to(torch.float64)
        same_outcome(ref_plan_replicas, plan_replicas, base, load, slots)
        same_outcome(ref_plan_replicas, plan_replicas, base, load, slots, [r // 8 for r in range(base.world)])
        same_outcome(ref_laer_layout, laer_layout, counts_SE.sum(0), base, slots)
