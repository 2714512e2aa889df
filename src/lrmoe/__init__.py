"""lrmoe: Mixture-of-Experts training with expert parallelism and the LRMoE backward."""

from lrmoe.config import MoEConfig
from lrmoe.layer import SYSTEMS, MoELayer

__all__ = ["MoEConfig", "MoELayer", "SYSTEMS"]
__version__ = "0.1.0"
