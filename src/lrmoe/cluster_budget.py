"""Per-rank budgets of an MoE layer's expert side and the cluster's topology (the controller's
inputs, docs/design.md "Controller"), validated at construction like every config."""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.validation import bad, ints_per_rank, is_number


@dataclass(frozen=True)
class ClusterBudget:
    """Per-rank budgets of an MoE layer's expert side (docs/design.md "Controller"), and the cluster's
    topology.

    ``memory_bytes``: expert slots (parameters + gradient buffers of owned experts and
    replicas) plus token-row buffers, forward and backward; it engages ``lrmoe``'s controller
    (``None``: unbounded). ``network_bytes``: optional bound on the bytes a rank's expert side
    receives and returns in one backward (kept rows in, their dx out); ``network_fraction``: the
    same as a fraction of what a rank with the call's mean load receives and returns when it keeps
    nothing (x and dy in, dx out for each of its pairs), set anew for each call — the simulator's
    ``--network-budget``; not with ``network_bytes``. The network budget bounds what ``lrmoe``'s
    controller keeps, so it applies only with ``memory_bytes`` (alone it changes nothing, and the
    other systems do not read it). ``slots``: optional fixed
    number of expert slots per rank, which then takes precedence over slots derived from memory.
    Each is one int for every rank or a list with one per rank. ``ranks_per_node``: ranks
    ``[n·k, (n+1)·k)`` share node n (``topoep`` plans by it; every system then reports
    inter-node bytes); ``intra_node_gbps`` / ``inter_node_gbps``: link bandwidths (Gbit/s) for
    the cost-driven planners.
    """

    memory_bytes: int | list[int] | None = None
    network_bytes: int | list[int] | None = None
    network_fraction: float | None = None
    slots: int | list[int] | None = None
    ranks_per_node: int | None = None
    intra_node_gbps: float | None = None
    inter_node_gbps: float | None = None

    def __post_init__(self) -> None:
        for name, minimum in (("memory_bytes", 1), ("network_bytes", 1), ("slots", 1)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, (list, tuple)):
                ints_per_rank(name, value, len(value), minimum)
            else:
                ints_per_rank(name, value, 1, minimum)
        if self.network_fraction is not None:
            if not (is_number(self.network_fraction) and self.network_fraction > 0):
                raise bad("network_fraction", self.network_fraction, "expected a number > 0 (of a balanced "
                           "rank's keep-nothing backward bytes)")
            if self.network_bytes is not None:
                raise bad("network_fraction", self.network_fraction, "expected network_bytes or network_fraction, "
                           "not both")
        if self.ranks_per_node is not None:
            ints_per_rank("ranks_per_node", self.ranks_per_node, 1, 1)
        for name in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise bad(name, value, "expected a number > 0 (Gbit/s)")

    def per_rank(self, world: int) -> tuple[list[int] | None, list[int] | None, list[int] | None]:
        """(memory, network, slots) as one value per rank; lists must have ``world`` entries."""
        return (
            ints_per_rank("memory_bytes", self.memory_bytes, world, 1),
            ints_per_rank("network_bytes", self.network_bytes, world, 1),
            ints_per_rank("slots", self.slots, world, 1),
        )

    def node_of(self, world: int) -> list[int] | None:
        """Node of each rank, or None without a topology."""
        if self.ranks_per_node is None:
            return None
        if world % self.ranks_per_node:
            raise bad("ranks_per_node", self.ranks_per_node, f"expected a divisor of the world size {world}")
        return [r // self.ranks_per_node for r in range(world)]
