"""The long fuzz run: ``python -m tests.fuzz_long --n 500 [--seed 0]``.

Random small configurations (world size 1–4, experts, top-k, width, routing skew, system,
(T, D) or (B, S, D) input) through the layer against the dense reference, on one pool of
gloo ranks; prints a line per 50 configurations and the total. The suite runs 40 of them
(tests/layer/test_reliability.py); this script is for long runs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tests.helpers.fuzz import ALL_SYSTEMS, fuzz_case
from tests.helpers.pool import RankPool


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    pool = RankPool(4)
    t0, by_system = time.time(), dict.fromkeys(ALL_SYSTEMS, 0)
    try:
        for i in range(args.n):
            world = int(rng.integers(1, 5))
            E = int(rng.integers(1, 10))
            K = int(rng.integers(1, min(E, 3) + 1))
            system = str(rng.choice(ALL_SYSTEMS))
            params = (E, K, int(rng.choice([4, 8, 12])), float(rng.choice([0.0, 2.0, 6.0])), system,
                      bool(rng.integers(2)), int(rng.integers(10_000)))
            try:
                pool.run(world, fuzz_case, *params)
            except AssertionError as e:
                raise SystemExit(f"configuration {i} (world={world}, {params}) failed:\n{e}") from None
            by_system[system] += 1
            if (i + 1) % 50 == 0:
                print(f"{i + 1} configurations passed ({time.time() - t0:.0f} s)", flush=True)
    finally:
        pool.close()
    print(f"{args.n} configurations passed against the dense reference: {by_system}")


if __name__ == "__main__":
    main()
