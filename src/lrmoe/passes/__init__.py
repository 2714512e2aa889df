"""The routed experts' forward and backward passes.

    record.py     LayerContext (what the passes use of their layer) and CallRecord (one call,
                  from its forward to its backward), with the Selector and RowPath it names
    saved.py      what the expert side keeps from the forward to the backward
    backward_rows.py  what the backward's stages hand one another: Kept, DyRows, BackwardRows
    stats.py      CallStats: a call's figures, typed; MoELayer.last_stats is its dict view
    stages.py     the passes' stage names and the clock that times them (stats' stage_ms)
    weights.py    the slot weights a call computes with, fetched before its forward
    forward.py    plan → fetch weights → dispatch → compute → combine → save
    backward.py   select → plan rows → dispatch → compute → return
    selectors.py  the backward's selection: the forward's pairs, a global one, a local one in strata
    row_paths.py  the backward's row path, chosen once from the plan with its selection
    expert_rows.py, rounds.py, compaction.py  the expert backward over received rows; exchanges
                  in rounds; the kept rows brought together (gathered or in place)
    function.py   RoutedExperts, the autograd function of both passes
"""

from lrmoe.passes.backward import routed_backward
from lrmoe.passes.forward import routed_forward
from lrmoe.passes.function import RoutedExperts
from lrmoe.passes.record import CallLog, CallRecord, LayerContext
from lrmoe.passes.stats import CallStats

__all__ = ["CallLog", "CallRecord", "CallStats", "LayerContext", "RoutedExperts", "routed_backward", "routed_forward"]
