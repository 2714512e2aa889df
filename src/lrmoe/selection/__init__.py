"""Which pairs the LRMoE backward keeps: LRM scores, global and local selections, sampling, strata."""
