"""gloo's receives-first exchange (``LRMOE_A2A=receives-first``, the emulated cluster's) delivers
what ``all_to_all_single`` delivers, uneven and empty splits included, on subgroups too, and a
layer trains bit for bit the same with it."""

from __future__ import annotations

import os

import pytest
import torch

from lrmoe import MoEConfig, MoELayer
from lrmoe.parallel import comm


def exchange_case(group, kind: str):
    rank, W = comm.rank_of(group), comm.world_size(group)
    before = os.environ.get(comm.A2A_ENV)
    os.environ[comm.A2A_ENV] = kind
    try:
        gen = torch.Generator().manual_seed(rank)
        send_splits = [(rank * 3 + r * 5) % 4 for r in range(W)]  # zeros among them, own chunk too
        recv_splits = [(s * 3 + rank * 5) % 4 for s in range(W)]
        send = torch.randn(sum(send_splits), 3, generator=gen)
        counter = comm.WireCounter()
        pending = comm.all_to_all_start(send, send_splits, recv_splits, group, counter)
        got = pending.wait()
        return got, send, send_splits, counter.sent, counter.received
    finally:
        os.environ.pop(comm.A2A_ENV) if before is None else os.environ.update({comm.A2A_ENV: before})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_receives_first_delivers_every_row(pool, world):
    for kind in (comm.COLLECTIVE, comm.RECEIVES_FIRST):
        results = pool.run(world, exchange_case, kind)
        for r, (got, *_) in enumerate(results):
            expected = []
            for _, send_s, splits_s, _, _ in results:
                start = sum(splits_s[:r])
                expected.append(send_s[start:start + splits_s[r]])
            assert torch.equal(got, torch.cat(expected)), (kind, r)
        if kind == comm.COLLECTIVE:
            counts = [res[3:] for res in results]
        assert [res[3:] for res in results] == counts, "the bytes counted do not depend on the exchange"


def layer_case(group, kind: str):
    before = os.environ.get(comm.A2A_ENV)
    os.environ[comm.A2A_ENV] = kind
    try:
        cfg = MoEConfig(dim=16, ffn_dim=24, num_experts=6, top_k=2)
        torch.manual_seed(0)
        layer = MoELayer(cfg, system="lrmoe", group=group)
        torch.manual_seed(10 + comm.rank_of(group))
        x = torch.randn(12, cfg.dim, requires_grad=True)
        layer(x).square().sum().backward()
        return x.grad, [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    finally:
        os.environ.pop(comm.A2A_ENV) if before is None else os.environ.update({comm.A2A_ENV: before})


def test_a_layer_is_the_same_over_either_exchange(pool):
    a = pool.run(4, layer_case, comm.COLLECTIVE)
    b = pool.run(4, layer_case, comm.RECEIVES_FIRST)
    for (dx_a, grads_a), (dx_b, grads_b) in zip(a, b):
        assert torch.equal(dx_a, dx_b) and all(torch.equal(p, q) for p, q in zip(grads_a, grads_b))


def test_an_unknown_exchange_is_refused(monkeypatch):
    monkeypatch.setenv(comm.A2A_ENV, "fastest")
    with pytest.raises(ValueError, match="LRMOE_A2A='fastest' is invalid"):
        comm.exchange_kind()
