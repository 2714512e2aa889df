"""The meter of one layer call: bytes a rank holds for the experts as the routed path allocates
and frees them, and their peak (docs/design.md "Expert-side memory"). Exchanges report the rows
they deliver and free through :class:`lrmoe.parallel.comm.Channel`'s hook, which the meter is.
"""

from __future__ import annotations

import torch

from lrmoe.memory.bytes import nbytes


class MemoryMeter:
    """Bytes a rank holds for the experts during one layer call, and their peak.

    Follows the lifetimes of the tensors the routed path allocates: parameters and gradient
    buffers, received rows, intermediates, send/receive buffers of the backward.
    """

    def __init__(self, base: int) -> None:
        self.now = self.peak = base

    def hold(self, *tensors: torch.Tensor | None) -> None:
        self.now += nbytes(*tensors)
        self.peak = max(self.peak, self.now)

    def drop(self, *tensors: torch.Tensor | None) -> None:
        self.now -= nbytes(*tensors)

    def reach(self, extra: int) -> None:
        """A transient of ``extra`` bytes on top of what is held (freed at once)."""
        self.peak = max(self.peak, self.now + extra)
