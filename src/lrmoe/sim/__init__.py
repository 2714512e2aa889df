"""Paper-scale projection of MoE-layer training time to target and memory (docs/simulation.md).

One idea per module, data flowing one way: ``config`` (the inputs) and ``models`` (real shapes) → ``trace`` (routing
counts) → ``layer_calls`` (the library's placement, quotas, keep modes and redistribution; ``host``:
host planning from the benchmark's recorded figures) → ``memory`` / ``budget`` (expert-side and
whole-step bytes) → ``hardware`` / ``cost`` (α–β all-to-all, roofline GEMMs) → ``target``
(steps to target from measured runs) → ``summary`` (a system's results row) → ``runner`` (a
system's run, a step's bytes) → ``search`` (the fair rules: slot and budget searches) → ``run``
(the projection) → ``whatif`` → ``report``.
"""
