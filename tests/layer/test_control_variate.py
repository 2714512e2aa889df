"""The control variate for dropped pairs (``BackwardConfig(control_variate=True)``,
:mod:`lrmoe.passes.control`): its means are the slots' own, an exact backward is unchanged by
it, and a trimmed one stays unbiased with less noise, on one rank and across two (the dropped
mass exchanged a row per slot, replicas included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lrmoe import BackwardConfig, ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from lrmoe.passes.control import SAMPLE_ROWS, control_means
from tests.helpers.layer import QWEN, make_problem, split_tokens
from tests.helpers.pool import RankPool

CFG = MoEConfig(**QWEN)


@pytest.fixture(scope="module")
def pool():
    p = RankPool(world=2)
    yield p
    p.close()


def test_the_means_are_each_slots_own():
    """Slots of 3, 0 and 5 rows (fewer than the sample: every row counts): the mean x, h,
    silu(gate) and up ⊙ silu'(gate) of each, silu' by autograd; zeros for the empty slot."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 5])
    x = torch.randn(8, 6)
    gate_up = torch.randn(3, 2 * 4, 6)
    means = control_means(x, gate_up, counts)
    slot = [0, 0, 0, 2, 2, 2, 2, 2]
    gate = torch.stack([x[r] @ gate_up[s, :4].T for r, s in enumerate(slot)]).requires_grad_(True)
    up = torch.stack([x[r] @ gate_up[s, 4:].T for r, s in enumerate(slot)])
    silu = F.silu(gate)
    (dsilu,) = torch.autograd.grad(silu.sum(), gate)
    for got, rows in ((means.x_LD, x), (means.h_LF, silu * up), (means.silu_LF, silu), (means.dsilu_up_LF, dsilu * up)):
        torch.testing.assert_close(got[0], rows[:3].mean(0).detach())
        torch.testing.assert_close(got[2], rows[3:].mean(0).detach())
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    none = control_means(x[:0], gate_up, torch.tensor([0, 0, 0]))  # a rank that received no row
    assert all(torch.equal(m, torch.zeros_like(m)) for m in (none.x_LD, none.h_LF, none.silu_LF, none.dsilu_up_LF))
    rows = torch.randn(40, 6)
    many = control_means(rows, gate_up, torch.tensor([40, 0, 0]))
    sample = rows[torch.arange(SAMPLE_ROWS) * 40 // SAMPLE_ROWS]  # a slot of more rows: evenly spaced ones
    torch.testing.assert_close(many.x_LD[0], sample.mean(0))
    assert not torch.allclose(many.x_LD[0], rows.mean(0)), "the sample's mean, not every row's"


def _draws(group, cv: bool, ratio: float, n: int, scores: str = "residuals") -> tuple[torch.Tensor, torch.Tensor, int]:
    """(the full expert-weight gradients of ``n`` draws of one batch, stacked; the dense
    reference's; the run's replica slots)."""
    world, rank = comm.world_size(group), comm.rank_of(group)
    sd, x, g = make_problem(CFG, 512, 5, "hot_expert")
    x = 0.25 * x + 0.75 * x.mean(0)  # tokens sharing most of their direction, as a trained model's do
    sizes = split_tokens(512, world, None)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])

    def grads(layer: MoELayer) -> torch.Tensor:
        layer.zero_grad(set_to_none=True)
        layer(x[lo:hi].clone().requires_grad_(True)).backward(g[lo:hi])
        full = layer.gather_full_grads()
        layer.step_end()  # (replicas follow the load)
        return torch.cat([full["experts.gate_up_proj"].flatten(), full["experts.down_proj"].flatten()])

    dense = MoELayer(CFG, system="static", group=group)
    dense.load_full_state_dict(sd)
    layer = MoELayer(CFG, system="lrmoe", group=group, budget=ClusterBudget(10**9),
                     backward=BackwardConfig(ratio=ratio, control_variate=cv, variate_scores=scores))
    layer.load_full_state_dict(sd)
    draws = torch.stack([grads(layer) for _ in range(n)])
    return draws, grads(dense), layer.last_stats["replica_slots"] - len(layer.placement.owned(rank))


def unbiased_and_less_noisy(group, scores: str = "residuals") -> tuple[float, ...]:
    """(relative bias of the mean, relative mean squared error) without and with the variate
    (drawn by ``scores``); the replica slots of the run with it."""
    out = []
    for cv in (False, True):
        draws, ref, replicas = _draws(group, cv, 0.5, 150, scores)
        norm = ref.pow(2).sum()
        out += [float((draws.mean(0) - ref).pow(2).sum() / norm), float((draws - ref).pow(2).sum(1).mean() / norm)]
    return (*out, replicas)


def exact_when_every_pair_is_kept(group) -> None:
    draws, ref, _ = _draws(group, True, 1.0, 2)
    # float32 sums over 512 rows in the layer's row order (by routing weight) and the dense one's
    torch.testing.assert_close(draws[-1], ref, rtol=1e-5, atol=1e-5)


def test_every_pair_kept_is_exact_with_it(pool):
    exact_when_every_pair_is_kept(None)
    pool.run(2, exact_when_every_pair_is_kept)


@pytest.mark.parametrize("world", [1, 2])
def test_a_trimmed_backward_stays_unbiased_with_less_noise(pool, world):
    """150 draws at ratio 0.5 on inputs sharing most of their direction (the hot-expert problem): the mean's
    squared error is that of 150 draws' spread (unbiased), and the variate's error per draw is
    under half the plain draw's."""
    runs = [unbiased_and_less_noisy(None)] if world == 1 else pool.run(2, unbiased_and_less_noisy)
    bias, mse, bias_cv, mse_cv, _ = runs[0]
    if world == 2:
        assert sum(r[-1] for r in runs) > 0, "a rank holds a replica: its slot's mean and dropped mass"
    assert bias < 3 * mse / 150 and bias_cv < 3 * mse_cv / 150, (bias, mse, bias_cv, mse_cv)
    assert mse_cv < 0.5 * mse, (mse, mse_cv)


def test_drawn_by_contributions_it_stays_unbiased_with_less_noise():
    """``variate_scores="contributions"``: the plain draw's π (dx no noisier), the variate's
    correction on top — unbiased, and under half the plain draw's error per draw (with the same
    π and no correction the two would be equal)."""
    bias, mse, bias_cv, mse_cv, _ = unbiased_and_less_noisy(None, "contributions")
    assert bias < 3 * mse / 150 and bias_cv < 3 * mse_cv / 150, (bias, mse, bias_cv, mse_cv)
    assert mse_cv < 0.5 * mse, (mse, mse_cv)


def _dx(variate: str | None) -> torch.Tensor:
    """dx of one trimmed backward (ratio 0.5, one rank) without the variate (None) or with it
    drawn by ``variate`` scores, from the same weights, batch and sampler seed."""
    sd, x, g = make_problem(CFG, 256, 7, "hot_expert")
    backward = BackwardConfig(ratio=0.5, control_variate=variate is not None, variate_scores=variate or "residuals")
    layer = MoELayer(CFG, system="lrmoe", budget=ClusterBudget(10**9), backward=backward)
    layer.load_full_state_dict(sd)
    x = (0.25 * x + 0.75 * x.mean(0)).requires_grad_(True)
    layer(x).backward(g)
    return x.grad


def test_drawn_by_contributions_the_kept_pairs_are_the_plain_draws():
    """The variate corrects the weight gradients only, so with the plain draw's kept pairs and
    weights dx is the plain backward's to the last bit; drawn by the residuals it is not."""
    plain = _dx(None)
    assert torch.equal(_dx("contributions"), plain)
    assert not torch.equal(_dx("residuals"), plain)


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="control_variate"):
        BackwardConfig(control_variate=1)
    with pytest.raises(ValueError, match="variate_scores"):
        BackwardConfig(control_variate=True, variate_scores="residual")
