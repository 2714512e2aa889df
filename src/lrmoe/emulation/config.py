"""The ``[cluster]`` table: how many emulated nodes a run spans and what their links carry."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lrmoe.train.config_checks import ConfigError, require_int

PAPER = "paper"  # link_gbps: the testbed's link with the paper's ratio (lrmoe.emulation.paper_link)
MAX_NODES = 100  # node i is 198.18.0.(100 + i) (lrmoe.emulation.namespaces)


@dataclass(frozen=True)
class ClusterConfig:
    """``emulate_nodes``: 0 runs the ranks on this machine's loopback as they are; N ≥ 1 puts
    them on N emulated nodes (``train.nproc / N`` ranks each). ``link_gbps``: each node's link,
    Gbit/s in each direction, or ``"paper"`` (none: unshaped). ``link_latency_us``: added
    one-way latency between two nodes (needs the kernel's netem queueing discipline).
    ``gemm_gflops``: this machine's forward expert-GEMM rate, which ``"paper"`` and the network
    budget derive from (none: measured before launch, :mod:`lrmoe.emulation.paper_link`; the
    resolved config holds the figure used, so a run repeats exactly)."""

    emulate_nodes: int = 0
    link_gbps: float | str | None = None
    link_latency_us: float = 0.0
    gemm_gflops: float | None = None

    def __post_init__(self) -> None:
        require_int("cluster.emulate_nodes", self.emulate_nodes, 0)
        if self.emulate_nodes > MAX_NODES:
            raise ConfigError(f"cluster.emulate_nodes={self.emulate_nodes} is invalid: expected at most {MAX_NODES}")
        gbps = self.link_gbps
        if gbps is not None and gbps != PAPER and not _positive(gbps):
            raise ConfigError(f"cluster.link_gbps={gbps!r} is invalid: expected a finite number > 0 (Gbit/s) or "
                              f"{PAPER!r}")
        latency = self.link_latency_us
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not 0 <= latency < math.inf:
            raise ConfigError(f"cluster.link_latency_us={latency!r} is invalid: expected a finite number >= 0 (µs)")
        if self.gemm_gflops is not None and not _positive(self.gemm_gflops):
            raise ConfigError(f"cluster.gemm_gflops={self.gemm_gflops!r} is invalid: expected a finite number > 0")
        if not self.emulate_nodes and (gbps is not None or latency):
            raise ConfigError("cluster.link_gbps and cluster.link_latency_us shape the links of emulated nodes: they "
                              "need cluster.emulate_nodes (--emulate-nodes N)")

    @property
    def emulated(self) -> bool:
        return self.emulate_nodes > 0


def _positive(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf


def parse_link_gbps(text: str) -> float | str:
    """``--link-gbps``: a number of Gbit/s or ``paper``."""
    if text.strip() == PAPER:
        return PAPER
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--link-gbps={text!r} is invalid: expected a number of Gbit/s or {PAPER!r}") from None
