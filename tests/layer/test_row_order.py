"""The forward's send order by a key (lrmoe.parallel.rows.row_layout's ``order_key_P``): within
each (destination, slot) run the pairs follow the key, ascending from an even rank, descending
from an odd one, and who goes where is the unkeyed layout's; on replicas too (pairs handed to
holders in pair order, then ordered)."""

from __future__ import annotations

import pytest
import torch

from lrmoe.parallel.rows import row_layout
from lrmoe.planning.pair_rules import assign_pairs
from lrmoe.planning.placement import Placement
from lrmoe.systems import Assignment

E, W, P = 6, 3, 90


def _runs(layout, ids_P: torch.Tensor, placement: Placement) -> list[torch.Tensor]:
    """The pair ids of each (destination, slot) run of a layout, in send order."""
    runs, at = [], 0
    for dest, n in enumerate(layout.send_splits):
        sent = layout.pair_idx[at : at + n]
        slot = torch.tensor([placement.slots[dest].index(int(e)) for e in ids_P[sent]], dtype=torch.long)
        runs += [sent[slot == s] for s in range(len(placement.slots[dest]))]
        assert torch.equal(slot, slot.sort().values), "slots in order within a destination"
        at += n
    return runs


@pytest.mark.parametrize("replicated", [False, True])
def test_a_key_orders_each_run_and_moves_no_pair(replicated):
    gen = torch.Generator().manual_seed(0)
    ids_SP = torch.randint(0, E, (W, P), generator=gen)
    counts_SE = torch.stack([torch.bincount(ids, minlength=E) for ids in ids_SP])
    placement = Placement.static(E, W)
    if replicated:  # expert 0 copied to every rank, expert 3 to rank 0
        placement = placement.with_replicas([[3], [0], [0]])
    assignment = assign_pairs(Assignment.MIN_PEAK, counts_SE, placement)
    for rank in range(W):
        key_P = torch.rand(P, generator=gen)
        plain = row_layout(ids_SP[rank], assignment, placement, rank)
        keyed = row_layout(ids_SP[rank], assignment, placement, rank, order_key_P=key_P)
        assert keyed.send_splits == plain.send_splits and torch.equal(keyed.slot_counts, plain.slot_counts)
        for a, b in zip(_runs(plain, ids_SP[rank], placement), _runs(keyed, ids_SP[rank], placement)):
            assert torch.equal(a.sort().values, b.sort().values), "the same pairs in every run"
            k = key_P[b]
            assert torch.equal(k, k.sort(descending=rank % 2 == 1).values), (rank, k)


def test_broken_keys_keep_their_runs():
    """A non-finite key (a broken routing weight) still leaves every pair in its run: the same
    splits and runs as without a key."""
    gen = torch.Generator().manual_seed(1)
    ids_SP = torch.randint(0, E, (W, P), generator=gen)
    counts_SE = torch.stack([torch.bincount(ids, minlength=E) for ids in ids_SP])
    placement = Placement.static(E, W).with_replicas([[3], [0], [0]])
    assignment = assign_pairs(Assignment.MIN_PEAK, counts_SE, placement)
    key_P = torch.rand(P, generator=gen)
    key_P[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    plain = row_layout(ids_SP[1], assignment, placement, 1)
    keyed = row_layout(ids_SP[1], assignment, placement, 1, order_key_P=key_P)
    assert keyed.send_splits == plain.send_splits
    for a, b in zip(_runs(plain, ids_SP[1], placement), _runs(keyed, ids_SP[1], placement)):
        assert torch.equal(a.sort().values, b.sort().values)


def _keys_given(monkeypatch, keep: str) -> list[bool]:
    """Whether each of three lrmoe calls (one rank, half the pairs kept, ``keep`` fixed) laid
    its forward rows out by a key."""
    from lrmoe import BackwardConfig, MoEConfig, MoELayer
    from lrmoe.passes import forward

    given, layout = [], forward.row_layout

    def recording(*args, order_key_P=None, **kwargs):
        given.append(order_key_P is not None)
        return layout(*args, order_key_P=order_key_P, **kwargs)

    monkeypatch.setattr(forward, "row_layout", recording)
    layer = MoELayer(MoEConfig(dim=16, ffn_dim=24, num_experts=4, top_k=2), system="lrmoe",
                     backward=BackwardConfig(ratio=0.5, keep=keep))
    for _ in range(3):
        layer(torch.randn(24, 16, requires_grad=True)).sum().backward()
    return given


def test_the_weight_order_follows_the_last_backward_that_kept_the_activations(monkeypatch):
    """A backward that kept x alone gathers it, in any order: the next forward keeps pair order."""
    assert _keys_given(monkeypatch, "x+acts") == [True, True, True]
    assert _keys_given(monkeypatch, "x") == [True, False, False]
