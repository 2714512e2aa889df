"""What the cost-driven planners believe about the hardware: one pair's expert work and one
byte on a rank's link, in seconds."""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.memory.bytes import expert_param_bytes

ADAM_STATES = 2  # optimizer state per parameter moved with a bound replica, and optimizer_bytes' moments


@dataclass(frozen=True)
class CostModel:
    """``row_s``: seconds to push one pair through an expert, forward and backward (≈ 18·D·F FLOPs
    at ``gemm_flops``); ``byte_s``: seconds per byte on a rank's link. Defaults: 1 TFLOP/s and
    100 Gbit/s; a :class:`~lrmoe.config.ClusterBudget` with ``inter_node_gbps`` sets the link.
    """

    dim: int
    ffn_dim: int
    elem_bytes: int
    gemm_flops: float = 1e12
    link_gbps: float = 100.0

    @property
    def row_s(self) -> float:
        return 18 * self.dim * self.ffn_dim / self.gemm_flops

    @property
    def byte_s(self) -> float:
        return 8 / (self.link_gbps * 1e9)

    @property
    def expert_bytes(self) -> int:
        return expert_param_bytes(self.dim, self.ffn_dim, self.elem_bytes)

    @property
    def row_wire_bytes(self) -> int:
        """A remote pair crosses the link four times: x out, y back, dy out, dx back."""
        return 4 * self.dim * self.elem_bytes
