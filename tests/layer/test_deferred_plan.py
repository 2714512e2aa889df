"""The backward's plan is planned during the forward, after its expert work and before ``save``
(lrmoe.passes.forward.plan_backward; before the expert work where a chunked forward must know
what it keeps: tests/layer/test_keep_modes.py), and the backward calls no planner: a local selection's
strata and, where nothing was kept, its kept pairs' assignment come from the call's record."""

from __future__ import annotations

import sys

import pytest
import torch

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.memory import KEEP_MODES
from lrmoe.parallel import comm
from lrmoe.planning.balance import min_peak_assignment
from lrmoe.planning.controller import max_min_quotas
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.planner import LayerPlanner
from lrmoe.selection.strata import plan_strata
from tests.helpers.layer import QWEN, make_problem, split_tokens
from tests.helpers.pool import RankPool

# what plans: the planner's entry points and every planner function the backward once called,
# watched wherever the library's modules hold them
METHODS = ("plan_forward", "plan_backward", "plan_call")
FUNCTIONS = (min_peak_assignment, assign_pairs, max_min_quotas, plan_strata)
STAGES = ("dispatch", "compute", "combine", "save")  # lrmoe.passes.forward's


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=2)
    yield p
    p.close()


def _logged(fn, name: str, log: list, phase: list):
    def logged(*args, **kwargs):
        log.append((name, phase[0]))
        return fn(*args, **kwargs)
    return logged


def _watch(mp: pytest.MonkeyPatch, log: list, phase: list) -> None:
    """Log every call of the planners and the forward's stages, with the pass it came in."""
    import lrmoe.passes.forward as forward

    for name in METHODS:
        mp.setattr(LayerPlanner, name, _logged(getattr(LayerPlanner, name), name, log, phase))
    for fn in FUNCTIONS:
        for module in [m for n, m in sys.modules.items() if n.startswith("lrmoe")]:
            if getattr(module, fn.__name__, None) is fn:
                mp.setattr(module, fn.__name__, _logged(fn, fn.__name__, log, phase))
    for name in STAGES:
        mp.setattr(forward, name, _logged(getattr(forward, name), name, log, phase))


def deferred_case(group, selection: str, mode: str):
    """One training call with the keep mode forced: (what ran in the forward, in order; what
    planned in the backward; the kept set)."""
    import lrmoe.passes.function as function

    cfg = MoEConfig(**QWEN)
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(cfg, 48, 5, "hot")
    sizes = split_tokens(48, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    log, phase = [], ["forward"]
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(LayerPlanner, "keep_mode", lambda self, *args: mode)
        _watch(mp, log, phase)
        backward = function.routed_backward

        def in_backward(*args):
            phase[0] = "backward"
            return backward(*args)
        mp.setattr(function, "routed_backward", in_backward)
        layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(selection, ratio=0.5, seed=3))
        layer.load_full_state_dict(sd)
        log.clear()
        layer(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
    finally:
        mp.undo()
    assert layer.last_stats["keep_mode"] == mode
    forward = [name for name, when in log if when == "forward"]
    return forward, [name for name, when in log if when == "backward"], layer.last_kept.clone()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("selection", ["local-sampled", "local"])
def test_the_backward_plan_is_planned_in_the_forward_and_read_from_the_record(pool, world, selection):
    kept = {}
    for mode in KEEP_MODES:
        for forward, backward, kept_TK in pool.run(world, deferred_case, selection, mode):
            assert backward == [], f"{mode}: the backward planned {backward}"
            stages = [n for n in forward if n in ("plan_forward", "plan_backward", *STAGES)]
            want = ["plan_forward", "dispatch", "compute", "combine", "plan_backward", "save"]
            assert stages == want, (mode, forward)
            assert "plan_strata" in forward, "the strata were planned with the backward's plan"
            kept.setdefault(mode, []).append(kept_TK)
    for mode in KEEP_MODES:  # every mode keeps the same pairs (the strata fix them)
        assert all(torch.equal(a, b) for a, b in zip(kept[mode], kept[KEEP_MODES[0]])), mode
