"""Errors a layer raises on purpose, importable without the rest of the package."""

from __future__ import annotations


class MemoryBudgetExceeded(ValueError):  # noqa: N818 - the name the issue and users know
    """A layer's expert side cannot live within ``ClusterBudget.memory_bytes`` (docs/design.md
    "The paper's regime").

    Raised by the planner from values every rank shares (global counts, the placement, the one
    byte model), so every rank of the layer's group raises it at the same point: while planning
    a call, after the count exchange and before any row is exchanged (no collective is left half
    done), or when the layer is built if the cap cannot even hold the experts a rank owns.

    A ``ValueError``: the configured cap is too small for the work asked of it, like any other
    budget that cannot be met; training records it as an out-of-memory stop. ``rank`` is the
    rank that does not fit, ``needed`` the bytes its expert side would hold at its peak under
    the best plan tried, ``cap`` its budget, ``hint`` what would help.
    """

    def __init__(self, rank: int, needed: int, cap: int, hint: str = "", what: str = "this call") -> None:
        self.rank, self.needed, self.cap, self.hint, self.what = int(rank), int(needed), int(cap), hint, what
        msg = (f"memory budget too small: rank {self.rank} needs {self.needed} bytes of expert-side memory for "
               f"{what}, its cap (ClusterBudget.memory_bytes) is {self.cap}")
        super().__init__(msg + (f"; {hint}" if hint else ""))

    def __reduce__(self):  # picklable across processes with its fields
        return type(self), (self.rank, self.needed, self.cap, self.hint, self.what)
