"""Freed host memory kept in the process, for the CPU path of training.

glibc's ``malloc`` serves a large block with its own ``mmap`` and returns it to the kernel on
``free``, and hands the top of its heap back once enough of it is free. A training step frees
its activations, rows and messages at the end of each pass, so on the CPU every step's large
tensors came back as fresh pages, each first touch a page fault: about as dear as the
elementwise work on those tensors. PyTorch's CUDA caching allocator keeps device memory for
reuse; this is the host's counterpart. The training worker sets it for every system alike.

Measured on ``configs/paper.toml`` under 0.65× static's peak (110 steps; medians of steps
51–110): page faults 2.3–2.7 M → 0.38 M a run; the MoE step 0–4 % cheaper for lrmoe, capped
static and llep alike, within single runs' noise (docs/training.md).
"""

from __future__ import annotations

import ctypes
import os
import sys

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# Blocks below 1 GiB come from the heap and stay there when freed; the heap's top is handed
# back only past 1 GiB free, and grows by 256 MiB at a time (address space, not resident pages).
MMAP_THRESHOLD_BYTES = 1 << 30
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 1 << 28


# glibc's environment settings of what keep_freed_memory sets
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_tuned_malloc() -> bool:
    """The user set these through the environment (``MALLOC_ENV`` or ``GLIBC_TUNABLES``)."""
    return any(k in os.environ for k in MALLOC_ENV) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")


def keep_freed_memory() -> bool:
    """Make this process's ``malloc`` keep freed large blocks for reuse. Returns whether it did:
    not off glibc Linux, nor where the user tuned ``malloc`` through the environment (their
    setting stands)."""
    if not sys.platform.startswith("linux") or user_tuned_malloc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (M_TOP_PAD, TOP_PAD_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)
