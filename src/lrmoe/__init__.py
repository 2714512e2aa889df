"""lrmoe: Mixture-of-Experts training with expert parallelism and the LRMoE backward.

The algorithm, the definitions every module uses and how each system is described are in
docs/design.md. Package layout, data flowing one way:

    config.py    typed configs: MoEConfig, BackwardConfig, ClusterBudget
    systems.py   one SystemSpec per system name, and the name parser
    router.py    softmax top-k (Qwen3) · sigmoid + correction bias (GLM-4.5)
    plan.py      LayerPlanner: placement and one CallPlan per call (controller.py, planners.py,
                 placement.py, holders.py, balance.py, quotas.py, quota_ratio.py are its pure,
                 deterministic parts;
                 assignment.py the form of its result: where each pair is computed)
    dispatch.py  row plans and the exchanges that move rows (comm.py counts the bytes)
    experts.py   grouped SwiGLU experts and the one grouped-GEMM seam
    selection.py LRM scores and the kept sets of the backward
    meter.py     the byte model of the expert side and its replay (a call's peak from its plan)
    errors.py    MemoryBudgetExceeded: a call or layer that cannot live within its memory cap
    routed.py    the routed experts' autograd function and the call record
    layer.py     MoELayer, the nn.Module facade

Shape suffixes on tensor names (``x_TD``, ``counts_SE``, ``assign_ESR``):

    T tokens at this rank (B·S flattened)    D model dim         F expert hidden dim
    K top-k slots                            E experts           X = 2F (gate and up fused)
    P pairs at this rank (T·K, row-major)    L local expert slots (owned, then replicas)
    S source ranks (where pairs come from)   R receiving ranks, or rows received at a rank
    W ranks of the expert-parallel group     N rows this rank sends (in plan order)
    H (expert, holder) entries of an assignment (``PairAssignment.rows_HS``)
"""

from lrmoe import _moved
from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.layer import MoELayer
from lrmoe.planning.balance import assign_min_peak
from lrmoe.systems import SYSTEMS, SystemSpec, parse_system_name, spec_of

__all__ = ["BackwardConfig", "ClusterBudget", "MemoryBudgetExceeded", "MoEConfig", "MoELayer", "SYSTEMS", "SystemSpec",
           "assign_min_peak", "parse_system_name", "spec_of"]
__version__ = "0.1.0"

_moved.install()  # the flat layout's import paths (lrmoe.balance, lrmoe.comm, ...) keep working
