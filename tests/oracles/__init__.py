"""Reference implementations the tests judge lrmoe by (no tests here): ``dense_moe``, an
independent dense MoE written without lrmoe code, and ``planners``, the planners as they were
before the speed-ups, kept verbatim as the reference the faster ones must match bit for bit."""
