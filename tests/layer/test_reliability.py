"""Routing extremes for every system, a fuzz over random small configurations, gradient
accumulation, activation checkpointing and evaluation interleaved with training."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

from lrmoe import ClusterBudget, MoEConfig, MoELayer
from lrmoe.parallel import comm
from tests.helpers.fuzz import ALL_SYSTEMS, any_system_layer, fuzz_case
from tests.helpers.layer import close, split_tokens
from tests.oracles.dense_moe import reference_grads


def extreme_case(group, case: str, dtype: str, systems=ALL_SYSTEMS):
    """Every system on one extreme input; outputs and gradients against the fp32 dense
    reference (bf16: within bf16 precision), never a silent NaN."""
    world, rank = comm.world_size(group), comm.rank_of(group)
    E, K, n, scale, empty_rank = 4, 2, 24, 1.0, None
    if case == "top_k=E":
        K = E
    elif case == "top_k=1":
        K = 1
    elif case == "one-token":
        n = 1
    elif case == "rank-no-tokens":
        empty_rank = 0
    elif case == "large":
        scale = 1e4
    elif case == "small":
        scale = 1e-4
    cfg = MoEConfig(dim=16, ffn_dim=16, num_experts=E, top_k=K, dtype=dtype)
    torch.manual_seed(3)
    sd = {k: v.float() for k, v in MoELayer(MoEConfig(dim=16, ffn_dim=16, num_experts=E, top_k=K)).state_dict().items()}
    gen = torch.Generator().manual_seed(4)
    x = scale * torch.randn(n, 16, generator=gen)
    g = torch.randn(n, 16, generator=gen)
    u = torch.ones(16) / 4.0
    if case in ("one-expert", "never-chosen"):
        x = x + 3.0 * scale * u
        sd["router.weight"][1] = (8.0 if case == "one-expert" else -8.0) * u
    if dtype != "float32":  # the reference sees the same rounded values, so routing agrees
        x = x.to(cfg.torch_dtype).float()
        sd = {k: v.to(cfg.torch_dtype).float() if "experts" in k else v for k, v in sd.items()}
    sizes = split_tokens(n, world, empty_rank) if n >= world else [n] + [0] * (world - 1)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    ref_out, ref_dx, ref_grads, _ = reference_grads(x, g, sd, MoEConfig(dim=16, ffn_dim=16, num_experts=E, top_k=K))
    tol = 2e-5 if dtype == "float32" else 6e-2
    for system in systems:
        layer = any_system_layer(cfg, system, group)
        layer.load_full_state_dict({k: v.to(cfg.torch_dtype) if v.is_floating_point() and "router" not in k
                                    else v for k, v in sd.items()})
        xs = x[lo:hi].to(cfg.torch_dtype).clone().requires_grad_(True)
        out = layer(xs)
        out.float().backward(g[lo:hi])
        assert torch.isfinite(out).all() and torch.isfinite(xs.grad).all(), (system, case)
        rel = max(ref_out.abs().max().item(), 1e-30)
        close(f"{system} out", out.float().detach() / rel, ref_out[lo:hi] / rel, tol)
        rel_dx = max(ref_dx.abs().max().item(), 1e-30)
        close(f"{system} dx", xs.grad.float() / rel_dx, ref_dx[lo:hi] / rel_dx, tol)
        grads = layer.gather_full_grads()
        # a gradient that is zero in exact arithmetic (the router's at top_k = 1 after
        # renormalisation) is roundoff in both: judge it on the scale of the others
        floor = 1e-2 * max(w.abs().max().item() for w in ref_grads.values())
        for name, want in ref_grads.items():
            r = max(want.abs().max().item(), floor, 1e-30)
            close(f"{system} {name}", grads[name].float() / r, want / r, tol)
    return True


CASES = ["one-expert", "never-chosen", "rank-no-tokens", "top_k=E", "top_k=1", "one-token", "large", "small"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_routing_extremes_fp32(pool, world, case):
    pool.run(world, extreme_case, case, "float32")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["one-expert", "rank-no-tokens", "large", "small"])
def test_routing_extremes_bf16(pool, world, case):
    pool.run(world, extreme_case, case, "bfloat16")


# ------------------------------------------------------------------- fuzz (the case: tests/helpers/fuzz.py)


configs = st.tuples(
    st.integers(1, 4),  # world
    st.integers(1, 9),  # E
    st.integers(1, 3),  # K (clipped to E)
    st.sampled_from([4, 8, 12]),  # D
    st.sampled_from([0.0, 2.0, 6.0]),  # skew
    st.sampled_from(ALL_SYSTEMS),
    st.booleans(),  # (B, S, D) input
    st.integers(0, 10_000),
)


@settings(max_examples=40, deadline=None)
@given(configs)
def test_fuzz_against_dense_reference(pool, params):
    world, E, K, D, skew, system, shape3d, seed = params
    pool.run(world, fuzz_case, E, min(K, E), D, skew, system, shape3d, seed)


# ------------------------------------------------------------------- training patterns


def patterns_case(group, system):
    """Gradient accumulation over two micro-batches, activation checkpointing, and a no_grad
    evaluation between a training forward and its backward: gradients equal the reference."""
    world, rank = comm.world_size(group), comm.rank_of(group)
    cfg = MoEConfig(dim=16, ffn_dim=16, num_experts=4, top_k=2)
    torch.manual_seed(7)
    sd = MoELayer(cfg).state_dict()
    gen = torch.Generator().manual_seed(8)
    n = 8 * world
    xa, xb, ga, gb = (torch.randn(n, 16, generator=gen) for _ in range(4))
    lo, hi = rank * 8, (rank + 1) * 8
    kw = {"budget": ClusterBudget(10**8)} if system == "lrmoe" else {}
    layer = MoELayer(cfg, system=system, group=group, **kw)
    layer.load_full_state_dict(sd)
    # micro-batch a through activation checkpointing, then an eval call, then micro-batch b
    xa_l = xa[lo:hi].clone().requires_grad_(True)
    out_a = checkpoint(layer, xa_l, use_reentrant=False)
    with torch.no_grad():
        layer(torch.randn(5, 16))  # evaluation between forward and backward
    out_a.backward(ga[lo:hi])
    assert "bwd_a2a_bytes" in layer.last_stats, "the backward's stats are the layer's last"
    xb_l = xb[lo:hi].clone().requires_grad_(True)
    layer(xb_l).backward(gb[lo:hi])
    want_a = reference_grads(xa, ga, sd, cfg)
    want_b = reference_grads(xb, gb, sd, cfg)
    close("dx a", xa_l.grad, want_a[1][lo:hi])
    close("dx b", xb_l.grad, want_b[1][lo:hi])
    grads = layer.gather_full_grads()
    for name in want_a[2]:
        close(f"accumulated {name}", grads[name], want_a[2][name] + want_b[2][name])
    return True


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("system", ["static", "lrmoe", "symi", "ultraep", "laer", "fastermoe"])
def test_accumulation_checkpointing_and_eval(pool, world, system):
    pool.run(world, patterns_case, system)
