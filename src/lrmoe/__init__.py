"""lrmoe: Mixture-of-Experts training with expert parallelism and the LRMoE backward."""

from lrmoe.balance import assign_min_peak
from lrmoe.config import BackwardConfig, ClusterBudget, MoEConfig
from lrmoe.layer import MoELayer
from lrmoe.systems import SYSTEMS

__all__ = ["BackwardConfig", "ClusterBudget", "MoEConfig", "MoELayer", "SYSTEMS", "assign_min_peak"]
__version__ = "0.1.0"
