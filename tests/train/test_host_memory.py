"""Freed host memory kept for reuse (lrmoe.train.host_memory): a step's large tensors, freed and
allocated again, no longer come back as fresh pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lrmoe.train.host_memory import MALLOC_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# One process per case: malloc's settings are the process's. A "step" allocates ~100 MB of
# 8 MB tensors and a 36 MB one, touches them and frees them; the page faults of ten steps
# after a first one are counted.
PROBE = """
import resource, sys, torch
from lrmoe.train.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
def step():
    held = [torch.empty(4096, 512).fill_(1.0) for _ in range(12)]
    big = torch.empty(9000, 1024).fill_(1.0)
    del held, big
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""

PAGES_OF_A_STEP = (12 * 4096 * 512 + 9000 * 1024) * 4 // 4096


def faults_per_step(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in (*MALLOC_ENV, "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**clean, "OMP_NUM_THREADS": "1", **(env or {})})
    kept, faults = out.stdout.split()
    return kept, int(faults)


def test_kept_memory_spares_the_page_faults_of_every_step() -> None:
    kept, with_it = faults_per_step("keep")
    _, without = faults_per_step("plain")
    assert kept == "True"
    assert without > PAGES_OF_A_STEP // 8  # the probe does fault without it: the test can fail
    assert with_it < without // 4


def test_a_users_malloc_setting_stands() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.top_pad=0"}):
        kept, _ = faults_per_step("keep", env)
        assert kept == "False", env
    kept, _ = faults_per_step("keep", {"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"})
    assert kept == "True"  # tunables of something else
