"""The testbed's link with the paper's ratio of dispatch time to forward expert-GEMM time.

Per routed pair, a forward's expert GEMMs do ``6·D·F`` FLOP (gate, up, down) and its dispatch
sends the pair's row, ``D·s`` bytes (``s`` the element size). On Qwen3-30B-A3B (D = 2048, F = 768,
bf16) that is 2,304 FLOP a byte; an H100-class GPU (about 300 TFLOP/s sustained on grouped
GEMMs) behind one 400 Gbit/s NIC sends a byte per 6,000 FLOP, so across nodes the dispatch takes
:data:`PAPER_RATIO` = 6,000 / 2,304 ≈ 2.6 times the forward GEMMs. A rank of the testbed whose
link gives the same ratio sends a pair's row in 2.6 times its GEMMs' time:

    link bits/s a rank = 8·D·s / (PAPER_RATIO · 6·D·F / rate) = 8·s·rate / (6·F·PAPER_RATIO)

with ``rate`` the forward expert GEMMs' FLOP/s measured here (one thread, the layer's grouped
GEMM, :func:`measure_gemm_gflops`). A node's link carries its ranks' traffic, so it gets
``ranks_per_node`` times that (the paper's nodes have one NIC per GPU). docs/design.md has the
figures for the project's configs.
"""

from __future__ import annotations

import time

import torch

QWEN3_D, QWEN3_F, BF16 = 2048, 768, 2
GPU_FLOPS = 300e12  # an H100-class GPU's sustained grouped-GEMM rate (an assumption, as in DESIGN.md)
NIC_BPS = 400e9  # one 400 Gbit/s NIC per GPU
PAPER_FLOP_PER_BYTE = 6 * QWEN3_D * QWEN3_F / (QWEN3_D * BF16)  # 2,304
PAPER_RATIO = (GPU_FLOPS / (NIC_BPS / 8)) / PAPER_FLOP_PER_BYTE  # dispatch ÷ forward GEMMs ≈ 2.60


def paper_link_gbps(dim: int, ffn_dim: int, elem_bytes: int, gemm_gflops: float, ranks_per_node: int = 1) -> float:
    """A node's link (Gbit/s) at which the testbed's dispatch takes :data:`PAPER_RATIO` times its
    forward expert GEMMs (module docstring); ``dim`` cancels."""
    per_rank_bps = 8 * elem_bytes * gemm_gflops * 1e9 / (6 * ffn_dim * PAPER_RATIO)
    return ranks_per_node * per_rank_bps / 1e9


def measure_gemm_gflops(dim: int, ffn_dim: int, num_experts: int, rows: int = 4096, dtype=torch.float32,
                        repeats: int = 7) -> float:
    """FLOP/s (in G) of a forward's expert GEMMs on this machine, one thread: ``rows`` rows over
    ``num_experts`` experts through the layer's grouped GEMM (gate and up, SwiGLU, down), the
    median of ``repeats`` after a warm-up, rounded to two significant digits so that a second
    measurement usually gives the same link."""
    from lrmoe.grouped_gemm import grouped_mm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x_RD = torch.randn(rows, dim, generator=gen, dtype=dtype)
        w_up_EDF = torch.randn(num_experts, dim, 2 * ffn_dim, generator=gen, dtype=dtype) / dim**0.5
        w_down_EFD = torch.randn(num_experts, ffn_dim, dim, generator=gen, dtype=dtype) / ffn_dim**0.5
        counts_E = torch.full((num_experts,), rows // num_experts, dtype=torch.long)
        counts_E[: rows % num_experts] += 1

        def forward() -> None:
            gate_up = grouped_mm(x_RD, w_up_EDF, counts_E)
            h = torch.nn.functional.silu(gate_up[:, :ffn_dim]) * gate_up[:, ffn_dim:]
            grouped_mm(h, w_down_EFD, counts_E)

        forward()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    gflops = 6 * rows * dim * ffn_dim / sorted(times)[repeats // 2] / 1e9
    return float(f"{gflops:.2g}")
