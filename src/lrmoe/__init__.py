"""lrmoe: Mixture-of-Experts training with expert parallelism and the LRMoE backward.

The algorithm and the definitions every module uses are in docs/design.md; how each system is
described, in docs/systems.md. Package layout, data flowing one way (config → router → planner → dispatch → experts →
combine, once each way per pass; inside the subpackages too: no module imports one that imports it,
tests/test_imports.py):

    config.py     typed configs: MoEConfig, BackwardConfig, ClusterBudget
    systems.py    one SystemSpec per system name, and the name parser (the only module that
                  knows system names)
    layer.py      MoELayer, the nn.Module facade
    router.py     softmax top-k (Qwen3) · sigmoid + correction bias (GLM-4.5)
    experts.py    grouped SwiGLU experts, forward and backward written out
    grouped_gemm.py  the one grouped-GEMM seam every expert product goes through
    errors.py     MemoryBudgetExceeded: a call or layer that cannot live within its memory cap
    planning/     LayerPlanner (planner.py) and one CallPlan per call: placement strategies (one
                  per planner a spec names), the assignment rule, min-peak balance, quotas, the
                  controller and its replica-count search, cap fitting, peak prediction
    memory/       the byte model, what the expert side keeps, the meter and its replay on numbers
    parallel/     collectives and the Channel that counts bytes, row layouts, the exchanges that
                  move rows, replicas, sharded experts
    selection/    LRM scores, global and local (strata) selections, sampling, random streams (one
                  code for NumPy on the host and torch on a device)
    passes/       the routed experts' forward and backward in stages, the kept rows' compaction,
                  their call record, CallStats
    models/ train/ sim/ integrations/ cli.py   models, training and compare, the paper-scale
                  projection, transformers patching, the command line

Shape suffixes on tensor names (``x_TD``, ``counts_SE``, ``rows_HS``):

    T tokens at this rank (B·S flattened)    D model dim         F expert hidden dim
    K top-k slots                            E experts           X = 2F (gate and up fused)
    P pairs at this rank (T·K, row-major)    L local expert slots (owned, then replicas)
    S source ranks (where pairs come from)   R receiving ranks, or rows received at a rank
    W ranks of the expert-parallel group     N rows this rank sends (in plan order)
    H (expert, holder) entries of an assignment (``PairAssignment.rows_HS``)
"""

from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.errors import MemoryBudgetExceeded
from lrmoe.layer import MoELayer
from lrmoe.planning.balance import assign_min_peak
from lrmoe.systems import SYSTEMS, SystemSpec, parse_system_name, spec_of

__all__ = ["BackwardConfig", "ClusterBudget", "MemoryBudgetExceeded", "MoEConfig", "MoELayer", "SYSTEMS", "SystemSpec",
           "assign_min_peak", "parse_system_name", "spec_of"]
__version__ = "0.1.0"
