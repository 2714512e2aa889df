"""The expert side's memory: one byte model, the meter that follows a call's tensors, and its
replay on numbers.

    bytes.py   ByteModel (bytes per slot, per row), the keep modes, and kept_to_backward: what the
               expert side keeps from forward to backward (decided once for the layer, the replay
               and the simulator); RowSplit: a call keeping by the row
    meter.py   MemoryMeter: bytes held during one layer call and their peak (the exchanges' hook)
    replay.py  RankWork and expert_side_peak: the meter replayed on numbers (planning, simulation)
"""

from lrmoe.memory.bytes import (
    GIB,
    H_SQ_BYTES,
    KEEP_MODES,
    KEEP_NOTHING,
    KEEP_X,
    KEEP_X_ACTS,
    KEEP_X_GATE_UP,
    ByteModel,
    Kept,
    RowSplit,
    expert_param_bytes,
    kept_to_backward,
    nbytes,
    position_bytes,
)
from lrmoe.memory.meter import MemoryMeter
from lrmoe.memory.replay import RankWork, expert_side_peak

__all__ = ["GIB", "H_SQ_BYTES", "KEEP_MODES", "KEEP_NOTHING", "KEEP_X", "KEEP_X_ACTS", "KEEP_X_GATE_UP",
           "ByteModel", "Kept", "MemoryMeter", "RankWork", "RowSplit", "expert_param_bytes", "expert_side_peak",
           "kept_to_backward", "nbytes", "position_bytes"]
