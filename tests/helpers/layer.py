"""What the layer's tests share: the tolerance check, seeded problems and token splits, the two
small model shapes, skewed routing, a recorder of what crossed the wire and the GEMM seam, and
the extra arguments some systems need."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lrmoe import ClusterBudget, MoEConfig, MoELayer, experts
from lrmoe.parallel import comm
from tests.oracles.dense_moe import reference_grads

ATOL = 2e-5

QWEN = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2)
GLM = dict(dim=16, ffn_dim=24, num_experts=8, top_k=2, router="sigmoid", n_group=2, topk_group=1,
           routed_scaling_factor=2.5, num_shared_experts=1, shared_ffn_dim=12)


def close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = ATOL) -> None:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = max(want.float().abs().max().item() if want.numel() else 0.0, 1.0)
    assert err <= atol * scale, f"{name}: max abs error {err:.3g} (scale {scale:.3g})"


def equals_kept_reference(layer: MoELayer, x_grad_local: torch.Tensor, x: torch.Tensor, g: torch.Tensor, sd: dict,
                          cfg: MoEConfig, sizes: list[int], group, label: str = "") -> None:
    """The layer's latest backward equals the dense reference's with exactly its kept pairs and
    their weights (collective): this rank's dx (``sizes``: every rank's tokens, in rank order)
    and every full-shape gradient."""
    rank = comm.rank_of(group)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    keep = comm.all_gather(layer.last_kept, sizes, group)
    scale = None if layer.last_scale is None else comm.all_gather(layer.last_scale, sizes, group)
    _, ref_dx, ref_grads, _ = reference_grads(x, g, sd, cfg, keep_TK=keep, scale_TK=scale)
    close(f"{label} dx", x_grad_local, ref_dx[lo:hi])
    grads = layer.gather_full_grads()
    for name, want in ref_grads.items():
        close(f"{label} grad {name}", grads[name], want)


def make_problem(cfg: MoEConfig, n_tokens: int, seed: int, skew: str):
    """A full state dict and full inputs, identical on every rank (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    sd = MoELayer(cfg).state_dict()
    x = torch.randn(n_tokens, cfg.dim, generator=gen)
    g = torch.randn(n_tokens, cfg.dim, generator=gen)
    if skew != "none":
        # Every token gets a common direction u; the router row of expert 0 is ∓(large)·u.
        u = torch.ones(cfg.dim) / cfg.dim**0.5
        x = x + 3.0 * u
        sd["router.weight"][0] = (-8.0 if skew == "empty_expert" else 8.0) * u
    if "router.e_score_correction_bias" in sd:
        sd["router.e_score_correction_bias"] = 0.1 * torch.randn(cfg.num_experts, generator=gen)
    return sd, x, g


def split_tokens(n_tokens: int, world: int, empty_rank: int | None) -> list[int]:
    sizes = [n_tokens // world] * world
    sizes[-1] += n_tokens - sum(sizes)
    if empty_rank is not None and world > 1:
        sizes[(empty_rank + 1) % world] += sizes[empty_rank]
        sizes[empty_rank] = 0
    return sizes


def skewed_tokens(cfg, n, seed, skew):
    """Inputs whose routing is skewed: 'hot' pushes most tokens to expert 0."""
    sd, x, g = make_problem(cfg, n, seed, "none")
    if skew == "hot":
        u = torch.ones(cfg.dim) / cfg.dim**0.5
        x = x + 2.0 * u
        sd["router.weight"][0] = 4.0 * u
    return sd, x, g


class Recorder:
    """Wraps ``dist.all_to_all_single`` and the two seam functions, logging what they carried."""

    def __init__(self, monkeypatch, rank: int) -> None:
        self.a2a: list[tuple[int, int]] = []  # (bytes sent to others, bytes received from others)
        self.gemm_rows: list[tuple[str, int]] = []
        real_a2a, real_mm, real_wgrad = dist.all_to_all_single, experts.grouped_mm, experts.grouped_mm_wgrad

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            shaped = input if input.shape[0] else output  # a rank may send nothing yet receive
            row = shaped[0:1].numel() * shaped.element_size() if shaped.shape[0] else 0
            sent = (sum(input_split_sizes) - input_split_sizes[rank]) * row
            recv = (sum(output_split_sizes) - output_split_sizes[rank]) * row
            self.a2a.append((sent, recv))
            return real_a2a(output, input, output_split_sizes, input_split_sizes, group=group,
                            async_op=async_op)

        def mm(a, b, counts, *args, **kwargs):  # the rows a call multiplies: Σ counts (an operand may have gaps)
            self.gemm_rows.append(("mm", int(counts.sum())))
            assert int(counts.sum()) <= a.shape[0]
            return real_mm(a, b, counts, *args, **kwargs)

        def wgrad(a, b, counts, *args, **kwargs):
            self.gemm_rows.append(("wgrad", int(counts.sum())))
            assert int(counts.sum()) <= a.shape[0]
            return real_wgrad(a, b, counts, *args, **kwargs)

        monkeypatch.setattr(dist, "all_to_all_single", a2a)
        monkeypatch.setattr(experts, "grouped_mm", mm)
        monkeypatch.setattr(experts, "grouped_mm_wgrad", wgrad)

    def take(self) -> tuple[list, list]:
        out = (self.a2a, self.gemm_rows)
        self.a2a, self.gemm_rows = [], []
        return out


# ------------------------------------------------------------------- systems' extra arguments

FAST_LINK = 1e6  # Gbit/s: moving weights is nearly free, so cost-driven planners do move them
TRACE_EXPERTS = 8  # smartmoe's trace is for the 8 experts of the tests that use these arguments


def system_kwargs(system: str, world: int, nodes: int) -> dict:
    """The arguments a replication-family system needs beyond the config, at ``world`` ranks in
    ``nodes`` nodes."""
    if system == "topoep":
        return {"budget": ClusterBudget(ranks_per_node=world // nodes)}
    if system in ("flexmoe", "fastermoe"):
        return {"budget": ClusterBudget(inter_node_gbps=FAST_LINK), "load_ema": 0.0}
    if system == "smartmoe":  # a trace whose steps alternate between two hot experts
        trace = torch.ones(6, TRACE_EXPERTS)
        trace[::2, 0] = 40
        trace[1::2, 5] = 40
        return {"routing_trace": trace}
    return {}
