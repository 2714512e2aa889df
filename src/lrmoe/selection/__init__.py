"""Which pairs the LRMoE backward keeps.

    scores.py            the LRM score w² · ‖g‖² · ‖h‖² of each pair, and finite squared norms
    global_selection.py  selections across ranks by a score exchange: lrm (exact global top-q),
                         random, sampled (one unbiased fixed-size sample over all ranks)
    strata.py            local selections, drawn per source rank in strata fixed by the plan
                         (local, local-sampled: nothing exchanged, every kept count known)
    sampling.py          fixed-size unbiased sampling (inclusion probabilities, systematic draw)
    streams.py           the random streams of each backward, reproducible from the seed
"""

from lrmoe.planning.quota_ratio import fixed_ratio_quota
from lrmoe.selection.global_selection import Selection, select
from lrmoe.selection.scores import lrm_scores, scaled_squared_norms, squared_norms
from lrmoe.selection.strata import largest_remainder, select_in_strata

__all__ = ["Selection", "fixed_ratio_quota", "largest_remainder", "lrm_scores", "scaled_squared_norms", "select",
           "select_in_strata", "squared_norms"]
