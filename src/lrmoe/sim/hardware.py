"""Hardware assumptions of the cost model: spec-sheet rates plus efficiency factors.

GPU defaults are an NVIDIA H200 SXM node of 8 GPUs, from public spec sheets (assumptions, each
overridable): dense bf16 989 TFLOP/s, HBM3e 4.8 TB/s, NVLink 450 GB/s per direction per GPU
inside a node, one 400 Gbit/s NIC per GPU across nodes. Per-message latencies α and the
per-kernel launch cost are typical NCCL / CUDA figures, also assumptions. The efficiency
factors (share of peak a grouped GEMM or an elementwise kernel reaches) could not be measured
on a GPU in this project yet (docs/performance.md: figures pending), so the GPU defaults are
assumptions too; the CPU factors are *fitted* by benchmarks/calibrate_sim.py and stored in
``cpu_calibration.json`` next to this file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

CPU_CALIBRATION = Path(__file__).with_name("cpu_calibration.json")


@dataclass(frozen=True)
class Hardware:
    """Rates (per second) and efficiencies of one accelerator and its links."""

    name: str
    peak_flops: float  # dense FLOP/s in the layer's dtype
    mem_bw: float  # bytes/s of device memory
    intra_bw: float  # bytes/s per direction per device, inside a node
    inter_bw: float  # bytes/s per direction per device, across nodes
    alpha_intra: float  # s per message inside a node
    alpha_inter: float  # s per message across nodes
    devices_per_node: int
    gemm_eff: float  # share of peak_flops a grouped GEMM reaches
    mem_eff: float  # share of mem_bw an elementwise / copy kernel reaches
    launch_s: float  # fixed cost of one kernel (or, on CPU, one per-expert GEMM call)
    call_s: float = 0.0  # fixed cost of one layer call (CPU: Python and autograd overhead)
    select_pair_s: float = 0.0  # per scored pair of a selection beyond its sort passes (CPU: fitted)
    per_expert_gemm: bool = False  # CPU: the grouped GEMM is a loop of one GEMM per expert
    cores: int | None = None  # CPU: ranks beyond this share cores (compute slows by ranks/cores)
    host_overlaps: bool = True  # the host plans while the device works (False: a CPU, whose cores do both)

    def with_link_gbps(self, gbps: float) -> Hardware:
        """The same machine with an inter-node link of ``gbps`` Gbit/s per device."""
        return replace(self, inter_bw=gbps * 1e9 / 8)

    def to_dict(self) -> dict:
        return asdict(self)


H200 = Hardware(
    name="H200 SXM, 8 per node",
    peak_flops=989e12, mem_bw=4.8e12, intra_bw=450e9, inter_bw=400e9 / 8,
    alpha_intra=3e-6, alpha_inter=8e-6, devices_per_node=8,
    gemm_eff=0.6, mem_eff=0.7, launch_s=5e-6,
)
