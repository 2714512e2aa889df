"""The random streams of a layer's selective backwards: fresh per backward, reproducible from
``BackwardConfig.seed`` and the number of backwards so far (a checkpoint keeps that number)."""

from __future__ import annotations

import torch


class SelectionStreams:
    """Per backward: this rank's own stream and one every rank of the group seeds alike."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank
        self.calls = 0  # backwards that drew streams so far

    def next(self) -> tuple[torch.Generator, torch.Generator]:
        self.calls += 1
        base = (self.seed * 1_000_003 + self.calls) * 65_537
        own = torch.Generator().manual_seed((base + self.rank) % (2**63))
        return own, torch.Generator().manual_seed((base - 1) % (2**63))
