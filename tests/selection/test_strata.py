"""Local selections in strata (lrmoe.selection.strata): exact kept counts known from the plan alone
(the restricted pair assignment split by largest remainder), each stratum's share kept, the
backward's rows moved with no exchange before them, and no data-dependent host read."""

from __future__ import annotations

import traceback
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lrmoe import BackwardConfig, MoEConfig, MoELayer
from lrmoe.config import SELECTIONS
from lrmoe.parallel import comm
from lrmoe.planning.assignment import PairAssignment
from lrmoe.selection import scaled_squared_norms, select_in_strata
from lrmoe.selection.strata import kept_positions
from tests.helpers.layer import QWEN


def _random_assignment(rng: np.random.Generator) -> PairAssignment:
    E, W = int(rng.integers(1, 9)), int(rng.integers(1, 7))
    A = np.zeros((E, W, W), np.int64)
    for e in range(E):
        for h in rng.choice(W, size=int(rng.integers(1, W + 1)), replace=False):
            A[e, :, h] = rng.integers(0, 7, size=W)
    return PairAssignment.from_dense(torch.from_numpy(A))


def _restricted_by_fractions(a: PairAssignment, kept_SE: np.ndarray) -> np.ndarray:
    """The documented split with exact fractions: floors, then the largest remainders, ties to
    the earlier entry."""
    out = np.zeros_like(a.rows_HS)
    for e in range(a.num_experts):
        hs = np.flatnonzero(a.expert_H == e)
        for s in range(a.world):
            rows, k = a.rows_HS[hs, s], int(kept_SE[s, e])
            if rows.sum() == 0:
                continue
            exact = [Fraction(k * int(r), int(rows.sum())) for r in rows]
            floors = [int(x) for x in exact]
            by_remainder = sorted(range(len(hs)), key=lambda j: (floors[j] - exact[j], j))
            for j in by_remainder[: k - sum(floors)]:
                floors[j] += 1
            out[hs, s] = floors
    return out


def test_restricted_splits_each_source_and_expert_by_largest_remainder():
    rng = np.random.default_rng(0)
    for _ in range(300):
        a = _random_assignment(rng)
        counts_SE = a.dense().sum(2).t().numpy()
        kept_SE = np.floor(rng.random(counts_SE.shape) * (counts_SE + 1)).astype(np.int64)
        got = a.restricted(kept_SE)
        assert (got.rows_HS == _restricted_by_fractions(a, kept_SE)).all()
        assert (got.rows_HS <= a.rows_HS).all()
        assert torch.equal(got.dense().sum(2).t(), torch.from_numpy(kept_SE))
    a = _random_assignment(np.random.default_rng(1))
    with pytest.raises(ValueError, match="more pairs kept"):
        a.restricted(a.dense().sum(2).t() + 1)


@pytest.mark.parametrize("selection", ["local-sampled", "local"])
def test_select_in_strata_keeps_each_share(selection):
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([5, 0, 9, 1, 30])
    share = torch.tensor([2, 0, 9, 0, 7])
    group = torch.repeat_interleave(torch.arange(5), sizes)
    for trial in range(20):
        scores = torch.rand(len(group), generator=gen, dtype=torch.float64) ** 8
        if trial % 2:
            scores[[0, 1, 2, 20]] = float("nan")  # three non-finite pairs in a stratum keeping two
        keep, scale, nonfinite = select_in_strata(scores, group, share, BackwardConfig(selection), gen)
        kept = torch.zeros(5, dtype=torch.long).index_add_(0, group, keep.long())
        assert torch.equal(kept, share)
        assert bool(nonfinite) == bool(trial % 2)
        if trial % 2:
            assert keep[[0, 1, 20]].all() and not keep[2], "non-finite pairs first, in pair order"
        if selection == "local":
            assert scale is None
            top = scores[15:45].argsort(descending=True)[:7] + 15  # stratum 4, no non-finite pair
            assert keep[top].all()
        else:
            assert bool((scale[keep] >= 1).all()) and bool((scale[~keep] == 0).all())


def test_kept_positions_is_nonzero_with_a_known_count():
    gen = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 100):
        keep = torch.rand(n, generator=gen) < 0.3
        assert torch.equal(kept_positions(keep, int(keep.sum())), keep.nonzero().squeeze(1))


# ------------------------------------------------------------------- host reads (CPU proxy)

_ATEN = torch.ops.aten
_READS = {_ATEN.nonzero.default, _ATEN._local_scalar_dense.default, _ATEN.masked_select.default,
          _ATEN.bincount.default, _ATEN.unique_consecutive.default, _ATEN._unique2.default,
          _ATEN.unique_dim.default, _ATEN.is_nonzero.default, _ATEN.equal.default}


class HostReads(TorchDispatchMode):
    """Records every op that needs a tensor's values on the host (a scalar read, or an output
    whose size depends on the data: nonzero, boolean indexing, bincount, repeat_interleave
    without ``output_size``, unique), located at its innermost lrmoe frame. On CUDA each is a
    device→host synchronisation; on the CPU this finds them without a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: set[tuple[str, str, str]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = func in _READS
        if func is _ATEN.repeat_interleave.Tensor:
            read = kwargs.get("output_size") is None
        elif func in (_ATEN.index.Tensor, _ATEN.index_put_.default, _ATEN.index_put.default):
            read = any(i is not None and i.dtype == torch.bool for i in args[1])
        if read:
            frame = next((f for f in reversed(traceback.extract_stack()) if "/lrmoe/" in f.filename), None)
            self.sites.add((Path(frame.filename).name if frame else "?", frame.name if frame else "?", func.__name__))
        return func(*args, **kwargs)


def host_reads_case(group, selection: str):
    """One lrmoe backward at ratio 0.25 under :class:`HostReads`, ‖g‖² as on CUDA."""
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr("lrmoe.passes.selectors.squared_norms", scaled_squared_norms)
        cfg = MoEConfig(**QWEN)
        torch.manual_seed(comm.rank_of(group))
        layer = MoELayer(cfg, system="lrmoe", group=group, backward=BackwardConfig(selection, ratio=0.25))
        x = torch.randn(40, cfg.dim, requires_grad=True)
        y = layer(x)
        reads = HostReads()
        with reads:
            y.backward(torch.randn_like(y))
        return sorted(reads.sites), layer.last_stats["keep_mode"]
    finally:
        mp.undo()


@pytest.mark.parametrize("world", [1, 2])
def test_local_selection_backward_reads_nothing_from_the_device(pool, world):
    """The default selection's backward: scores, strata, sample, packing and the row plan stay
    where the scores are; every split size comes from the plan. A global
    selection's reads are found, so the check can fail."""
    for selection in ("local-sampled", "local"):
        for sites, keep in pool.run(world, host_reads_case, selection):
            assert keep == "x+acts" and sites == [], (selection, sites)
    lrm = pool.run(world, host_reads_case, "lrm")[0][0]
    assert ("global_selection.py", "nonfinite_counts", "bincount.default") in lrm, lrm
    assert set(SELECTIONS) == {"lrm", "random", "local", "sampled", "local-sampled"}
