"""lrmoe: Mixture-of-Experts training with expert parallelism and the LRMoE backward."""

from lrmoe.config import BackwardConfig, MoEConfig
from lrmoe.layer import SYSTEMS, MoELayer

__all__ = ["BackwardConfig", "MoEConfig", "MoELayer", "SYSTEMS"]
__version__ = "0.1.0"
