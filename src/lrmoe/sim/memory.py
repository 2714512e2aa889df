"""Expert-side memory of one rank in one layer call, analytically (docs/design.md "Expert-side memory").

:func:`expert_side_peak` and :class:`RankWork` live in :mod:`lrmoe.memory.replay`, where the layer's
planner uses them to keep a call within a memory cap; they are re-exported here. They replay
the layer's :class:`lrmoe.memory.meter.MemoryMeter` on numbers instead of tensors, the same
holds and drops in the same order, so for the rows a rank receives they give exactly
``layer.last_stats["peak_expert_side_bytes"]`` (the simulator's and the memory cap's tests check
it against the real layer). What is kept from forward to backward is
:func:`lrmoe.memory.bytes.kept_to_backward`'s, the one rule the layer follows too. The simulator applies them at paper
scale, where building the tensors is impossible; this module adds what a whole step keeps
(:func:`kept_between_passes`, :func:`home_bytes`). Byte figures come from
:class:`lrmoe.memory.bytes.ByteModel`, the layer's own byte model.
"""

from __future__ import annotations

from lrmoe.memory import H_SQ_BYTES, ByteModel, RankWork, RowSplit, expert_side_peak, kept_to_backward
from lrmoe.systems import SystemSpec, spec_of

__all__ = ["RankWork", "expert_side_peak", "home_bytes", "kept_between_passes"]


def kept_between_passes(system: str | SystemSpec, dim: int, ffn_dim: int, dtype_bytes: int, fwd_rows: int,
                        keep: str | None = None, chunked: bool = False, split: RowSplit | None = None) -> int:
    """Bytes the expert side keeps from a layer's forward to its backward: held for every MoE
    layer at once when the backward starts (what makes ``static`` run out of memory). A
    compacting backward keeps what its call's ``keep`` mode says (nothing, x, or x and the
    activations); activations are never kept from a chunked forward; a call keeping by the row
    keeps x, its activations part's four (row, F) activations and its gate/up part's two."""
    spec = spec_of(system)
    bm = ByteModel(dim, ffn_dim, dtype_bytes, spec.selective)
    if split is not None:
        return fwd_rows * bm.row + (4 * split.acts + 2 * split.gate_up) * ffn_dim * dtype_bytes
    kept = kept_to_backward(spec, keep, chunked)
    return fwd_rows * ((bm.row if kept.rows else 0) + (bm.fwd_compute if kept.acts else 0))


def home_bytes(tokens: int, dim: int, top_k: int, dtype_bytes: int, selective: bool) -> int:
    """Home-side bytes one layer keeps to its backward (the layer's ``home_bytes``: expert
    outputs y per pair, routing weights, ids, pair order, ‖h‖² when ``selective``) plus its input x."""
    P = tokens * top_k
    return P * dim * dtype_bytes + P * (dtype_bytes + 8 + 8) + (H_SQ_BYTES * P if selective else 0) \
        + tokens * dim * dtype_bytes
