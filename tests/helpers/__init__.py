"""Helpers the tests share (no tests here): ``layer`` (problems, tolerances, the wire recorder,
systems' arguments), ``fuzz`` (the fuzz case and a layer of any system), ``planning`` (comparisons
with the frozen planners), ``train`` (the tiny config, the command line) and ``pool`` (the gloo
ranks the session fixtures of tests/conftest.py run cases on)."""
